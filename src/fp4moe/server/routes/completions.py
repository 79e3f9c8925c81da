"""``/v1/completions``: text or token-id prompts, logprobs; whole responses or server-sent events."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from fp4moe.server.errors import ERROR_RESPONSES, APIError, check
from fp4moe.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from fp4moe.server.serving import serving
from fp4moe.server.streaming import event_stream, usage

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}},
)
async def completions(req: CompletionRequest, request: Request):
    srv = serving(request)
    srv.check_model(req.model)
    srv.check_n(req.n)
    if isinstance(req.prompt, str):
        srv.check_prompt_chars(req.prompt, "prompt")
    else:
        check(
            len(req.prompt) < srv.llm.max_model_len,
            f"the prompt has {len(req.prompt)} tokens; the maximum model length is {srv.llm.max_model_len}",
            "prompt",
        )
    check(
        req.max_tokens is None or req.max_tokens >= 1,
        f"max_tokens must be at least 1, got {req.max_tokens}",
        "max_tokens",
    )
    try:
        params = req.sampling_params(srv.llm.max_model_len, req.logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    seqs, queue = await srv.start(
        req.prompt, params, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens"
    )
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": srv.config.served_model_name,
    }
    tokenizer = srv.llm.tokenizer
    if req.stream:
        response = CompletionResponse(**head, choices=[])

        def events(i, out):
            logprobs = None
            if req.logprobs is not None and out.logprob is not None:
                logprobs = _logprobs(tokenizer, [out.logprob], len(out.seq.text) - len(out.delta))
            finish = out.seq.finish_reason.value if out.finished else None
            choice = CompletionChoice(index=i, text=out.delta, finish_reason=finish, logprobs=logprobs)
            yield response.model_copy(update={"choices": [choice]})

        def closing():
            return response.model_copy(update={"usage": usage(seqs)})

        want_usage = req.stream_options and req.stream_options.include_usage
        return StreamingResponse(
            event_stream(srv, seqs, queue, events, closing=closing if want_usage else None),
            media_type="text/event-stream",
        )
    await srv.collect(seqs, queue, request)
    choices = [
        CompletionChoice(
            index=i,
            text=s.text,
            finish_reason=s.finish_reason.value,
            logprobs=_logprobs(tokenizer, s.logprobs, 0) if req.logprobs is not None else None,
        )
        for i, s in enumerate(seqs)
    ]
    return CompletionResponse(**head, choices=choices, usage=usage(seqs))


def _logprobs(tokenizer, records, offset: int) -> CompletionLogprobs:
    """Logprobs of tokens whose text starts at character ``offset`` of the output."""
    tokens = [tokenizer.decode([r.token_id]) for r in records]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[r.logprob for r in records],
        top_logprobs=[
            {tokenizer.decode([t]): lp for t, lp in (r.top_logprobs or {}).items()} for r in records
        ],
        text_offset=offsets,
    )
