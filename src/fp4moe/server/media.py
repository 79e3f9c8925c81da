"""Images in chat messages: data URLs decoded, remote URLs fetched only from the domains allowed
(``--allowed-media-domains``; none by default), each within the byte limit and a total deadline; the messages
rewritten for the chat template with the images in order; the images decoded by ``ImageDecoder`` within
pixel budgets, off the event loop."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from fp4moe.engine.request.multimodal import ImageError, decode_image, open_image, plan_decode
from fp4moe.server.errors import APIError, check
from fp4moe.server.protocol import Message, clip

FETCH_TIMEOUT = 5.0  # seconds for all of a request's remote images together (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)


class ImageDecoder:
    """Decodes requests' images in its own small thread pool (text requests never wait behind them), each
    shrunk while decoding to the pixels the image processor keeps. The pixels decoding produces are counted
    from each image's header before any decoding (a JPEG's at its reduced scale): a request's images
    together at most ``request_pixels`` (else a 400), the images being decoded at once across the server at
    most ``server_pixels`` (others wait)."""

    def __init__(self, max_pixels: int | None, request_pixels: int, server_pixels: int, workers: int = 1):
        self.max_pixels = max_pixels  # the processor's size: nothing larger is decoded into memory to stay
        self.request_pixels, self.server_pixels = request_pixels, server_pixels
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="fp4moe-image")
        self.in_flight = 0  # full-size pixels being decoded now
        self.peak_in_flight = 0
        self._changed: asyncio.Condition | None = None

    async def decode(self, images: list) -> list[np.ndarray]:
        """The images (bytes) as RGB arrays, in order; 400 for an image that is not one or over budget."""
        if not images:
            return images
        try:
            opened = [open_image(i) for i in images]  # headers only
        except ImageError as e:
            raise APIError(400, str(e), param="messages") from None
        for img in opened:
            plan_decode(img, self.max_pixels)  # a JPEG decodes at a reduced scale: it costs those pixels
        sizes = [img.size[0] * img.size[1] for img in opened]
        check(
            sum(sizes) <= self.request_pixels,
            f"the request's images have {sum(sizes):,} pixels together; this server decodes at most "
            f"{self.request_pixels:,} for one request (--max-image-pixels-per-request): send fewer or "
            "smaller images",
            "messages",
        )
        loop = asyncio.get_running_loop()
        out = []
        try:
            for img, pixels in zip(opened, sizes, strict=True):
                async with self._reserve(pixels):
                    out.append(await loop.run_in_executor(self.pool, decode_image, img, self.max_pixels))
                img.close()  # its full-size pixels freed now, not when the request ends
        except ImageError as e:
            raise APIError(400, str(e), param="messages") from None
        finally:
            for img in opened:
                img.close()
        return out

    @contextlib.asynccontextmanager
    async def _reserve(self, pixels: int):
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:  # one alone may exceed the budget: it waits for an idle decoder
            await self._changed.wait_for(
                lambda: self.in_flight == 0 or self.in_flight + pixels <= self.server_pixels
            )
            self.in_flight += pixels
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            yield
        finally:
            async with self._changed:
                self.in_flight -= pixels
                self._changed.notify_all()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


async def fetch_images(images: list, max_bytes: int, timeout: float = FETCH_TIMEOUT) -> list:
    """Download the remote images (allowed domains only; ``timeout`` seconds for all of them together, however
    slowly a server trickles bytes; ``max_bytes`` each at most; no redirects)."""
    if not any(isinstance(i, str) for i in images):
        return images
    try:
        async with asyncio.timeout(timeout):
            return await _fetch(images, max_bytes, timeout)
    except TimeoutError:
        raise APIError(
            400, f"fetching the request's images took longer than {timeout:g} s", param="messages"
        ) from None


async def _fetch(images: list, max_bytes: int, timeout: float) -> list:
    out = []
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client:
        for image in images:
            if not isinstance(image, str):
                out.append(image)
                continue
            try:
                async with client.stream("GET", image) as r:
                    if r.status_code != 200:
                        raise APIError(400, f"fetching {image} gave HTTP {r.status_code}", param="messages")
                    data = bytearray()
                    async for chunk in r.aiter_bytes():
                        data += chunk
                        if len(data) > max_bytes:
                            raise APIError(400, f"image larger than {max_bytes} bytes", param="messages")
            except httpx.HTTPError as e:
                raise APIError(400, f"cannot fetch {image}: {type(e).__name__}", param="messages") from None
            out.append(bytes(data))
    return out


def prepare_messages(
    messages: list[Message], limit: int, max_bytes: int, allowed_domains: frozenset[str] = frozenset()
) -> tuple[list[dict], list]:
    """Template-ready messages (tool-call arguments as dicts) and the images in order: bytes of data URLs,
    or the URL itself for remote images on an allowed domain (fetched later by ``fetch_images``)."""
    out, images = [], []
    for m in messages:
        for part in m.content if isinstance(m.content, list) else ():
            if part.type != "image_url":
                continue
            check(
                len(images) < limit,
                f"more than {limit} images in one request; the limit is {limit}",
                "messages",
            )
            url = part.url
            if url.startswith(("http://", "https://")):
                try:
                    host = httpx.URL(url).host
                except httpx.InvalidURL:
                    raise APIError(400, f"invalid image URL {clip(url)!r}", param="messages") from None
                check(
                    host in allowed_domains,
                    f"remote image URLs are not fetched unless their domain is allowed "
                    f"(--allowed-media-domains); {clip(host)!r} is not",
                    "messages",
                )
                images.append(url)
                continue
            check(url.startswith("data:"), "image URLs must be data: URLs", "messages")
            check(len(url) * 3 // 4 <= max_bytes, f"image larger than {max_bytes} bytes", "messages")
            try:
                header, _, payload = url.partition(",")
                images.append(base64.b64decode(payload, validate=True))
            except ValueError:
                raise APIError(400, "undecodable base64 in an image data URL", param="messages") from None
        m = m.template_dict()
        for call in m.get("tool_calls", ()):
            fn = call["function"]
            if isinstance(fn["arguments"], str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"] or "{}")
                except (ValueError, RecursionError):  # not JSON, a number past 4,300 digits, deep nesting
                    fn["arguments"] = None
                check(
                    isinstance(fn["arguments"], dict),
                    "tool_calls arguments must be a JSON object",
                    "messages",
                )
        out.append(m)
    return out, images
