"""``/v1/chat/completions``: chat templates, tools (``qwen3_coder`` tool calls) and reasoning (``<think>``)
parsed from the output, images, logprobs; whole responses or server-sent events."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from fp4moe.server.config import ServerConfig
from fp4moe.server.errors import ERROR_RESPONSES, APIError, check
from fp4moe.server.media import fetch_images, prepare_messages
from fp4moe.server.parsers.reasoning import ReasoningParser
from fp4moe.server.parsers.tool_calls import ToolCallParser, openai_tool_calls
from fp4moe.server.protocol import ChatCompletionRequest, clip
from fp4moe.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    TopLogprob,
)
from fp4moe.server.serving import Serving, serving
from fp4moe.server.streaming import event_stream, usage

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}},
)
async def chat(req: ChatCompletionRequest, request: Request):
    srv = serving(request)
    srv.check_model(req.model)
    check(
        req.response_format is None or req.response_format.get("type") == "text",
        "response_format json_object/json_schema is not supported yet (no guided decoding)",
        "response_format",
    )
    srv.check_n(req.n)
    tools = _tools_for(req, srv.config)
    messages, images = prepare_messages(
        req.messages, srv.llm.limit_images, srv.config.max_image_bytes, srv.config.allowed_media_domains
    )
    top = req.top_logprobs if req.logprobs else None
    try:
        params = req.sampling_params(srv.llm.max_model_len, (top or 0) if req.logprobs else None)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    check(
        req.requested_max_tokens is None or req.requested_max_tokens >= 1,
        f"max_tokens must be at least 1, got {req.requested_max_tokens}",
        "max_tokens",
    )
    srv.check_prompt_chars_at_least(req.text_chars())  # before templating: its cost grows with the text
    try:  # off the event loop: a long conversation takes the template a while to render
        text = await asyncio.to_thread(
            srv.llm.apply_chat_template, messages, tools=tools, **(req.chat_template_kwargs or {})
        )
    except Exception as e:  # template errors are the caller's messages
        raise APIError(400, f"cannot apply the chat template: {clip(str(e), 300)}") from None
    srv.check_prompt_chars(text, "messages")
    images = await srv.images.decode(await fetch_images(images, srv.config.max_image_bytes))
    opened_think = text.rstrip().endswith("<think>")
    forced = ""  # a named tool_choice starts the call in the prompt; the model writes its parameters
    if req.tool_choice is not None and not isinstance(req.tool_choice, str) and srv.config.tool_call_parser:
        forced = f"<tool_call>\n<function={req.tool_choice.function.name}>\n"
        text += ("</think>\n\n" if opened_think else "") + forced
        opened_think = False
    prompt = {"prompt": text, "multi_modal_data": {"image": images}} if images else text
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    seqs, queue = await srv.start(prompt, params, req.requested_max_tokens, None, param)

    def make_parsers():
        reasoning = ReasoningParser(opened_think) if srv.config.reasoning_parser and not forced else None
        tool = ToolCallParser(tools) if tools and srv.config.tool_call_parser else None
        return reasoning, tool, forced

    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": srv.config.served_model_name,
    }
    if req.stream:
        chunk = ChatCompletionChunk(**head, choices=[])
        return StreamingResponse(
            _chat_stream(srv, chunk, req, seqs, queue, make_parsers), media_type="text/event-stream"
        )
    await srv.collect(seqs, queue, request)
    tokenizer, choices = srv.llm.tokenizer, []
    for i, seq in enumerate(seqs):
        reasoning_parser, tool_parser, prefix = make_parsers()
        reasoning, content, calls = _parse_whole(prefix + seq.text, reasoning_parser, tool_parser)
        message = AssistantMessage(
            content=content if (content or not calls) else None,
            reasoning_content=reasoning if srv.config.reasoning_parser else None,
            tool_calls=calls or None,
        )
        logprobs = None
        if req.logprobs:
            logprobs = ChatLogprobs(content=[_chat_logprob(tokenizer, r) for r in seq.logprobs])
        finish = _finish_reason(seq, bool(calls))
        choices.append(ChatChoice(index=i, message=message, finish_reason=finish, logprobs=logprobs))
    return ChatCompletionResponse(**head, choices=choices, usage=usage(seqs))


def _chat_stream(srv: Serving, chunk: ChatCompletionChunk, req, seqs, queue, make_parsers):
    """The stream's events: each sequence's role first, then its text deltas through the reasoning and
    tool-call parsers, then its finish reason; usage last when asked for."""
    parsers = [make_parsers() for _ in seqs]
    called = [False] * len(seqs)
    pending = [p[2] for p in parsers]  # a forced tool-call start, parsed with the first delta
    tokenizer = srv.llm.tokenizer

    def event(i, delta: dict, finish=None, logprobs=None) -> ChatCompletionChunk:
        choice = ChatStreamChoice(
            index=i, delta=DeltaMessage(**delta), finish_reason=finish, logprobs=logprobs
        )
        return chunk.model_copy(update={"choices": [choice]})

    def events(i, out):
        texts = [pending[i] + out.delta]
        pending[i] = ""
        if out.finished:
            texts.append(None)  # flush marker
        for text in texts:
            delta = _stream_delta(text, *parsers[i][:2])
            if delta.get("tool_calls"):
                called[i] = True
            lp = None
            if req.logprobs and text is not None and out.logprob is not None:
                lp = ChatLogprobs(content=[_chat_logprob(tokenizer, out.logprob)])
            if delta or lp:
                yield event(i, delta, logprobs=lp)
        if out.finished:
            yield event(i, {}, _finish_reason(out.seq, called[i]))

    def closing():
        return chunk.model_copy(update={"usage": usage(seqs)})

    want_usage = req.stream_options and req.stream_options.include_usage
    opening = [event(i, {"role": "assistant", "content": ""}) for i in range(len(seqs))]
    return event_stream(srv, seqs, queue, events, opening, closing if want_usage else None)


def _finish_reason(seq, called: bool) -> str:
    """The finish reason: "length" when the output was cut off (a call it held is content),
    else "tool_calls" when a complete call was made; the same for streamed and whole answers."""
    if seq.finish_reason.value == "length" or not called:
        return seq.finish_reason.value
    return "tool_calls"


def _tools_for(req: ChatCompletionRequest, config: ServerConfig) -> list[dict] | None:
    choice = req.tool_choice
    named = choice is not None and not isinstance(choice, str)
    if not req.tools or choice == "none":
        check(not named, "tool_choice names a function but no tools were given", "tool_choice")
        return None
    if named:
        name = choice.function.name
        check(
            name in {t.function.name for t in req.tools},
            f"tool_choice names {clip(name)!r}, which is not among the tools",
            "tool_choice",
        )
    elif choice == "required":
        raise APIError(
            400,
            "tool_choice 'required' is not supported; use 'auto', 'none' or a named function",
            param="tool_choice",
        )
    else:
        check(
            config.enable_auto_tool_choice and config.tool_call_parser is not None,
            '"auto" tool choice needs --enable-auto-tool-choice and --tool-call-parser',
            "tool_choice",
        )
    return [t.model_dump(exclude_none=True) for t in req.tools]


def _parse_whole(text: str, reasoning_parser, tool_parser) -> tuple[str | None, str, list[dict]]:
    reasoning = None
    content = text
    if reasoning_parser is not None:
        a, b = reasoning_parser.feed(text), reasoning_parser.finish()
        reasoning, content = (a.reasoning + b.reasoning).strip("\n") or None, a.content + b.content
    calls = []
    if tool_parser is not None:
        c = tool_parser.feed(content).content + tool_parser.finish().content
        calls = openai_tool_calls(tool_parser.calls)
        content = c.strip() if calls else c
    return reasoning, content, calls


def _stream_delta(text: str | None, reasoning_parser, tool_parser) -> dict:
    """One streamed text delta (None = end of output) through the parsers, as an OpenAI delta."""
    reasoning, content = "", text or ""
    if reasoning_parser is not None:
        d = reasoning_parser.feed(text) if text is not None else reasoning_parser.finish()
        reasoning, content = d.reasoning, d.content
    delta: dict = {}
    if tool_parser is not None:
        d = tool_parser.feed(content)
        content = d.content
        if text is None:
            content += tool_parser.finish().content
        if d.tool_calls:
            delta["tool_calls"] = [
                {
                    "index": t.index,
                    **({"id": t.id, "type": "function"} if t.id else {}),
                    "function": {
                        k: v for k, v in (("name", t.name), ("arguments", t.arguments)) if v is not None
                    },
                }
                for t in d.tool_calls
            ]
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    return delta


def _chat_logprob(tokenizer, r) -> ChatLogprob:
    def top(token_id: int, logprob: float) -> TopLogprob:
        token = tokenizer.decode([token_id])
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    first = top(r.token_id, r.logprob)
    return ChatLogprob(**dict(first), top_logprobs=[top(t, lp) for t, lp in (r.top_logprobs or {}).items()])
