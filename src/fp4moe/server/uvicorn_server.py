"""uvicorn's server, telling the app when its shutdown grace period is about to end.

uvicorn's graceful shutdown waits up to ``timeout_graceful_shutdown`` seconds for open requests, then cancels
them: a stream still running is cut mid-body and its client sees a transport error. This server calls the
app's ``state.end_streams`` a little before that moment, so each such stream ends with an error event and
``[DONE]`` (and a non-stream request with a 503) while its connection is still open.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn


def notice_before(grace: float) -> float:
    """Seconds after shutdown begins at which open requests are ended: 2 s (a quarter of short graces) early."""
    return max(0.0, grace - min(2.0, grace / 4))


class Server(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = self.config.timeout_graceful_shutdown
        end_streams = getattr(getattr(self.config.app, "state", None), "end_streams", None)
        if grace is not None and end_streams is not None:
            asyncio.get_running_loop().call_later(notice_before(grace), end_streams)
        await super().shutdown(sockets)


def serve(app, host: str, port: int, timeout_graceful_shutdown: float, log_level: str = "info") -> str | None:
    """Run until a signal or the engine's death -> the engine's failure (None after a normal shutdown)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=timeout_graceful_shutdown
    )
    server = Server(config)
    failures: list[str] = []

    def on_engine_failure(reason: str) -> None:
        failures.append(reason)
        server.should_exit = True

    app.state.on_engine_failure = on_engine_failure
    server.run()
    return failures[0] if failures else None
