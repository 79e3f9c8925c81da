"""``/v1/completions``: prompts as text, texts, token ids or lists of token ids (each its own ``n`` choices,
``index`` = prompt x n + choice, vLLM's order); logprobs, and ``echo`` with the prompt tokens' logprobs
(vLLM's semantics: the first prompt token's are null; ``max_tokens: 0`` with ``echo`` scores the prompt
without generating); whole responses or server-sent events."""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from fp4moe.server.errors import ERROR_RESPONSES, APIError, check
from fp4moe.server.protocol import CompletionRequest
from fp4moe.server.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, UsageInfo
from fp4moe.server.serving import serving
from fp4moe.server.streaming import event_stream

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_LOGPROB = -9999.0  # what vLLM sends for -inf (JSON has no infinity)

router = APIRouter()


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}},
)
async def completions(req: CompletionRequest, request: Request):
    srv = serving(request)
    srv.check_model(req.model)
    prompts = req.prompts
    srv.check_n(req.n, len(prompts))
    texts = [p for p in prompts if isinstance(p, str)]
    if texts:
        srv.check_prompt_chars("".join(texts) if len(texts) > 1 else texts[0], "prompt")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            check(
                len(p) < srv.llm.max_model_len,
                f"{where} has {len(p)} tokens; the maximum model length is {srv.llm.max_model_len}",
                "prompt",
            )
    num_ids = sum(len(p) for p in prompts if not isinstance(p, str))
    check(
        num_ids <= srv.max_prompt_chars,
        f"the prompts hold {num_ids} token ids; this server takes at most {srv.max_prompt_chars} "
        f"(--max-prompt-chars)",
        "prompt",
    )
    score_only = req.echo and req.max_tokens == 0  # vLLM: the prompt alone, one token generated and dropped
    check(
        req.max_tokens is None or req.max_tokens >= 1 or score_only,
        f"max_tokens must be at least 1 (0 only with echo), got {req.max_tokens}",
        "max_tokens",
    )
    try:
        params = req.sampling_params(srv.llm.max_model_len, req.logprobs)
        if req.echo and req.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    requested = 1 if score_only else req.max_tokens
    groups = await srv.prepare(prompts, params, requested, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
    seqs = [s for g in groups for s in g]
    queue = srv.submit(seqs)
    tokenizer = srv.llm.tokenizer
    echoed = [
        _prompt_text(tokenizer, p, g[0].prompt_ids) if req.echo else ""
        for p, g in zip(prompts, groups, strict=True)
    ]
    echo_of = [echoed[k] for k, g in enumerate(groups) for _ in g]  # per choice
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": srv.config.served_model_name,
    }
    if req.stream:
        response = CompletionResponse(**head, choices=[])
        started = [False] * len(seqs)

        def events(i, out):
            seq, first = out.seq, not started[i]
            started[i] = True
            text = "" if score_only else out.delta
            records = [] if score_only or out.logprob is None else [out.logprob]
            offset = len(seq.text) - len(out.delta)
            if first and req.echo:  # the prompt comes with the first event, before its first token
                text, records, offset = echo_of[i] + text, [*seq.prompt_logprobs, *records], 0
            logprobs = None
            if req.logprobs is not None and records:
                logprobs = _logprobs(tokenizer, records, offset)
            finish = seq.finish_reason.value if out.finished else None
            choice = CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=logprobs)
            yield response.model_copy(update={"choices": [choice]})

        def closing():
            return response.model_copy(update={"usage": _usage(groups)})

        want_usage = req.stream_options and req.stream_options.include_usage
        return StreamingResponse(
            event_stream(srv, seqs, queue, events, closing=closing if want_usage else None),
            media_type="text/event-stream",
        )
    await srv.collect(seqs, queue, request)
    choices = []
    for i, s in enumerate(seqs):
        records = [] if score_only else s.logprobs
        if req.echo:
            records = [*s.prompt_logprobs, *records]
        choices.append(
            CompletionChoice(
                index=i,
                text=echo_of[i] + ("" if score_only else s.text),
                finish_reason=s.finish_reason.value,
                logprobs=_logprobs(tokenizer, records, 0) if req.logprobs is not None else None,
            )
        )
    return CompletionResponse(**head, choices=choices, usage=_usage(groups))


def _prompt_text(tokenizer, prompt: str | list[int], ids: list[int]) -> str:
    """The text an echo returns: a text prompt as given, token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(ids) if tokenizer is not None else ""


def _usage(groups) -> UsageInfo:
    """Each prompt's tokens once, every choice's generated tokens (vLLM's count)."""
    prompt = sum(len(g[0].prompt_ids) for g in groups)
    completion = sum(len(s.output_ids) for g in groups for s in g)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _logprobs(tokenizer, records, offset: int) -> CompletionLogprobs:
    """Logprobs of tokens (SampleResults; logprob None: an echoed prompt's first token, which has none) whose
    text starts at character ``offset``: each token's top logprobs hold its own and the top k (vLLM's k + 1)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for r in records:
        token = tokenizer.decode([r.token_id])
        offsets.append(offset)
        if r.logprob is None:
            tokens.append(token)
            token_logprobs.append(None)
            tops.append(None)
        else:
            tokens.append(token)
            token_logprobs.append(max(r.logprob, MIN_LOGPROB))
            top = {token: max(r.logprob, MIN_LOGPROB)}
            for t, lp in (r.top_logprobs or {}).items():
                if t != r.token_id:
                    top.setdefault(tokenizer.decode([t]), max(lp, MIN_LOGPROB))
            tops.append(top)
        offset += len(tokens[-1])
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    )
