"""OpenAI response shapes: what the routes send (``/health``, errors, models, chat completions and their
stream chunks, completions). A field declared ``_omitted()`` is left out of the JSON when it is None (OpenAI
leaves it out); every other field is always sent, null or not. The requests: ``protocol``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from fp4moe.server.protocol import MAX_ERROR_CHARS


class HealthStatus(BaseModel):
    """The body of ``/health``: "ok" (200) while the engine thread runs, else "engine stopped" (503)."""

    status: Literal["ok", "engine stopped"]


def _omitted() -> Any:
    return Field(default=None, exclude_if=lambda v: v is None)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body, whatever raised it (``errors.install_handlers``, the middleware, a stream)."""

    error: ErrorInfo


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 40] + f"… ({len(message)} characters)"
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)).model_dump()


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "fp4moe"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is only tool calls
    reasoning_content: str | None = _omitted()
    tool_calls: list[ToolCallOut] | None = _omitted()


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunction(BaseModel):
    name: str | None = _omitted()
    arguments: str | None = _omitted()


class DeltaToolCall(BaseModel):
    """A tool call as it streams: its id, type and name in the first delta, argument text in later ones."""

    index: int
    id: str | None = _omitted()
    type: Literal["function"] | None = _omitted()
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = _omitted()
    content: str | None = _omitted()
    reasoning_content: str | None = _omitted()
    tool_calls: list[DeltaToolCall] | None = _omitted()


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = _omitted()  # the last event's, with stream_options.include_usage


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: per token its text, logprob, the top ones there (with its own) and where its
    text starts; an echoed prompt's first token has no logprob (null, as vLLM answers)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """A whole ``/v1/completions`` answer, and each of its stream events (without usage but the last)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _omitted()
