"""Process supervision, like vLLM's: when the engine dies, the requests in flight have already had their
error (the engine fails them first); the watchdog then logs the engine's reason and asks the server to exit
(``fp4moe serve`` then exits 1), so a supervisor (systemd, Kubernetes) restarts it instead of a front that
answers 503 forever."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("fp4moe.server")


async def watch_engine(engine, on_failure: Callable[[str], None] | None, every: float = 0.2) -> None:
    """Wait for ``engine.failure`` (set when the engine dies outside a shutdown), log it, call ``on_failure``
    (None: a server that is not ``fp4moe serve`` keeps answering 503)."""
    while (reason := getattr(engine, "failure", None)) is None:
        await asyncio.sleep(every)
    await asyncio.sleep(every)  # the failed requests' error events go out before the server stops
    if on_failure is None:
        log.error("the engine stopped: %s", reason)
        return
    log.error("the engine stopped: %s; the server exits so that its supervisor can restart it", reason)
    on_failure(reason)
