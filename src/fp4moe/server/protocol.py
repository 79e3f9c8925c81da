"""OpenAI request shapes (the fields we honour), checked at the boundary, and their SamplingParams.

Everything a handler later reads is typed here, so a malformed request is refused with a 400 that names the
field before any work is done: message roles and content parts (``text`` and ``image_url``; other part types
are refused, as vLLM does), tools, ``tool_choice``, ``tool_calls`` in the history, numbers that are finite,
and text that is valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"`` cannot be encoded to UTF-8, so
no tokenizer can take it). Limits that depend on the server (``n``, prompt length, ``max_tokens``) are
checked by the handlers; the fixed ones are the constants below.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fp4moe.engine.request.sampler import SamplingParams

# `stop` entries per request (OpenAI allows 4; vLLM sets no limit): each is looked for in the text after every
# token, so a request's cost in the server's front grows with their count
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_TOOLS = 512
MAX_MESSAGES = 4096
MAX_DEPTH = 64  # JSON nesting of a request (tool schemas and arguments included)
INT32 = 2**31 - 1  # token ids, top_k: what the GPU tensors hold
# chat_template_kwargs a client may not set: they would replace the server's template (whose rendering
# runs server code paths) or change what apply_chat_template returns (vLLM refuses a request's own template
# unless --trust-request-chat-template)
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"chat_template", "tokenize", "tools", "messages", "conversation", "documents", "add_generation_prompt",
     "continue_final_message", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
     "truncation", "max_length", "tokenizer_kwargs"}
)  # fmt: skip
MAX_ERROR_CHARS = 1024  # an error message never echoes more than this of what the client sent

# the range torch.Generator.manual_seed takes, less the n-1 that sequences 2..n add to the seed
SEED_RANGE = (-(2**63), 2**63 - 1)


def clip(text: object, limit: int = 80) -> str:
    """``repr``-like text of a client's value for an error message, cut to ``limit`` characters."""
    s = text if isinstance(text, str) else repr(text)
    return s if len(s) <= limit else s[:limit] + f"… ({len(s)} characters)"


def _bad_input(data: Any) -> str | None:
    """What is wrong with the raw body, before pydantic looks at it: a string or key that is not valid Unicode
    (a lone surrogate), or nesting deeper than MAX_DEPTH (a walk that recursed would overflow at ~950).
    Iterative, and the location is built only for the bad value: time and memory linear in the body."""
    stack: list[tuple[Any, int, tuple]] = [(data, 0, ())]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            return f"the request nests deeper than {MAX_DEPTH} levels (at {_path(where)})"
        if isinstance(value, str):
            if not value.isascii() and not _encodes(value):
                return f"{clip(_path(where), 80)} is not valid Unicode (a lone UTF-16 surrogate)"
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and not k.isascii() and not _encodes(k):
                    return f"a key in {clip(_path(where), 80)} is not valid Unicode (a lone UTF-16 surrogate)"
                stack.append((v, depth + 1, (where, k)))
        elif isinstance(value, list):
            stack.extend((v, depth + 1, (where, i)) for i, v in enumerate(value))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(where: tuple) -> str:
    """(((), "messages"), 0), "content") -> messages[0].content"""
    parts = []
    while where:
        where, key = where
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).lstrip(".") or "body"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # unknown fields are ignored, as vLLM does


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL | str  # OpenAI sends {"url": ...}; a bare URL string is taken too

    @property
    def url(self) -> str:
        return self.image_url.url if isinstance(self.image_url, ImageURL) else self.image_url


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
PART_TYPES = ("text", "image_url")


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"  # a JSON object (as text, OpenAI's form, or already parsed)


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("message content must be a string, a list of content parts or null")
        for part in v:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError("message content parts must be objects with a type")
            if part["type"] not in PART_TYPES:
                raise ValueError(
                    f"content part type {clip(part['type'], 40)!r} is not supported; use 'text' or 'image_url'"
                )
        return v

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it (tool-call arguments as dicts, content never None)."""
        m = self.model_dump(exclude_none=True)
        m["content"] = m.get("content") or ""
        if m["role"] == "developer":  # OpenAI's newer name for the system role; chat templates know "system"
            m["role"] = "system"
        return m


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema_object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        props = v.get("properties")
        if props is not None and not (
            isinstance(props, dict) and all(isinstance(p, dict) for p in props.values())
        ):
            raise ValueError("parameters.properties must be an object mapping names to JSON schemas")
        required = v.get("required")
        if required is not None and not (
            isinstance(required, list) and all(isinstance(r, str) for r in required)
        ):
            raise ValueError("parameters.required must be a list of names")
        return v


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=-1, le=INT32)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: (
        Annotated[str, Field(max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_STRINGS)
        ]
        | None
    ) = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32)]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS
    )
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_input(cls, data: Any) -> Any:
        problem = _bad_input(data)
        if problem:
            raise ValueError(problem)
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _count_stop_strings(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop has {len(v)} strings; this server takes at most {MAX_STOP_STRINGS} (each is looked for "
                "after every token)"
            )
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:  # vLLM's rule
            raise ValueError("stream_options can only be given with stream: true")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError with the offending field for bad values."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            n=self.n,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
        )


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(v or ()))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        return v

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:  # vLLM's and OpenAI's rule
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None), None)

    def text_chars(self) -> int:
        """Characters of text the template will render: contents, tool-call arguments, tool definitions
        (a lower bound of the prompt's length, cheap to compute before templating)."""
        total = 0
        for m in self.messages:
            if isinstance(m.content, str):
                total += len(m.content)
            elif m.content:
                total += sum(len(p.text) for p in m.content if isinstance(p, TextPart))
            for call in m.tool_calls or ():
                args = call.function.arguments
                total += len(call.function.name) + (len(args) if isinstance(args, str) else 0)
        return total


TokenId = Annotated[int, Field(ge=0, le=INT32)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_Sampling):
    # OpenAI's four forms: a text, texts, token ids, lists of token ids (each prompt its own choices)
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: int | None = None  # absent: 16 (OpenAI's default), or less if the context leaves less room
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # the prompt before each completion (with logprobs: the prompt tokens' too, vLLM's way)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of {self.best_of} with n {self.n}: best_of must be at least n (vLLM's rule), and more "
                "than n is not supported (no ranking by log probability); leave it out or set it to n"
            )
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, v: Any) -> Any:
        """One of the four forms, with a message that says which part is wrong (pydantic's union error would
        name whichever branch it tried last)."""
        if isinstance(v, str):
            return v
        forms = "a string, a list of strings, a list of token ids or a list of token-id lists"
        if not isinstance(v, list) or not v:
            raise ValueError(f"prompt must be {forms}, not empty")
        if all(isinstance(x, str) for x in v):
            return v
        for i, ids in enumerate(v if isinstance(v[0], list) else [v]):
            where = f"prompt[{i}]" if isinstance(v[0], list) else "prompt"
            if not isinstance(ids, list) or not ids:
                raise ValueError(f"{where} must be a non-empty list of token ids (prompt must be {forms})")
            bad = next(
                (t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT32), None
            )
            if bad is not None:
                raise ValueError(f"{where} holds {clip(bad, 40)}: token ids are integers in [0, {INT32}]")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one per element of a list form."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)
