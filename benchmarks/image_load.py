"""Image load against ``fp4moe serve`` on the CPU: large-but-small-on-disk PNGs (5600x5600, ~30 KB each)
sent by many clients at once, while a client sends plain text requests. Reports the text requests' latency
before and under the load, the answers the image requests got, and the server front's RSS (peak, after).

    python benchmarks/image_load.py [--pythonpath OTHER/src] [--out results/x.json]

``--pythonpath`` runs the server from another source tree (the same load on an older commit).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def big_png(side: int = 5600, seed: int = 0) -> bytes:
    """A side x side RGB PNG that compresses to tens of KB (flat colour, a sprinkle of noise)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = np.full((side, side, 3), 200, dtype=np.uint8)
    n = min(2000, side * side // 4)
    arr[rng.integers(0, side, n), rng.integers(0, side, n)] = rng.integers(0, 255, (n, 3))
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG", optimize=True)
    return buf.getvalue()


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start(model: Path, port: int, pythonpath: str | None, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "fp4moe.cli", "serve", str(model), "--port", str(port), "--device", "cpu"]
    cmd += [
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
        "--limit-mm-per-prompt",
        '{"image": 4}',
        *extra,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pythonpath", help="run the server from this source tree")
    ap.add_argument("--clients", type=int, default=8, help="image requests at once")
    ap.add_argument(
        "--rounds",
        nargs="+",
        default=["5600x4", "5600x2", "96x2"],
        help="one round per SIDExCOUNT: COUNT images of SIDE x SIDE pixels a request (96: the engine's own cost)",
    )
    ap.add_argument("--port", type=int, default=18431, help="the server's local port (default 18431)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    from fp4moe.models.tiny import write_tiny_checkpoint

    urls = {}
    tmp = Path(tempfile.mkdtemp(prefix="image-load-"))
    model = write_tiny_checkpoint(tmp / "tiny")
    proc = start(model, args.port, args.pythonpath, [])
    root = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    text_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def text_request() -> float:
        t = time.perf_counter()
        r = httpx.post(root, json=text_body, timeout=300)
        assert r.status_code == 200, r.text
        return time.perf_counter() - t

    result: dict = {"clients": args.clients, "rounds": []}
    try:
        text_request()
        small = "data:image/png;base64," + base64.b64encode(big_png(96)).decode()
        warm = [{"type": "image_url", "image_url": {"url": small}}, {"type": "text", "text": "?"}]
        httpx.post(root, json={"messages": [{"role": "user", "content": warm}], "max_tokens": 2}, timeout=300)
        result["text_latency_idle_s"] = statistics.median(text_request() for _ in range(5))
        for spec in args.rounds:
            side, n_images = (int(x) for x in spec.split("x"))
            if side not in urls:
                urls[side] = "data:image/png;base64," + base64.b64encode(big_png(side)).decode()
            content = [{"type": "image_url", "image_url": {"url": urls[side]}}] * n_images
            body = {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": "?"}]}]}
            body["max_tokens"] = 2
            before = rss_mb(proc.pid)
            peak, stop = [before], threading.Event()

            def sample(peak=peak, stop=stop):
                while not stop.is_set():
                    peak[0] = max(peak[0], rss_mb(proc.pid))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample)
            sampler.start()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                futures = [
                    pool.submit(
                        lambda body=body: (httpx.post(root, json=body, timeout=600), time.perf_counter())
                    )
                    for _ in range(args.clients)
                ]
                time.sleep(0.5)  # the image requests are in
                latencies = []
                while not all(f.done() for f in futures):
                    latencies.append(text_request())
                    time.sleep(0.2)
                answers = [f.result() for f in futures]
            stop.set()
            sampler.join()
            time.sleep(1.0)
            statuses = [r.status_code for r, _ in answers]
            result["rounds"].append(
                {
                    "image_side": side,
                    "png_bytes": len(urls[side]) * 3 // 4,
                    "images_per_request": n_images,
                    "request_body_bytes": len(json.dumps(body)),
                    "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
                    "first_error": next(
                        (r.json()["error"]["message"] for r, _ in answers if r.status_code != 200), None
                    ),
                    "image_requests_wall_s": max(t for _, t in answers) - t0,
                    "text_requests_during_load": len(latencies),
                    "text_latency_under_load_max_s": max(latencies, default=None),
                    "text_latency_under_load_median_s": statistics.median(latencies) if latencies else None,
                    "front_rss_before_mb": before,
                    "front_rss_peak_mb": peak[0],
                    "front_rss_after_mb": rss_mb(proc.pid),
                }
            )
            print(json.dumps(result["rounds"][-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
