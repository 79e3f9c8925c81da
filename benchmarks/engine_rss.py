"""The engine process's and the front's RSS over a long mixed run against ``fp4moe serve`` on the CPU: chat
and completions, streamed and whole, n > 1, logprobs, small images, stop strings, and clients that hang up
early. RSS is sampled every ``--every`` requests; a leak grows without bound, allocator caching levels off.

    python benchmarks/engine_rss.py --requests 1500 --out benchmarks/results/engine-rss-cpu.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def small_png(seed: int) -> str:
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def request(root: str, i: int, image: str) -> str:
    """One request of a mix chosen by ``i``; -> what happened ("200", "hangup", "400", ...)."""
    rng = random.Random(i)
    kind = rng.choice(["chat", "chat", "completion", "image"])
    stream = rng.random() < 0.5
    body: dict = {"max_tokens": rng.randint(1, 24), "stream": stream, "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.2:
        body["n"] = 2
    if rng.random() < 0.2:
        body["stop"] = ["the", "\n\n"]
    words = " ".join(
        rng.choice(["alpha", "beta", "gamma", "delta", "x", "42"]) for _ in range(rng.randint(1, 40))
    )
    if kind == "completion":
        path, body["prompt"] = "/v1/completions", words
        if rng.random() < 0.3:
            body["logprobs"] = 3
    else:
        path = "/v1/chat/completions"
        content: list | str = words
        if kind == "image":
            content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": words}]
        body["messages"] = [{"role": "user", "content": content}]
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, 2
    hang_up = rng.random() < 0.15  # a client that leaves mid-request
    try:
        timeout = 0.05 if hang_up else 120
        if stream:
            with httpx.stream("POST", root + path, json=body, timeout=timeout) as r:
                for _ in r.iter_lines():
                    pass
                return str(r.status_code)
        return str(httpx.post(root + path, json=body, timeout=timeout).status_code)
    except httpx.TimeoutException:
        return "hangup"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1500, help="mixed requests in all (default 1500)")
    ap.add_argument("--clients", type=int, default=8, help="clients sending at once (default 8)")
    ap.add_argument("--every", type=int, default=100, help="sample RSS every this many requests")
    ap.add_argument("--port", type=int, default=18470, help="the server's local port (default 18470)")
    ap.add_argument("--out", help="write the RSS samples as JSON here")
    args = ap.parse_args()

    from fp4moe.models.tiny import write_tiny_checkpoint

    model = write_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="engine-rss-")) / "tiny")
    cmd = [
        sys.executable,
        "-m",
        "fp4moe.cli",
        "serve",
        str(model),
        "--port",
        str(args.port),
        "--device",
        "cpu",
    ]
    cmd += ["--dtype", "float32", "--engine-process"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    engine_pid = None
    for line in proc.stderr:
        if "in its own process (pid " in line:
            engine_pid = int(line.rsplit("pid ", 1)[1].split(")")[0])
            break
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # a full pipe would stall the server
    root = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(root + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and engine_pid, "the server did not start"
        time.sleep(0.3)
    image = small_png(0)
    samples, outcomes = [], {}
    t0 = time.monotonic()
    try:
        done = 0
        with ThreadPoolExecutor(args.clients) as pool:
            while done < args.requests:
                batch = min(args.every, args.requests - done)
                for outcome in pool.map(lambda i: request(root, i, image), range(done, done + batch)):
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                done += batch
                time.sleep(0.5)  # hung-up requests aborted, the engine idle
                samples.append(
                    {
                        "requests": done,
                        "s": round(time.monotonic() - t0, 1),
                        "engine_rss_mb": rss_mb(engine_pid),
                        "front_rss_mb": rss_mb(proc.pid),
                    }  # fmt: skip
                )
                print(json.dumps(samples[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    half = samples[len(samples) // 2]
    result = {
        "requests": args.requests,
        "clients": args.clients,
        "outcomes": outcomes,
        "samples": samples,
        "engine_growth_mb": samples[-1]["engine_rss_mb"] - samples[0]["engine_rss_mb"],
        "engine_growth_second_half_mb": samples[-1]["engine_rss_mb"] - half["engine_rss_mb"],
        "front_growth_mb": samples[-1]["front_rss_mb"] - samples[0]["front_rss_mb"],
        "front_growth_second_half_mb": samples[-1]["front_rss_mb"] - half["front_rss_mb"],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
