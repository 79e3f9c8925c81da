"""OpenAI-shaped errors: ``APIError`` (status, message, type, param), ``check`` for the boundary's 400s, and the
app's handlers that turn every error -- ours, HTTP's and the request models' validation -- into the same JSON
body (``responses.error_body``), never a stack trace."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fp4moe.server.middleware import log_client_closed
from fp4moe.server.protocol import clip
from fp4moe.server.responses import ErrorResponse, error_body

# the error answers a route documents in the OpenAPI schema (every one has ErrorResponse's body)
ERROR_RESPONSES: dict[int | str, dict] = {
    400: {
        "model": ErrorResponse,
        "description": "The request is malformed or asks for more than this server allows.",
    },
    401: {
        "model": ErrorResponse,
        "description": "The server has an API key and the request did not carry it.",
    },
    404: {"model": ErrorResponse, "description": "The model named is not the one this server serves."},
    413: {"model": ErrorResponse, "description": "The body is larger than --max-request-bytes."},
    429: {"model": ErrorResponse, "description": "The waiting queue is full (--max-waiting)."},
    503: {"model": ErrorResponse, "description": "The engine stopped or the server is shutting down."},
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def check(condition: bool, message: str, param: str | None = None) -> None:
    if not condition:
        raise APIError(400, message, param=param)


def install_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-shaped JSON body with its status."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status == 499:
            log_client_closed(request.scope)
        return JSONResponse(error_body(exc.message, exc.type, exc.status, exc.param), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, exc.status_code), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, where = validation_message(exc.errors())
        return JSONResponse(error_body(message, "invalid_request_error", 400, where), status_code=400)


def validation_message(errors) -> tuple[str, str | None]:
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
