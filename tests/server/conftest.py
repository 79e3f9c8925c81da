import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn

from fp4moe.engine.front.async_engine import AsyncEngine
from fp4moe.engine.front.llm import LLM
from fp4moe.engine.loop.scheduler import SchedulerConfig
from fp4moe.server.app import build_app
from fp4moe.server.config import ServerConfig
from fp4moe.server.uvicorn_server import Server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli_server(path, *args: str) -> tuple[subprocess.Popen, str]:
    """``fp4moe serve PATH`` in its own process (fp32 on the CPU, a free port, ``args`` appended) -> (process,
    root URL) once /health answers; stderr is piped for the caller to read."""
    port = free_port()
    cmd = [sys.executable, "-m", "fp4moe.cli", "serve", str(path), "--port", str(port)]
    cmd += ["--dtype", "float32", "--device", "cpu", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{root}/health", timeout=1).status_code == 200:
                return proc, root
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError("server did not start")
        time.sleep(0.2)


class RunningServer:
    def __init__(self, app, engine):
        self.port = free_port()
        self.engine = engine
        self.server = Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.root = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.root}/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_server(
    path,
    api_key=None,
    prefix_cache=None,
    allowed_media_domains=(),
    num_speculative_tokens=0,
    max_model_len=None,
    server_config=None,
    **sched,
) -> RunningServer:
    """``server_config``: more ServerConfig fields (limits); ``sched``: SchedulerConfig fields."""
    llm = LLM(
        path,
        dtype="float32",
        limit_mm_per_prompt={"image": 2},
        num_speculative_tokens=num_speculative_tokens,
        max_model_len=max_model_len,
    )
    scheduler = SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 256, **sched})
    engine = AsyncEngine(
        llm.new_core(scheduler, prefix_cache=prefix_cache),
        llm.prompts,
        llm.encode_images,
        llm.warmup.warm_thread,
    )
    config = ServerConfig(
        served_model_name="tiny",
        api_key=api_key,
        reasoning_parser="qwen3",
        tool_call_parser="qwen3_coder",
        enable_auto_tool_choice=True,
        allowed_media_domains=frozenset(allowed_media_domains),
        **(server_config or {}),
    )
    return RunningServer(build_app(engine, config), engine)


@pytest.fixture(scope="module")
def server(checkpoints):
    srv = start_server(checkpoints.bf16())
    yield srv
    srv.stop()
