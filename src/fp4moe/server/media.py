"""Images in chat messages: data URLs decoded, remote URLs fetched only from the domains allowed
(``--allowed-media-domains``; none by default), each within the byte limit; the messages rewritten for the
chat template with the images in order."""

from __future__ import annotations

import base64
import json

import httpx

from fp4moe.server.errors import APIError, check
from fp4moe.server.protocol import Message, clip


async def fetch_images(images: list, max_bytes: int) -> list:
    """Download the remote images (allowed domains only; 10 s, ``max_bytes`` at most, no redirects)."""
    if not any(isinstance(i, str) for i in images):
        return images
    out = []
    async with httpx.AsyncClient(timeout=10.0, follow_redirects=False) as client:
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
