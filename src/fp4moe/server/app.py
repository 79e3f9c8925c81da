"""The OpenAI-compatible HTTP server: /v1/models, /v1/chat/completions, /v1/completions, /health, /metrics.

Errors are OpenAI-shaped JSON (never a stack trace): 400 bad input (checked at the boundary by the request
models in ``protocol``, and by the limits below before any work), 401 wrong API key, 404 unknown model, 413
request body too large, 429 full queue, 503 engine stopped or server shutting down. A 500 (a bug) closes its
connection cleanly (``Connection: close``). A client that disconnects has its request aborted and its cache
slots freed, streaming or not, running or still queued; a non-stream one is logged with status 499 (nginx's
"client closed request"). On shutdown, streams that cannot finish within the grace period end with an error
event and ``[DONE]``. ``/health`` answers ``{"status": "ok"}`` (200) or ``{"status": "engine stopped"}`` (503).

Limits (``ServerConfig``): ``n`` ≤ ``max_n_sequences`` (vLLM's default, 16384) and ≤ the waiting queue; the
body ≤ ``max_request_bytes``; a prompt's characters ≤ ``max_prompt_chars`` before it is tokenized (default 8 per
token of the context); ``max_tokens`` ≤ the room the prompt leaves in the context (absent: all of it for chat,
16 for completions, OpenAI's defaults); stop strings and tools as ``protocol`` bounds them.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import json
import logging
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from fp4moe.engine.core import AsyncEngine, EngineStoppedError
from fp4moe.engine.multimodal import ImageError
from fp4moe.engine.process import EngineProcess
from fp4moe.engine.prompts import PromptError
from fp4moe.engine.scheduler import QueueFullError
from fp4moe.server.metrics import Metrics
from fp4moe.server.parsers.reasoning import ReasoningParser
from fp4moe.server.parsers.tool_calls import ToolCallParser, openai_tool_calls
from fp4moe.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    HealthStatus,
    Message,
    clip,
    error_body,
)

PROMPT_CHARS_PER_TOKEN = 8  # default --max-prompt-chars = this x max_model_len (English averages ~4)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    reasoning_parser: str | None = None  # "qwen3"
    tool_call_parser: str | None = None  # "qwen3_coder"
    enable_auto_tool_choice: bool = False
    max_image_bytes: int = 20 << 20
    allowed_media_domains: frozenset[str] = frozenset()  # hosts remote image URLs may come from
    max_n_sequences: int = 16384  # `n` at most (vLLM's VLLM_MAX_N_SEQUENCES default)
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN x max_model_len
    max_request_bytes: int | None = None  # None: room for max_prompt_chars of text and the images allowed

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return PROMPT_CHARS_PER_TOKEN * max_model_len

    def request_bytes(self, max_model_len: int, limit_images: int) -> int:
        """Up to 4 bytes a character of text (UTF-8), each allowed image as base64, and 1 MiB for the rest."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return (
            4 * self.prompt_chars(max_model_len) + limit_images * (self.max_image_bytes * 4 // 3) + (1 << 20)
        )


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _check(condition: bool, message: str, param: str | None = None) -> None:
    if not condition:
        raise APIError(400, message, param=param)


class APIKeyMiddleware:
    """A request to a ``/v1/`` route without ``Authorization: Bearer KEY`` gets a 401 OpenAI error.

    A pure ASGI middleware on purpose: ``@app.middleware("http")`` (starlette's BaseHTTPMiddleware) hands the
    route a wrapped ``receive`` on which ``request.is_disconnected()`` never turns true, so a non-stream
    request whose client had left would run to its end."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = Headers(scope=scope).get("authorization", "")
            if not hmac.compare_digest(given.encode(), self._expected):
                response = JSONResponse(
                    error_body("invalid API key", "authentication_error", 401), status_code=401
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """A request body over ``max_bytes`` gets a 413 OpenAI error before the app parses any of it: at once from
    its Content-Length, else as soon as the chunks received pass the limit. The body read here is handed on
    to the app, and after it the real ``receive`` (so a disconnect is still seen)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was complete
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body larger than {self.max_bytes} bytes (--max-request-bytes)"
        response = JSONResponse(
            error_body(message, "invalid_request_error", 413),
            status_code=413,
            headers={"connection": "close"},
        )
        await response(scope, receive, send)


class InternalErrorMiddleware:
    """An unexpected exception (a bug) becomes a 500 OpenAI error with ``Connection: close``, and its traceback
    goes to the log; the client never sees a stack trace, and never reuses a connection the server is closing.
    (starlette's own handler re-raises after answering, and uvicorn then drops the keep-alive connection
    without telling the client.)"""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            logging.getLogger("fp4moe.server").exception("internal error on %s", scope.get("path"))
            if started:
                raise  # mid-body: nothing valid can follow; uvicorn closes the connection
            response = JSONResponse(
                error_body(f"internal error: {type(exc).__name__}", "internal_error", 500),
                status_code=500,
                headers={"connection": "close"},
            )
            await response(scope, receive, send)


class _ShuttingDown:
    """Put on a request's output queue when the shutdown grace period ends: streams end with an error event
    and [DONE], non-stream requests answer 503."""


SHUTTING_DOWN = _ShuttingDown()


def _log_client_closed(scope: Scope) -> None:
    """An access-log line with status 499 for a request whose client left: uvicorn drops the response (and
    its own log line) once the connection is gone, so the server writes it, in uvicorn's access format."""
    client = scope.get("client")
    path = urllib.parse.quote(scope["path"])
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("latin-1")
    logging.getLogger("uvicorn.access").info(
        '%s - "%s %s HTTP/%s" %d',
        f"{client[0]}:{client[1]}" if client else "",
        scope["method"],
        path,
        scope.get("http_version", "1.1"),
        499,
    )


def build_app(engine: AsyncEngine | EngineProcess, config: ServerConfig) -> FastAPI:
    """The API over an engine on a thread of this process (``AsyncEngine``) or in its own process
    (``EngineProcess``)."""
    app = FastAPI(title="fp4moe", docs_url=None, redoc_url=None)
    llm = engine.prompts  # tokenizer, chat template, limits
    metrics = Metrics(config.served_model_name)
    max_prompt_chars = config.prompt_chars(llm.max_model_len)
    live: set[asyncio.Queue] = set()  # the output queues of requests in flight (told when shutdown ends them)
    stopping = threading.Event()  # set when the shutdown grace period ends: new requests get a 503

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status == 499:
            _log_client_closed(request.scope)
        return JSONResponse(error_body(exc.message, exc.type, exc.status, exc.param), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, exc.status_code), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, where = _validation_message(exc.errors())
        return JSONResponse(error_body(message, "invalid_request_error", 400, where), status_code=400)

    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.request_bytes(llm.max_model_len, llm.limit_images)
    )
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(InternalErrorMiddleware)

    @app.get(
        "/health",
        response_model=HealthStatus,
        responses={503: {"model": HealthStatus, "description": "The engine thread is not running."}},
    )
    async def health():
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        try:
            snap = await engine.snapshot()
        except EngineStoppedError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        return Response(metrics.render(snap), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": config.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "fp4moe",
                    "max_model_len": llm.max_model_len,
                }
            ],
        }

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str):
        _check_model(model_id)
        return (await models())["data"][0]

    def _check_model(name: str | None) -> None:
        if name and name != config.served_model_name:
            raise APIError(
                404,
                f"model {clip(name)!r} does not exist; this server serves {config.served_model_name!r}",
                "not_found_error",
                "model",
            )

    def _check_n(n: int) -> None:
        _check(
            n <= config.max_n_sequences,
            f"n is {n}; this server allows at most {config.max_n_sequences} (--max-n-sequences)",
            "n",
        )
        waiting = engine.max_waiting
        _check(n <= waiting, f"n is {n}; the waiting queue holds at most {waiting} (--max-waiting)", "n")

    def _check_prompt_chars(text: str, param: str) -> None:
        _check(
            len(text) <= max_prompt_chars,
            f"the prompt has {len(text)} characters; this server takes at most {max_prompt_chars} "
            f"(--max-prompt-chars; default {PROMPT_CHARS_PER_TOKEN} per token of --max-model-len "
            f"{llm.max_model_len})",
            param,
        )

    def _check_prompt_chars_at_least(chars: int) -> None:
        _check(
            chars <= max_prompt_chars,
            f"the messages have at least {chars} characters; this server takes at most {max_prompt_chars} "
            f"(--max-prompt-chars)",
            "messages",
        )

    def _check_running() -> None:
        if stopping.is_set():
            raise APIError(503, _SHUTDOWN_MESSAGE.split(";")[0], "service_unavailable")

    async def _start(prompt, params, requested: int | None, default: int | None, param: str):
        """Tokenize, size ``max_tokens`` to the context's room (a request for more than the room is a 400;
        ``default`` None = all of it) and queue the sequences."""
        _check_running()
        try:
            seqs = await asyncio.to_thread(engine.make_sequences, prompt, params)
        except (PromptError, ImageError, ValueError) as e:
            raise APIError(400, str(e)) from None
        room = llm.max_model_len - len(seqs[0].prompt_ids)
        if requested is not None and requested > room:
            raise APIError(
                400,
                f"{param} is {requested}, more than the {room} tokens the context leaves after the prompt's "
                f"{len(seqs[0].prompt_ids)} (--max-model-len {llm.max_model_len})",
                param=param,
            )
        max_tokens = requested if requested is not None else min(default or room, room)
        for seq in seqs:
            seq.params = dataclasses.replace(seq.params, max_tokens=max_tokens)
        try:
            queue = engine.submit(seqs)
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_exceeded") from None
        except EngineStoppedError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        live.add(queue)
        if stopping.is_set():  # the shutdown notice went out while this request was being tokenized
            queue.put_nowait(SHUTTING_DOWN)
        return seqs, queue

    def _finish(seqs, queue) -> None:
        live.discard(queue)
        engine.abort([s for s in seqs if not s.finished])

    def _end_streams() -> None:
        stopping.set()
        for queue in live:
            queue.put_nowait(SHUTTING_DOWN)

    app.state.end_streams = _end_streams

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        _check_model(req.model)
        _check(
            req.response_format is None or req.response_format.get("type") == "text",
            "response_format json_object/json_schema is not supported yet (no guided decoding)",
            "response_format",
        )
        _check_n(req.n)
        tools = _tools_for(req, config)
        messages, images = _prepare_messages(
            req.messages, llm.limit_images, config.max_image_bytes, config.allowed_media_domains
        )
        top = req.top_logprobs if req.logprobs else None
        try:
            params = req.sampling_params(llm.max_model_len, (top or 0) if req.logprobs else None)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        _check(
            req.requested_max_tokens is None or req.requested_max_tokens >= 1,
            f"max_tokens must be at least 1, got {req.requested_max_tokens}",
            "max_tokens",
        )
        _check_prompt_chars_at_least(req.text_chars())  # before templating: its cost grows with the text
        try:  # off the event loop: a long conversation takes the template a while to render
            text = await asyncio.to_thread(
                llm.apply_chat_template, messages, tools=tools, **(req.chat_template_kwargs or {})
            )
        except Exception as e:  # template errors are the caller's messages
            raise APIError(400, f"cannot apply the chat template: {clip(str(e), 300)}") from None
        _check_prompt_chars(text, "messages")
        images = await _fetch_images(images, config.max_image_bytes)
        opened_think = text.rstrip().endswith("<think>")
        forced = ""  # a named tool_choice starts the call in the prompt; the model writes its parameters
        if req.tool_choice is not None and not isinstance(req.tool_choice, str) and config.tool_call_parser:
            forced = f"<tool_call>\n<function={req.tool_choice.function.name}>\n"
            text += ("</think>\n\n" if opened_think else "") + forced
            opened_think = False
        prompt = {"prompt": text, "multi_modal_data": {"image": images}} if images else text
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        seqs, queue = await _start(prompt, params, req.requested_max_tokens, None, param)

        def make_parsers():
            reasoning = ReasoningParser(opened_think) if config.reasoning_parser and not forced else None
            tool = ToolCallParser(tools) if tools and config.tool_call_parser else None
            return reasoning, tool, forced

        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(
                _chat_stream(rid, req, seqs, queue, make_parsers), media_type="text/event-stream"
            )
        try:
            await _drain(queue, seqs, request)
        finally:
            _finish(seqs, queue)
        choices = []
        for i, seq in enumerate(seqs):
            reasoning_parser, tool_parser, prefix = make_parsers()
            reasoning, content, calls = _parse_whole(prefix + seq.text, reasoning_parser, tool_parser)
            message = {"role": "assistant", "content": content if (content or not calls) else None}
            if config.reasoning_parser:
                message["reasoning_content"] = reasoning or None
            if calls:
                message["tool_calls"] = calls
            choice = {
                "index": i,
                "message": message,
                "finish_reason": "tool_calls" if calls else seq.finish_reason.value,
                "logprobs": None,
            }
            if req.logprobs:
                choice["logprobs"] = {"content": [_chat_logprob(llm.tokenizer, r) for r in seq.logprobs]}
            choices.append(choice)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": config.served_model_name,
            "choices": choices,
            "usage": _usage(seqs),
        }

    async def _chat_stream(rid, req, seqs, queue, make_parsers):
        created, model = int(time.time()), config.served_model_name
        index = {id(s): i for i, s in enumerate(seqs)}
        parsers = [make_parsers() for _ in seqs]
        called = [False] * len(seqs)
        pending = [p[2] for p in parsers]  # a forced tool-call start, parsed with the first delta

        def chunk(i, delta, finish=None, logprobs=None):
            body = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
            }
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            for i in range(len(seqs)):
                yield chunk(i, {"role": "assistant", "content": ""})
            remaining = len(seqs)
            while remaining:
                out = SHUTTING_DOWN if stopping.is_set() else await queue.get()  # a backlog waits
                if out is SHUTTING_DOWN or out.error:
                    yield _error_event(out)
                    yield "data: [DONE]\n\n"
                    return
                i = index[id(out.seq)]
                texts = [pending[i] + out.delta]
                pending[i] = ""
                if out.finished:
                    texts.append(None)  # flush marker
                for text in texts:
                    delta = _stream_delta(text, *parsers[i][:2])
                    if delta.get("tool_calls"):
                        called[i] = True
                    lp = None
                    if req.logprobs and text is not None and out.logprob is not None:
                        lp = {"content": [_chat_logprob(llm.tokenizer, out.logprob)]}
                    if delta or lp:
                        yield chunk(i, delta, logprobs=lp)
                if out.finished:
                    remaining -= 1
                    yield chunk(i, {}, "tool_calls" if called[i] else out.seq.finish_reason.value)
            if req.stream_options and req.stream_options.include_usage:
                yield _usage_event(rid, "chat.completion.chunk", created, model, seqs)
            yield "data: [DONE]\n\n"
        except Exception as e:  # a bug mid-stream: the client gets an error event, not a cut connection
            logging.getLogger("fp4moe.server").exception("chat stream failed")
            yield _error_event(e)
            yield "data: [DONE]\n\n"
        finally:  # client gone (the task is cancelled) or done: free whatever is left
            _finish(seqs, queue)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check_model(req.model)
        _check_n(req.n)
        if isinstance(req.prompt, str):
            _check_prompt_chars(req.prompt, "prompt")
        else:
            _check(
                len(req.prompt) < llm.max_model_len,
                f"the prompt has {len(req.prompt)} tokens; the maximum model length is {llm.max_model_len}",
                "prompt",
            )
        _check(
            req.max_tokens is None or req.max_tokens >= 1,
            f"max_tokens must be at least 1, got {req.max_tokens}",
            "max_tokens",
        )
        try:
            params = req.sampling_params(llm.max_model_len, req.logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        seqs, queue = await _start(
            req.prompt, params, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens"
        )
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(
                _completion_stream(rid, req, seqs, queue), media_type="text/event-stream"
            )
        try:
            await _drain(queue, seqs, request)
        finally:
            _finish(seqs, queue)
        choices = [
            {
                "index": i,
                "text": s.text,
                "finish_reason": s.finish_reason.value,
                "logprobs": _completion_logprobs(llm.tokenizer, s) if req.logprobs is not None else None,
            }
            for i, s in enumerate(seqs)
        ]
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": config.served_model_name,
            "choices": choices,
            "usage": _usage(seqs),
        }

    async def _completion_stream(rid, req, seqs, queue):
        created, model = int(time.time()), config.served_model_name
        index = {id(s): i for i, s in enumerate(seqs)}
        try:
            remaining = len(seqs)
            while remaining:
                out = SHUTTING_DOWN if stopping.is_set() else await queue.get()  # a backlog waits
                if out is SHUTTING_DOWN or out.error:
                    yield _error_event(out)
                    yield "data: [DONE]\n\n"
                    return
                logprobs = None
                if req.logprobs is not None and out.logprob is not None:
                    r = out.logprob
                    token = llm.tokenizer.decode([r.token_id])
                    logprobs = {
                        "tokens": [token],
                        "token_logprobs": [r.logprob],
                        "top_logprobs": [
                            {llm.tokenizer.decode([t]): v for t, v in (r.top_logprobs or {}).items()}
                        ],
                        "text_offset": [len(out.seq.text) - len(out.delta)],
                    }
                choice = {
                    "index": index[id(out.seq)],
                    "text": out.delta,
                    "finish_reason": out.seq.finish_reason.value if out.finished else None,
                    "logprobs": logprobs,
                }
                remaining -= out.finished
                body = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
                yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
            if req.stream_options and req.stream_options.include_usage:
                yield _usage_event(rid, "text_completion", created, model, seqs)
            yield "data: [DONE]\n\n"
        except Exception as e:
            logging.getLogger("fp4moe.server").exception("completion stream failed")
            yield _error_event(e)
            yield "data: [DONE]\n\n"
        finally:
            _finish(seqs, queue)

    @app.on_event("shutdown")
    async def _shutdown():
        await asyncio.to_thread(engine.shutdown)

    app.state.engine, app.state.metrics = engine, metrics
    return app


def _validation_message(errors) -> tuple[str, str | None]:
    """One readable message for pydantic's errors: the deepest one (a union reports every branch; the one that
    got furthest is what the client meant), its location without pydantic's branch labels."""
    if not errors:
        return "invalid request", None
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    parts = [str(x) for x in first.get("loc", ()) if x != "body" and not _branch_label(x)]
    where = ".".join(parts) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return msg + (f" ({clip(where, 120)})" if where else ""), where and clip(where, 120)


def _branch_label(loc_item) -> bool:
    """pydantic's names for union branches in an error location ("str", "list[...]", "function-after[...]")."""
    return isinstance(loc_item, str) and (
        "[" in loc_item or loc_item in ("str", "int", "float", "bool", "dict", "list", "none", "literal")
    )


async def _fetch_images(images: list, max_bytes: int) -> list:
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


async def _drain(queue: asyncio.Queue, seqs, request: Request, every: float = 0.25) -> None:
    """Wait for every sequence to finish; stop early (the caller aborts) if the client goes away, the engine
    fails the request or the shutdown grace period ends.

    The client is looked at every ``every`` seconds whether or not tokens are arriving (a running request
    fills the queue faster than any timeout on ``queue.get`` would expire)."""
    remaining = len(seqs)
    look_at = time.monotonic() + every
    while remaining:
        if time.monotonic() >= look_at:
            if await request.is_disconnected():
                raise APIError(499, "client disconnected", "client_closed_request")
            look_at = time.monotonic() + every
        try:
            out = await asyncio.wait_for(queue.get(), timeout=max(0.01, look_at - time.monotonic()))
        except TimeoutError:
            continue
        if out is SHUTTING_DOWN:
            raise APIError(503, _SHUTDOWN_MESSAGE, "service_unavailable")
        if out.error:
            raise APIError(500, f"the engine failed this request: {out.error}", "internal_error")
        remaining -= out.finished


_SHUTDOWN_MESSAGE = "the server is shutting down; this request was stopped before it finished"


def _error_event(cause) -> str:
    """A stream event telling the client its request failed (the stream then ends with [DONE]): the engine
    failed it (an output with ``error``), the server is shutting down, or an exception in the server."""
    if cause is SHUTTING_DOWN:
        body = error_body(_SHUTDOWN_MESSAGE, "service_unavailable", 503)
    elif isinstance(cause, Exception):
        body = error_body(f"internal error: {type(cause).__name__}", "internal_error", 500)
    else:
        body = error_body(f"the engine failed this request: {cause.error}", "internal_error", 500)
    return f"data: {json.dumps(body)}\n\n"


def _usage_event(rid: str, obj: str, created: int, model: str, seqs) -> str:
    """The final stream event carrying ``usage`` (stream_options.include_usage)."""
    body = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": _usage(seqs),
    }
    return f"data: {json.dumps(body)}\n\n"


def _usage(seqs) -> dict:
    prompt = len(seqs[0].prompt_ids)
    completion = sum(len(s.output_ids) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _tools_for(req: ChatCompletionRequest, config: ServerConfig) -> list[dict] | None:
    choice = req.tool_choice
    named = choice is not None and not isinstance(choice, str)
    if not req.tools or choice == "none":
        _check(not named, "tool_choice names a function but no tools were given", "tool_choice")
        return None
    if named:
        name = choice.function.name
        _check(
            name in {t.function.name for t in req.tools},
            f"tool_choice names {clip(name)!r}, which is not among the tools",
            "tool_choice",
        )
    elif choice == "required":
        raise APIError(
            400,
            "tool_choice 'required' is not supported; use 'auto', 'none' or a named function",
            param="tool_choice",
        )
    else:
        _check(
            config.enable_auto_tool_choice and config.tool_call_parser is not None,
            '"auto" tool choice needs --enable-auto-tool-choice and --tool-call-parser',
            "tool_choice",
        )
    return [t.model_dump(exclude_none=True) for t in req.tools]


def _prepare_messages(
    messages: list[Message], limit: int, max_bytes: int, allowed_domains: frozenset[str] = frozenset()
) -> tuple[list[dict], list]:
    """Template-ready messages (tool-call arguments as dicts) and the images in order: bytes of data URLs,
    or the URL itself for remote images on an allowed domain (fetched later by ``_fetch_images``)."""
    out, images = [], []
    for m in messages:
        for part in m.content if isinstance(m.content, list) else ():
            if part.type != "image_url":
                continue
            _check(
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
                _check(
                    host in allowed_domains,
                    f"remote image URLs are not fetched unless their domain is allowed "
                    f"(--allowed-media-domains); {clip(host)!r} is not",
                    "messages",
                )
                images.append(url)
                continue
            _check(url.startswith("data:"), "image URLs must be data: URLs", "messages")
            _check(len(url) * 3 // 4 <= max_bytes, f"image larger than {max_bytes} bytes", "messages")
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
                _check(
                    isinstance(fn["arguments"], dict),
                    "tool_calls arguments must be a JSON object",
                    "messages",
                )
        out.append(m)
    return out, images


def _parse_whole(text: str, reasoning_parser, tool_parser) -> tuple[str | None, str, list[dict]]:
    reasoning = None
    content = text
    if reasoning_parser is not None:
        a, b = reasoning_parser.feed(text), reasoning_parser.finish()
        reasoning, content = (a.reasoning + b.reasoning).strip("\n") or None, a.content + b.content
    calls = []
    if tool_parser is not None:
        c = tool_parser.feed(content).content + tool_parser.finish().content
        calls = openai_tool_calls(tool_parser.calls)
        content = c.strip() if calls else c
    return reasoning, content, calls


def _stream_delta(text: str | None, reasoning_parser, tool_parser) -> dict:
    """One streamed text delta (None = end of output) through the parsers, as an OpenAI delta."""
    reasoning, content = "", text or ""
    if reasoning_parser is not None:
        d = reasoning_parser.feed(text) if text is not None else reasoning_parser.finish()
        reasoning, content = d.reasoning, d.content
    delta: dict = {}
    if tool_parser is not None:
        d = tool_parser.feed(content)
        content = d.content
        if text is None:
            content += tool_parser.finish().content
        if d.tool_calls:
            delta["tool_calls"] = [
                {
                    "index": t.index,
                    **({"id": t.id, "type": "function"} if t.id else {}),
                    "function": {
                        k: v for k, v in (("name", t.name), ("arguments", t.arguments)) if v is not None
                    },
                }
                for t in d.tool_calls
            ]
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    return delta


def _chat_logprob(tokenizer, r) -> dict:
    token = tokenizer.decode([r.token_id])
    return {
        "token": token,
        "logprob": r.logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [
            {"token": tokenizer.decode([t]), "logprob": lp, "bytes": list(tokenizer.decode([t]).encode())}
            for t, lp in (r.top_logprobs or {}).items()
        ],
    }


def _completion_logprobs(tokenizer, seq) -> dict:
    tokens = [tokenizer.decode([r.token_id]) for r in seq.logprobs]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [r.logprob for r in seq.logprobs],
        "top_logprobs": [
            {tokenizer.decode([t]): lp for t, lp in (r.top_logprobs or {}).items()} for r in seq.logprobs
        ],
        "text_offset": offsets,
    }
