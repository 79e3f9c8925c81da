"""The OpenAI-compatible HTTP server: /v1/models, /v1/chat/completions, /v1/completions, /health, /metrics.

Errors are OpenAI-shaped JSON (never a stack trace): 400 bad input (checked at the boundary by the request
models in ``protocol``, and by the limits below before any work), 401 wrong API key, 404 unknown model, 413
request body too large, 429 full queue, 503 engine stopped or server shutting down. A 500 (a bug) closes its
connection cleanly (``Connection: close``). A client that disconnects has its request aborted and its cache
slots freed, streaming or not, running or still queued; a non-stream one is logged with status 499 (nginx's
"client closed request"). On shutdown, streams that cannot finish within the grace period end with an error
event and ``[DONE]``. ``/health`` answers ``{"status": "ok"}`` (200) or ``{"status": "engine stopped"}`` (503); under ``fp4moe serve`` a
dead engine ends the server (exit 1, the reason logged: ``server.supervision``).

Limits (``ServerConfig``): ``n`` ≤ ``max_n_sequences`` (vLLM's default, 16384) and ≤ the waiting queue; the
body ≤ ``max_request_bytes``; a prompt's characters ≤ ``max_prompt_chars`` before it is tokenized (default 8 per
token of the context); ``max_tokens`` ≤ the room the prompt leaves in the context (absent: all of it for chat,
16 for completions, OpenAI's defaults); stop strings and tools as ``protocol`` bounds them.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

from fp4moe.engine.front.async_engine import AsyncEngine
from fp4moe.engine.front.process import EngineProcess
from fp4moe.server.config import ServerConfig
from fp4moe.server.errors import install_handlers
from fp4moe.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, InternalErrorMiddleware
from fp4moe.server.routes import chat, completions, health, models
from fp4moe.server.serving import Serving
from fp4moe.server.supervision import watch_engine


def build_app(engine: AsyncEngine | EngineProcess, config: ServerConfig) -> FastAPI:
    """The API over an engine on a thread of this process (``AsyncEngine``) or in its own process
    (``EngineProcess``): the routes (``server.routes``), OpenAI-shaped errors (``server.errors``), the body
    limit, the optional API key and the last line of defence for a bug (``server.middleware``)."""
    app = FastAPI(title="fp4moe", docs_url=None, redoc_url=None)
    srv = Serving(engine, config)
    install_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.request_bytes(srv.llm.max_model_len, srv.llm.limit_images)
    )
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(InternalErrorMiddleware)
    for routes in (health, models, chat, completions):
        app.include_router(routes.router)

    @app.on_event("startup")
    async def _watch():
        on_failure = getattr(app.state, "on_engine_failure", None)  # set by ``serve``
        app.state.watchdog = asyncio.create_task(watch_engine(engine, on_failure))

    @app.on_event("shutdown")
    async def _shutdown():
        app.state.watchdog.cancel()
        srv.images.shutdown()
        await asyncio.to_thread(engine.shutdown)

    app.state.serving, app.state.end_streams = srv, srv.end_streams
    return app
