"""What the routes share around a request's outputs: waiting for a non-streamed request while watching for a
client that leaves (``drain``), one request's server-sent events (``event_stream``), the events that end a
stream early (``error_event``, with ``SHUTTING_DOWN`` when the shutdown grace period ends it) and the usage."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable

from fastapi import Request
from pydantic import BaseModel

from fp4moe.server.errors import APIError
from fp4moe.server.responses import UsageInfo, error_body

DONE = "data: [DONE]\n\n"


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


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def event_stream(
    srv,
    seqs,
    queue: asyncio.Queue,
    events: Callable[[int, object], Iterable[BaseModel]],
    opening: Iterable[BaseModel] = (),
    closing: Callable[[], BaseModel] | None = None,
) -> AsyncIterator[str]:
    """One request's server-sent events: ``opening`` first, then ``events(i, output)`` for each output of
    sequence ``i`` as the engine delivers it, then ``closing()`` (the usage event, when asked for) and [DONE].
    An engine failure, the end of the shutdown grace period or a bug here ends the stream with an error event
    and [DONE], never a cut connection. The request's sequences are freed however the stream ends (a client
    that leaves cancels the generator)."""
    index = {id(s): i for i, s in enumerate(seqs)}
    try:
        for body in opening:
            yield sse(body)
        remaining = len(seqs)
        while remaining:
            out = SHUTTING_DOWN if srv.stopping.is_set() else await queue.get()  # a backlog waits
            if out is SHUTTING_DOWN or out.error:
                yield error_event(out)
                yield DONE
                return
            for body in events(index[id(out.seq)], out):
                yield sse(body)
            remaining -= out.finished
        if closing is not None:
            yield sse(closing())
        yield DONE
    except Exception as e:
        logging.getLogger("fp4moe.server").exception("a stream failed")
        yield error_event(e)
        yield DONE
    finally:
        srv.finish(seqs, queue)


def usage(seqs) -> UsageInfo:
    prompt = len(seqs[0].prompt_ids)
    completion = sum(len(s.output_ids) for s in seqs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
