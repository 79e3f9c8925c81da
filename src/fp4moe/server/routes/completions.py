"""``/v1/completions``: text or token-id prompts, logprobs; whole responses or server-sent events."""

from __future__ import annotations

import json
import logging
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from fp4moe.server.errors import APIError, check
from fp4moe.server.protocol import CompletionRequest
from fp4moe.server.serving import Serving, serving
from fp4moe.server.streaming import SHUTTING_DOWN, drain, error_event, usage, usage_event

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()


@router.post("/v1/completions")
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
    rid = f"cmpl-{uuid.uuid4().hex}"
    if req.stream:
        return StreamingResponse(
            _completion_stream(srv, rid, req, seqs, queue), media_type="text/event-stream"
        )
    try:
        await drain(queue, seqs, request)
    finally:
        srv.finish(seqs, queue)
    choices = [
        {
            "index": i,
            "text": s.text,
            "finish_reason": s.finish_reason.value,
            "logprobs": _completion_logprobs(srv.llm.tokenizer, s) if req.logprobs is not None else None,
        }
        for i, s in enumerate(seqs)
    ]
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": srv.config.served_model_name,
        "choices": choices,
        "usage": usage(seqs),
    }


async def _completion_stream(srv: Serving, rid, req, seqs, queue):
    created, model = int(time.time()), srv.config.served_model_name
    index = {id(s): i for i, s in enumerate(seqs)}
    try:
        remaining = len(seqs)
        while remaining:
            out = SHUTTING_DOWN if srv.stopping.is_set() else await queue.get()  # a backlog waits
            if out is SHUTTING_DOWN or out.error:
                yield error_event(out)
                yield "data: [DONE]\n\n"
                return
            logprobs = None
            if req.logprobs is not None and out.logprob is not None:
                r = out.logprob
                token = srv.llm.tokenizer.decode([r.token_id])
                logprobs = {
                    "tokens": [token],
                    "token_logprobs": [r.logprob],
                    "top_logprobs": [
                        {srv.llm.tokenizer.decode([t]): v for t, v in (r.top_logprobs or {}).items()}
                    ],
                    "text_offset": [len(out.seq.text) - len(out.delta)],
                }
            choice = {
                "index": index[id(out.seq)],
                "text": out.delta,
                "finish_reason": out.seq.finish_reason.value if out.finished else None,
                "logprobs": logprobs,
            }
            remaining -= out.finished
            body = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
            }
            yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
        if req.stream_options and req.stream_options.include_usage:
            yield usage_event(rid, "text_completion", created, model, seqs)
        yield "data: [DONE]\n\n"
    except Exception as e:
        logging.getLogger("fp4moe.server").exception("completion stream failed")
        yield error_event(e)
        yield "data: [DONE]\n\n"
    finally:
        srv.finish(seqs, queue)


def _completion_logprobs(tokenizer, seq) -> dict:
    tokens = [tokenizer.decode([r.token_id]) for r in seq.logprobs]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [r.logprob for r in seq.logprobs],
        "top_logprobs": [
            {tokenizer.decode([t]): lp for t, lp in (r.top_logprobs or {}).items()} for r in seq.logprobs
        ],
        "text_offset": offsets,
    }
