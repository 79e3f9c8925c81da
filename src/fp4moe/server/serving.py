"""What every route shares, per app: the engine (``AsyncEngine`` on a thread of this process or ``EngineProcess``),
the server's limits (``ServerConfig``) and their checks, and a request's life -- tokenized and queued
(``start``), its outputs' queue tracked until it ends (``finish``), and told when the shutdown grace period
ends the streams still open (``end_streams``)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from fp4moe.engine.loop.core import EngineStoppedError
from fp4moe.engine.loop.scheduler import QueueFullError
from fp4moe.engine.request.multimodal import ImageError
from fp4moe.engine.request.prompts import PromptError
from fp4moe.server.config import PROMPT_CHARS_PER_TOKEN, ServerConfig
from fp4moe.server.errors import APIError, check
from fp4moe.server.media import ImageDecoder
from fp4moe.server.metrics import Metrics
from fp4moe.server.protocol import clip
from fp4moe.server.streaming import SHUTDOWN_MESSAGE, SHUTTING_DOWN, drain


class Serving:
    def __init__(self, engine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.llm = engine.prompts  # tokenizer, chat template, limits
        self.metrics = Metrics(config.served_model_name)
        self.max_prompt_chars = config.prompt_chars(self.llm.max_model_len)
        self.live: set[asyncio.Queue] = set()  # the output queues of requests in flight (told at shutdown)
        self.stopping = threading.Event()  # set when the shutdown grace period ends: new requests get a 503
        self.images = ImageDecoder(
            self.llm.load_image_processor(),  # at start-up: a processor that cannot load fails the start
            config.max_image_pixels_per_request,
            config.max_image_pixels_in_flight,
            config.image_decode_workers,
        )

    def check_model(self, name: str | None) -> None:
        if name and name != self.config.served_model_name:
            raise APIError(
                404,
                f"model {clip(name)!r} does not exist; this server serves {self.config.served_model_name!r}",
                "not_found_error",
                "model",
            )

    def check_n(self, n: int, num_prompts: int = 1) -> None:
        """The request's sequences (``n`` of each prompt) within ``--max-n-sequences`` and the queue."""
        total = n * num_prompts
        what = f"n is {n}" if num_prompts == 1 else f"n x prompts is {n} x {num_prompts} = {total}"
        check(
            total <= self.config.max_n_sequences,
            f"{what}; this server allows at most {self.config.max_n_sequences} (--max-n-sequences)",
            "n",
        )
        waiting = self.engine.max_waiting
        check(total <= waiting, f"{what}; the waiting queue holds at most {waiting} (--max-waiting)", "n")

    def check_prompt_chars(self, text: str, param: str) -> None:
        check(
            len(text) <= self.max_prompt_chars,
            f"the prompt has {len(text)} characters; this server takes at most {self.max_prompt_chars} "
            f"(--max-prompt-chars; default {PROMPT_CHARS_PER_TOKEN} per token of --max-model-len "
            f"{self.llm.max_model_len})",
            param,
        )

    def check_prompt_chars_at_least(self, chars: int) -> None:
        check(
            chars <= self.max_prompt_chars,
            f"the messages have at least {chars} characters; this server takes at most {self.max_prompt_chars} "
            f"(--max-prompt-chars)",
            "messages",
        )

    def check_running(self) -> None:
        if self.stopping.is_set():
            raise APIError(503, SHUTDOWN_MESSAGE.split(";")[0], "service_unavailable")

    async def start(self, prompt, params, requested: int | None, default: int | None, param: str):
        """Tokenize, size ``max_tokens`` to the context's room (a request for more than the room is a 400;
        ``default`` None = all of it) and queue the sequences."""
        seqs = (await self.prepare([prompt], params, requested, default, param))[0]
        return seqs, self.submit(seqs)

    async def prepare(self, prompts: list, params, requested: int | None, default: int | None, param: str):
        """Each prompt's ``params.n`` sequences (tokenized on a worker thread), ``max_tokens`` sized as
        ``start`` says; nothing is queued, so a bad prompt refuses the whole request."""
        self.check_running()

        def make():
            return [self.engine.make_sequences(p, params) for p in prompts]

        try:
            groups = await asyncio.to_thread(make)
        except (PromptError, ImageError, ValueError) as e:
            raise APIError(400, str(e)) from None
        for seqs in groups:
            room = self.llm.max_model_len - len(seqs[0].prompt_ids)
            if requested is not None and requested > room:
                raise APIError(
                    400,
                    f"{param} is {requested}, more than the {room} tokens the context leaves after the prompt's "
                    f"{len(seqs[0].prompt_ids)} (--max-model-len {self.llm.max_model_len})",
                    param=param,
                )
            max_tokens = requested if requested is not None else min(default or room, room)
            for seq in seqs:
                seq.params = dataclasses.replace(seq.params, max_tokens=max_tokens)
        return groups

    def submit(self, seqs) -> asyncio.Queue:
        """Queue sequences (all or none); their outputs arrive on the queue returned."""
        try:
            queue = self.engine.submit(seqs)
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_exceeded") from None
        except EngineStoppedError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        self.live.add(queue)
        if self.stopping.is_set():  # the shutdown notice went out while this request was being tokenized
            queue.put_nowait(SHUTTING_DOWN)
        return queue

    async def collect(self, seqs, queue, request) -> None:
        """Wait until a non-streamed request's sequences finish (``drain``: a client that leaves stops them),
        then free them."""
        try:
            await drain(queue, seqs, request)
        finally:
            self.finish(seqs, queue)

    def finish(self, seqs, queue) -> None:
        self.live.discard(queue)
        self.engine.abort([s for s in seqs if not s.finished])

    def end_streams(self) -> None:
        self.stopping.set()
        for queue in self.live:
            queue.put_nowait(SHUTTING_DOWN)


def serving(request) -> Serving:
    """The ``Serving`` of the app a request came to."""
    return request.app.state.serving
