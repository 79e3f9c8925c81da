"""Images bounded by pixels, not bytes: sizes read from headers before decoding, images shrunk while they
decode, per-request and server-wide pixel budgets, decoding in its own pool (text requests unaffected), a
total deadline on remote fetches, the image processor loaded at start-up, error messages without reprs."""

import asyncio
import base64
import io
import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from conftest import start_server
from fp4moe.engine.request.multimodal import ImageError, decode_image, load_image, open_image
from fp4moe.engine.request.prompts import PromptError
from fp4moe.server.errors import APIError
from fp4moe.server.media import fetch_images

MAX = 96 * 96  # the tiny checkpoint's processor keeps at most this many pixels


def _png(side: int, mode: str = "RGB") -> bytes:
    """A side x side PNG that compresses to little (flat colour, a few dots)."""
    img = Image.new(mode, (side, side), 200 if mode != "1" else 1)
    for i in range(0, side, max(1, side // 50)):
        img.putpixel((i, i), 0)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def big_png() -> bytes:
    return _png(5600)  # 31.4 M pixels (~94 MB decoded) in ~100 KB


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(monkeypatch):
    data = _png(8000, "1")  # 64 M pixels in a few KB
    monkeypatch.setattr(Image.Image, "load", lambda self: pytest.fail("decoded"))
    with pytest.raises(ImageError, match="8000x8000 pixels, more than"):
        open_image(data)


def test_a_jpeg_decodes_at_a_reduced_scale():
    buf = io.BytesIO()
    Image.new("RGB", (4000, 3000), (10, 200, 30)).save(buf, "JPEG")
    img = open_image(buf.getvalue())
    arr = decode_image(img, MAX)
    assert img.size == (500, 375)  # decoded at 1/8 scale: never 12 M pixels in memory
    assert arr.shape[0] * arr.shape[1] <= MAX and arr.shape[2] == 3
    assert abs(arr.shape[1] / arr.shape[0] - 4 / 3) < 0.05  # the aspect ratio kept
    assert np.abs(arr.astype(int) - [10, 200, 30]).max() <= 8  # JPEG's error, no more


def test_a_large_png_is_shrunk_as_it_decodes(big_png):
    arr = load_image(big_png, MAX)
    assert arr.shape == (96, 96, 3)
    assert load_image(_png(40), MAX).shape == (40, 40, 3)  # small images kept as they are


@pytest.mark.parametrize("data", [b"not an image", _png(64)[:60]])
def test_image_errors_carry_no_object_reprs(data):
    with pytest.raises(ImageError) as e:
        load_image(data, MAX)
    assert " at 0x" not in str(e.value) and "<_io" not in str(e.value), str(e.value)


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _image_body(png: bytes, n: int) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": _data_url(png)}}] * n
    return {
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}],
        "max_tokens": 1,
    }


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_image_load_is_bounded_and_text_requests_go_on(checkpoints, big_png):
    """6 clients at once, each with two 5600x5600 PNGs (the case that took gigabytes and held a text
    request 13.6 s): decoding stays within the server's pixel budget, memory grows by far less than the
    full-size images, and a text request is answered while the images are still being worked on."""
    budget = 40 << 20  # one full-size image at a time
    srv = start_server(checkpoints.bf16(), server_config={"max_image_pixels_in_flight": budget})
    url = f"{srv.base_url}/chat/completions"
    decoder = srv.server.config.app.state.serving.images
    try:
        text = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(url, json=text, timeout=60).status_code == 200
        before, peak, stop = _rss_mb(), [0.0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _rss_mb())
                time.sleep(0.01)

        finished: list[float] = []
        results: list[int] = []

        def image_request():
            results.append(httpx.post(url, json=_image_body(big_png, 2), timeout=300).status_code)
            finished.append(time.monotonic())

        threads = [threading.Thread(target=sample)] + [
            threading.Thread(target=image_request) for _ in range(6)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while decoder.in_flight == 0:  # the images are being decoded
            assert time.monotonic() < deadline, "no image was decoded"
            time.sleep(0.005)
        t0 = time.monotonic()
        assert httpx.post(url, json=text, timeout=300).status_code == 200
        text_done, text_latency = time.monotonic(), time.monotonic() - t0
        for t in threads[1:]:
            t.join(300)
        stop.set()
        threads[0].join()
        growth = peak[0] - before
        print(f"text latency under image load {text_latency:.2f} s; RSS growth {growth:.0f} MB; "
              f"peak decoding {decoder.peak_in_flight / 2**20:.1f} Mpx")  # fmt: skip
        assert results == [200] * 6
        assert decoder.peak_in_flight <= budget
        assert growth < 600, f"the front grew {growth:.0f} MB (12 images of ~94 MB each decoded)"
        assert text_done < max(finished), "the text request waited for every image request"
    finally:
        srv.stop()


def test_the_images_of_one_request_are_bounded_in_pixels(checkpoints, big_png):
    srv = start_server(checkpoints.bf16(), server_config={"max_image_pixels_per_request": 40 << 20})
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{srv.base_url}/chat/completions", json=_image_body(big_png, 2), timeout=60)
        assert r.status_code == 400 and "--max-image-pixels-per-request" in r.json()["error"]["message"]
        assert "62,720,000 pixels" in r.json()["error"]["message"]
        assert srv.server.config.app.state.serving.images.peak_in_flight == 0  # nothing was decoded
        assert time.monotonic() - t0 < 30
    finally:
        srv.stop()


def test_remote_fetch_has_a_total_deadline():
    """A server that trickles its body (one byte every 0.2 s, each read well inside any per-read timeout)
    cannot hold a request past the total deadline."""

    async def trickle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n")
        for _ in range(40):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.2)
        writer.close()

    async def run():
        server = await asyncio.start_server(trickle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(APIError, match="longer than 1 s") as e:
            await fetch_images([f"http://127.0.0.1:{port}/a.png"], 1 << 20, timeout=1.0)
        assert e.value.status == 400 and time.monotonic() - t0 < 6  # not the body's 8 s
        server.close()

    asyncio.run(run())


def test_the_image_processor_is_loaded_at_start_up(checkpoints):
    path = checkpoints.copy(checkpoints.bf16(), "bad-preprocessor")
    (path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(PromptError, match="cannot load the image processor"):
        start_server(path)
    ok = json.loads((checkpoints.bf16() / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps(ok))
    start_server(path).stop()
