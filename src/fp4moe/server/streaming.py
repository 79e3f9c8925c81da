"""What the routes share around a request's outputs: waiting for a non-streamed request while watching for a
client that leaves (``drain``), the server-sent events that end a stream early (``error_event``, with
``SHUTTING_DOWN`` when the shutdown grace period ends it) and the usage event and body."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request

from fp4moe.server.errors import APIError
from fp4moe.server.protocol import error_body


class _ShuttingDown:
    """Put on a request's output queue when the shutdown grace period ends: streams end with an error event
    and [DONE], non-stream requests answer 503."""


SHUTTING_DOWN = _ShuttingDown()


SHUTDOWN_MESSAGE = "the server is shutting down; this request was stopped before it finished"


async def drain(queue: asyncio.Queue, seqs, request: Request, every: float = 0.25) -> None:
    """Wait for every sequence to finish; stop early (the caller aborts) if the client goes away, the engine
    fails the request or the shutdown grace period ends.

    The client is looked at every ``every`` seconds whether or not tokens are arriving (a running request
    fills the queue faster than any timeout on ``queue.get`` would expire)."""
    remaining = len(seqs)
    look_at = time.monotonic() + every
    while remaining:
        if time.monotonic() >= look_at:
            if await request.is_disconnected():
                raise APIError(499, "client disconnected", "client_closed_request")
            look_at = time.monotonic() + every
        try:
            out = await asyncio.wait_for(queue.get(), timeout=max(0.01, look_at - time.monotonic()))
        except TimeoutError:
            continue
        if out is SHUTTING_DOWN:
            raise APIError(503, SHUTDOWN_MESSAGE, "service_unavailable")
        if out.error:
            raise APIError(500, f"the engine failed this request: {out.error}", "internal_error")
        remaining -= out.finished


def error_event(cause) -> str:
    """A stream event telling the client its request failed (the stream then ends with [DONE]): the engine
    failed it (an output with ``error``), the server is shutting down, or an exception in the server."""
    if cause is SHUTTING_DOWN:
        body = error_body(SHUTDOWN_MESSAGE, "service_unavailable", 503)
    elif isinstance(cause, Exception):
        body = error_body(f"internal error: {type(cause).__name__}", "internal_error", 500)
    else:
        body = error_body(f"the engine failed this request: {cause.error}", "internal_error", 500)
    return f"data: {json.dumps(body)}\n\n"


def usage_event(rid: str, obj: str, created: int, model: str, seqs) -> str:
    """The final stream event carrying ``usage`` (stream_options.include_usage)."""
    body = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(seqs),
    }
    return f"data: {json.dumps(body)}\n\n"


def usage(seqs) -> dict:
    prompt = len(seqs[0].prompt_ids)
    completion = sum(len(s.output_ids) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
