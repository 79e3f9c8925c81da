"""``model`` served by our engine and the OpenAI API on a free local port, in this process, for as long as a
``with`` block runs: what ``fp4moe eval --tasks`` points lm-evaluation-harness at (``eval.harness``)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from fp4moe.engine.front.config import EngineConfig


@contextlib.contextmanager
def served(model: str | Path, config: EngineConfig) -> Iterator[tuple[str, int]]:
    """``model`` served on a free local port for the duration -> (the ``/v1/completions`` URL, its context)."""
    import uvicorn

    from fp4moe.engine.front.async_engine import AsyncEngine
    from fp4moe.engine.front.process import EngineSpec, start_engine
    from fp4moe.server.app import build_app
    from fp4moe.server.config import ServerConfig
    from fp4moe.server.uvicorn_server import Server

    llm, core = start_engine(EngineSpec(str(model), config))
    engine = AsyncEngine(core, llm.prompts, llm.encode_images, llm.warmup.warm_thread)
    app = build_app(engine, ServerConfig(served_model_name=Path(model).name))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the server for {model} did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1/completions", llm.max_model_len
    finally:
        server.should_exit = True
        thread.join(60)
