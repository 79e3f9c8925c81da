"""The server's ASGI middleware (pure ASGI, not starlette's BaseHTTPMiddleware, so streams are not buffered):
the optional API key, the request body limit (413 before the body is read whole), and the last line of defence
for a bug (a 500 that closes its connection cleanly). ``log_client_closed`` logs a client that left (499)."""

from __future__ import annotations

import hmac
import logging
import urllib.parse

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from fp4moe.server.responses import error_body


class APIKeyMiddleware:
    """A request to a ``/v1/`` route without ``Authorization: Bearer KEY`` gets a 401 OpenAI error.

    A pure ASGI middleware on purpose: ``@app.middleware("http")`` (starlette's BaseHTTPMiddleware) hands the
    route a wrapped ``receive`` on which ``request.is_disconnected()`` never turns true, so a non-stream
    request whose client had left would run to its end."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
            # the scheme is case-insensitive (RFC 9110; vLLM accepts "bearer" too), the key is not
            valid = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._expected)
            if not valid:
                response = JSONResponse(
                    error_body("invalid API key", "authentication_error", 401), status_code=401
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """A request body over ``max_bytes`` gets a 413 OpenAI error before the app parses any of it: at once from
    its Content-Length, else as soon as the chunks received pass the limit. The body read here is handed on
    to the app, and after it the real ``receive`` (so a disconnect is still seen)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was complete
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body larger than {self.max_bytes} bytes (--max-request-bytes)"
        response = JSONResponse(
            error_body(message, "invalid_request_error", 413),
            status_code=413,
            headers={"connection": "close"},
        )
        await response(scope, receive, send)


class InternalErrorMiddleware:
    """An unexpected exception (a bug) becomes a 500 OpenAI error with ``Connection: close``, and its traceback
    goes to the log; the client never sees a stack trace, and never reuses a connection the server is closing.
    (starlette's own handler re-raises after answering, and uvicorn then drops the keep-alive connection
    without telling the client.)"""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            logging.getLogger("fp4moe.server").exception("internal error on %s", scope.get("path"))
            if started:
                raise  # mid-body: nothing valid can follow; uvicorn closes the connection
            response = JSONResponse(
                error_body(f"internal error: {type(exc).__name__}", "internal_error", 500),
                status_code=500,
                headers={"connection": "close"},
            )
            await response(scope, receive, send)


def log_client_closed(scope: Scope) -> None:
    """An access-log line with status 499 for a request whose client left: uvicorn drops the response (and
    its own log line) once the connection is gone, so the server writes it, in uvicorn's access format."""
    client = scope.get("client")
    path = urllib.parse.quote(scope["path"])
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("latin-1")
    logging.getLogger("uvicorn.access").info(
        '%s - "%s %s HTTP/%s" %d',
        f"{client[0]}:{client[1]}" if client else "",
        scope["method"],
        path,
        scope.get("http_version", "1.1"),
        499,
    )
