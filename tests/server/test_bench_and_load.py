"""fp4moe bench against our server; a bounded loopback load test; the vLLM command."""

import asyncio
import gc
import json
import random
import threading

import httpx
import pytest

from fp4moe.cli import main


def test_bench_against_our_server(server, tmp_path, capsys):
    code = main(
        [
            "bench",
            "--base-url",
            server.base_url,
            "--pp",
            "24",
            "--tg",
            "6",
            "--concurrency",
            "1",
            "3",
            "--runs",
            "2",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| pp | prompt tok | tg | depth | conc | aggregate tok/s |" in out
    assert "warning: tg 6: fewer than 16 decode tokens a request" in out and "warning: --runs 2" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["model"] == "tiny" and data["server"]["base_url"] == server.base_url
    assert data["server"]["model_entry"]["id"] == "tiny" and data["fp4moe"] and data["date"].endswith("UTC")
    assert data["settings"]["pp"] == [24] and data["settings"]["concurrency"] == [1, 3]
    assert any(w.startswith("tg 6:") for w in data["warnings"])
    assert (tmp_path / "bench.md").read_text().startswith(f"model tiny at {server.base_url}")
    rows = {r["concurrency"]: r for r in data["summary"]}
    assert set(rows) == {1, 3} and rows[3]["requests"] == 6 and rows[3]["errors"] == 0
    assert all(
        q["completion_tokens"] == 6 for r in data["rounds"] for q in r["requests"]
    )  # from usage, not chunks
    assert rows[1]["prompt_tokens"] > 10 and rows[3]["aggregate_tps_median"] > 0
    assert rows[1]["decode_steady_tps_median"] > 0  # one stream: a token per step, a chunk each
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_200_requests_at_concurrency_32(server):
    """Loopback only, bounded in count (200) and time: no errors, nothing leaked, memory back to baseline."""
    import psutil

    core = server.engine.core
    proc = psutil.Process()
    gc.collect()
    baseline = proc.memory_info().rss
    rng = random.Random(0)
    jobs = [(" ".join(["word"] * rng.randint(1, 60)), rng.randint(1, 12)) for _ in range(200)]
    statuses = []

    async def run():
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=120, limits=httpx.Limits(max_connections=40)
        ) as client:

            async def one(prompt, n):
                async with sem:
                    r = await client.post(
                        "/completions",
                        json={
                            "model": "tiny",
                            "prompt": prompt,
                            "max_tokens": n,
                            "temperature": 0.8,
                            "seed": n,
                        },
                    )
                    statuses.append(r.status_code)
                    assert r.status_code != 200 or r.json()["usage"]["completion_tokens"] <= n

            await asyncio.wait_for(asyncio.gather(*(one(p, n) for p, n in jobs)), timeout=300)

    asyncio.run(run())
    assert statuses == [200] * 200
    assert not core.scheduler.has_work() and core.kv._kv == {} and core.states._states == {}
    assert len(core.scheduler.free_slots) == core.scheduler.config.max_num_seqs
    gc.collect()
    assert proc.memory_info().rss - baseline < 200 << 20  # transient buffers only; caches are gone


def test_vllm_command(checkpoints, capsys):
    path = checkpoints.quantized()
    assert main(["serve", str(path), "--engine", "vllm", "--tensor-parallel-size", "2"]) == 0
    cmd = capsys.readouterr().out
    for part in (
        "vllm serve",
        "--kv-cache-dtype fp8",
        '"method": "mtp"',
        "--reasoning-parser qwen3",
        "--tool-call-parser qwen3_coder --enable-auto-tool-choice",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--tensor-parallel-size 2 --enable-expert-parallel",
        '"rope_type": "yarn"',
        "--max-model-len 16384",
        "--host 127.0.0.1",
    ):
        assert part in cmd, part
    # across GPUs, NVLink multicast is off in the command's environment unless asked for
    assert "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 vllm serve" in cmd


def test_vllm_command_across_gpus(checkpoints, capsys, monkeypatch):
    """Tensor parallelism with the experts sharded whole (the default) or split (--no-enable-expert-parallel);
    NVLink multicast off unless --nvlink-multicast; one GPU: neither flag nor environment."""
    import fp4moe.cli.serve as cli

    monkeypatch.setattr(cli, "vllm_without_flashinfer", lambda: False)
    path = str(checkpoints.quantized())

    def command(*extra):
        assert main(["serve", path, "--engine", "vllm", *extra]) == 0
        return capsys.readouterr().out.strip()

    tp = command("--tensor-parallel-size", "2", "--no-enable-expert-parallel")
    assert "--tensor-parallel-size 2" in tp and "expert-parallel" not in tp
    assert tp.startswith(
        "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 vllm serve"
    )
    ep = command("--tensor-parallel-size", "2", "--nvlink-multicast")
    assert ep.startswith("vllm serve") and "--tensor-parallel-size 2 --enable-expert-parallel" in ep
    one = command()
    assert one.startswith("vllm serve") and "parallel" not in one
    # our own engine runs on one GPU: asking it for two is an error, not a silent single-GPU server
    assert main(["serve", path, "--tensor-parallel-size", "2"]) == 2
    assert "needs --engine vllm" in capsys.readouterr().err
    assert main(["serve", path, "--engine", "vllm", "--tensor-parallel-size", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    # shapes that do not split over the GPUs asked for: refused with what breaks, before vLLM's loader
    assert main(["serve", path, "--engine", "vllm", "--tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "does not split over --tensor-parallel-size 3" in err and "4 attention heads" in err


def test_vllm_command_speculation_and_flashinfer_less_install(checkpoints, capsys, monkeypatch):
    import fp4moe.cli.serve as cli

    path = str(checkpoints.quantized())
    monkeypatch.setattr(cli, "vllm_without_flashinfer", lambda: True)
    assert main(["serve", path, "--engine", "vllm", "--num-speculative-tokens", "0"]) == 0
    cmd = capsys.readouterr().out
    assert cmd.startswith("VLLM_USE_FLASHINFER_SAMPLER=0 vllm serve")
    assert "--gdn-prefill-backend triton" in cmd and "speculative" not in cmd
    monkeypatch.setattr(cli, "vllm_without_flashinfer", lambda: False)
    assert main(["serve", path, "--engine", "vllm", "--num-speculative-tokens", "3"]) == 0
    cmd = capsys.readouterr().out
    assert cmd.startswith("vllm serve") and '"num_speculative_tokens": 3' in cmd and "gdn" not in cmd


def test_serve_help_lists_every_option():
    from fp4moe.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for name in ("serve", "bench"):
        for action in sub[name]._actions:
            assert action.help, f"{name} {action.dest}"


@pytest.mark.parametrize("concurrency", [0])
def test_bench_rejects_bad_settings(concurrency, capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--concurrency", str(concurrency)]) == 2
    assert "positive" in capsys.readouterr().err


def test_stream_and_nonstream_share_the_engine_under_threads(server):
    """Streams and plain requests at once: every stream ends with [DONE]."""
    done = []

    def stream():
        with httpx.stream(
            "POST",
            f"{server.base_url}/completions",
            timeout=60,
            json={"model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": True},
        ) as r:
            done.append(list(r.iter_lines())[-2:])

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all("data: [DONE]" in lines for lines in done) and len(done) == 4


def test_sigterm_lets_in_flight_streams_finish(checkpoints):
    import os
    import signal

    from conftest import start_cli_server

    proc, root = start_cli_server(checkpoints.bf16())
    try:
        lines = []
        body = {"prompt": "hello", "max_tokens": 40, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{root}/v1/completions", json=body, timeout=60) as r:
            for i, line in enumerate(r.iter_lines()):
                lines.append(line)
                if i == 4:
                    os.kill(proc.pid, signal.SIGTERM)  # mid-stream
        events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]" and sum(e.startswith("data: {") for e in events) == 40
        # uvicorn shuts down gracefully, then re-raises the signal so the exit status says SIGTERM
        assert proc.wait(60) in (0, -signal.SIGTERM)
        assert b"Traceback" not in proc.stderr.read()
    finally:
        proc.kill()


def test_prefix_caching_over_http(checkpoints):
    from conftest import start_server
    from fp4moe.engine.loop.prefix_cache import PrefixCache

    srv = start_server(checkpoints.bf16(), prefix_cache=PrefixCache(block_size=16))
    try:
        body = {
            "model": "tiny",
            "prompt": "A long shared system prompt. " * 20,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        first = httpx.post(f"{srv.base_url}/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert srv.metric("fp4moe:prefix_cache_hits_total") == 0
        second = httpx.post(f"{srv.base_url}/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert second == first and srv.metric("fp4moe:prefix_cache_hits_total") >= 16
    finally:
        srv.stop()


def test_remote_images_only_from_allowed_domains(checkpoints, tmp_path):
    import base64
    import functools
    import http.server

    from test_server import _data_url

    from conftest import start_server

    (tmp_path / "cat.png").write_bytes(base64.b64decode(_data_url(3).split(",", 1)[1]))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{files.server_address[1]}/cat.png"
    srv = start_server(checkpoints.bf16(), allowed_media_domains=["127.0.0.1"])
    try:
        msg = [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
            }
        ]
        ok = httpx.post(
            f"{srv.base_url}/chat/completions", json={"messages": msg, "max_tokens": 3}, timeout=60
        )
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] > 10
        missing = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url + "x"}}]}]
        r = httpx.post(
            f"{srv.base_url}/chat/completions", json={"messages": missing, "max_tokens": 3}, timeout=60
        )
        assert r.status_code == 400 and "HTTP 404" in r.json()["error"]["message"]
        other = [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "http://localhost:1/a.png"}}],
            }
        ]
        r = httpx.post(
            f"{srv.base_url}/chat/completions", json={"messages": other, "max_tokens": 3}, timeout=60
        )
        assert r.status_code == 400 and "'localhost' is not" in r.json()["error"]["message"]
    finally:
        srv.stop()
        files.shutdown()


def test_server_with_mtp_reports_spec_decode_and_bench_reads_it(checkpoints, tmp_path, capsys, monkeypatch):
    from conftest import start_server
    from fp4moe.engine.spec import spec_policy
    from fp4moe.models.tiny import CheckpointLayout

    # every round pays: the bench's requests draft (after the first request's rejected rounds, the random
    # head would start them backed off, with no drafts to report)
    monkeypatch.setattr(spec_policy, "MIN_ACCEPTED", 0.0)

    srv = start_server(checkpoints.bf16(CheckpointLayout.QWEN3_6), num_speculative_tokens=2)
    try:
        r = httpx.post(
            f"{srv.base_url}/completions",
            json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert srv.metric("fp4moe:spec_decode_num_drafts_total") > 0
        assert srv.metric("fp4moe:spec_decode_num_draft_tokens_total") == 2 * srv.metric(
            "fp4moe:spec_decode_num_drafts_total"
        )
        assert (
            main(
                [
                    "bench",
                    "--base-url",
                    srv.base_url,
                    "--pp",
                    "16",
                    "--tg",
                    "4",
                    "--concurrency",
                    "1",
                    "--runs",
                    "1",
                    "--out",
                    str(tmp_path),
                    "--no-progress",
                ]
            )
            == 0
        )
        row = json.loads((tmp_path / "bench.json").read_text())["summary"][0]
        assert "spec_acceptance_rate" in row and "spec_acceptance_per_position" in row
        assert row["spec_backoffs"] >= 0 and row["spec_started_backed_off"] >= 0  # the policy's counters
    finally:
        srv.stop()
