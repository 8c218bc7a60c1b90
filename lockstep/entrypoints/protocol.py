"""Request and response models of the HTTP API: SGLang's native /generate and OpenAI's API.

Every request model forbids unknown fields: a parameter that is silently ignored is a wrong answer
the client cannot see. A JSON null counts as "not given", as in OpenAI's API. Validation errors
become one readable sentence through `format_validation_error`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

import pydantic
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

_INT32_MAX = 2**31 - 1
_MAX_STOP_STRINGS = 16
_MAX_N = 16

TokenId = Annotated[int, Field(ge=0, le=_INT32_MAX)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# torch.Generator.manual_seed takes anything from int64's minimum to uint64's maximum.
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


def _shaped(branches: dict[str, Any], pick: Callable[[Any], str | None], expected: str) -> Any:
    """A union chosen by the input's JSON shape, so that a bad value gets one error, not one per
    union member."""
    members = tuple(Annotated[t, Tag(tag)] for tag, t in branches.items())
    return Annotated[
        Union[members],  # noqa: UP007 - built from a tuple
        Discriminator(
            pick, custom_error_type="invalid_shape", custom_error_message=f"must be {expected}"
        ),
    ]


def _str_or_list(v: Any) -> str | None:
    return "str" if isinstance(v, str) else "list" if isinstance(v, list) else None


def _ids_shape(v: Any) -> str | None:
    if not isinstance(v, list):
        return None
    return "list[list]" if v and isinstance(v[0], list) else "list"


def _prompt_shape(v: Any) -> str | None:
    if isinstance(v, str):
        return "str"
    if not isinstance(v, list):
        return None
    first = v[0] if v else ""
    if isinstance(first, list):
        return "list[list]"
    if isinstance(first, int) and not isinstance(first, bool):
        return "list[int]"
    return "list[str]"


def _object_or_list(v: Any) -> str | None:
    return (
        "list" if isinstance(v, list) else "dict" if isinstance(v, (Mapping, BaseModel)) else None
    )


def _bool_or_list(v: Any) -> str:
    return "list" if isinstance(v, list) else "bool"


TextInput = _shaped(
    {"str": str, "list": Annotated[list[str], Field(min_length=1)]},
    _str_or_list,
    "a string or a non-empty list of strings",
)
IdsInput = _shaped(
    {
        "list": Annotated[list[TokenId], Field(min_length=1)],
        "list[list]": Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)
        ],
    },
    _ids_shape,
    "a list of token ids or a list of lists of token ids",
)
PromptInput = _shaped(
    {
        "str": str,
        "list[str]": Annotated[list[str], Field(min_length=1)],
        "list[int]": Annotated[list[TokenId], Field(min_length=1)],
        "list[list]": Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)
        ],
    },
    _prompt_shape,
    "a string, a list of strings, a list of token ids or a list of lists of token ids",
)
RidInput = _shaped(
    {"str": NonEmptyStr, "list": list[NonEmptyStr]}, _str_or_list, "a string or a list of strings"
)

_UNION_TAGS = frozenset({"str", "list", "dict", "bool", "list[str]", "list[int]", "list[list]"})


def _stop_to_list(v: Any) -> Any:
    if isinstance(v, str):
        return [v]
    if not isinstance(v, (list, tuple)):
        raise ValueError("must be a string or a list of strings")
    return list(v)


def _check_top_k(v: int) -> int:
    if v != -1 and v < 1:
        raise ValueError("must be -1 (disabled) or >= 1")
    return v


LogprobFlag = _shaped({"bool": bool, "list": list[bool]}, _bool_or_list, "a boolean or a list")
StopList = Annotated[
    list[NonEmptyStr], Field(max_length=_MAX_STOP_STRINGS), BeforeValidator(_stop_to_list)
]
TopK = Annotated[int, AfterValidator(_check_top_k)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    # Fields for which null is a value of its own rather than "use the default".
    _null_means_something: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            keep = cls._null_means_something
            return {k: v for k, v in data.items() if v is not None or k in keep}
        return data


class SamplingParamsModel(_Strict):
    _null_means_something = frozenset({"max_new_tokens"})

    max_new_tokens: int | None = Field(128, ge=0, le=_INT32_MAX)  # None: until the context is full
    min_new_tokens: int = Field(0, ge=0, le=_INT32_MAX)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: TopK = -1
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    stop: StopList = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = Field(1, ge=1, le=_MAX_N)
    seed: Seed | None = None
    no_stop_trim: bool = False

    @model_validator(mode="after")
    def _check_min_tokens(self) -> SamplingParamsModel:
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})"
            )
        return self


SamplingParamsInput = _shaped(
    {"dict": SamplingParamsModel, "list": list[SamplingParamsModel]},
    _object_or_list,
    "an object or a list of objects",
)


@dataclass(slots=True)
class SingleGenerateReq:
    """One prompt, one sample: what the tokenizer manager schedules."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling_params: SamplingParamsModel
    stream: bool
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    index: int  # position among all fanned-out requests: prompt-major, then sample
    prompt_index: int
    sample_index: int


class GenerateReqInput(_Strict):
    """Body of SGLang's native /generate."""

    text: TextInput | None = None
    input_ids: IdsInput | None = None
    sampling_params: SamplingParamsInput = Field(default_factory=SamplingParamsModel)
    rid: RidInput | None = None
    stream: bool = False
    return_logprob: LogprobFlag = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or (
            self.input_ids is not None and isinstance(self.input_ids[0], list)
        )

    @property
    def batch_size(self) -> int:
        prompts = self.text if self.text is not None else self.input_ids
        return len(prompts) if self.is_batch else 1  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _check_consistency(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        size = self.batch_size
        for name in ("sampling_params", "rid", "return_logprob"):
            value = getattr(self, name)
            if isinstance(value, list) and (not self.is_batch or len(value) != size):
                prompts = f"{size} prompts" if self.is_batch else "a single prompt"
                raise ValueError(
                    f"{name}: a list must have one entry per prompt; got {len(value)} for {prompts}"
                )
        if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
            raise ValueError("rid: the rids of a batch must be distinct")
        wants_logprobs = (
            any(self.return_logprob)
            if isinstance(self.return_logprob, list)
            else self.return_logprob
        )
        if self.top_logprobs_num and not wants_logprobs:
            raise ValueError("top_logprobs_num: requires return_logprob to be true")
        return self

    def normalize(self) -> list[SingleGenerateReq]:
        """Fans a batch and n > 1 out into single requests (rids `{rid}-{i}` for the samples)."""
        size = self.batch_size
        if self.text is not None:
            texts = self.text if isinstance(self.text, list) else [self.text]
            prompts: list[tuple[str | None, list[int] | None]] = [(t, None) for t in texts]
        else:
            ids = self.input_ids if self.is_batch else [self.input_ids]
            prompts = [(None, list(p)) for p in ids]  # type: ignore[union-attr]
        params = _per_prompt(self.sampling_params, size)
        rids = (
            _per_prompt(self.rid, size)
            if self.rid is not None
            else [uuid.uuid4().hex for _ in prompts]
        )
        logprob_flags = _per_prompt(self.return_logprob, size)

        out: list[SingleGenerateReq] = []
        for b, ((text, input_ids), sp, rid) in enumerate(zip(prompts, params, rids)):
            for i in range(sp.n):
                # Each sample gets its own seed, or seeded samples would all be the same text.
                single = (
                    sp
                    if sp.n == 1
                    else sp.model_copy(update={"n": 1, "seed": _nth_seed(sp.seed, i)})
                )
                out.append(
                    SingleGenerateReq(
                        rid=rid if sp.n == 1 else f"{rid}-{i}",
                        text=text,
                        input_ids=input_ids,
                        sampling_params=single,
                        stream=self.stream,
                        return_logprob=logprob_flags[b],
                        logprob_start_len=self.logprob_start_len,
                        top_logprobs_num=self.top_logprobs_num,
                        return_text_in_logprobs=self.return_text_in_logprobs,
                        index=len(out),
                        prompt_index=b,
                        sample_index=i,
                    )
                )
        if len({r.rid for r in out}) != len(out):
            raise ValueError("rid: the fanned-out rids collide; choose distinct rids")
        return out


def _per_prompt(value: Any, size: int) -> list[Any]:
    return list(value) if isinstance(value, list) else [value] * size


def _nth_seed(seed: int | None, i: int) -> int | None:
    if seed is None or i == 0:
        return seed
    return (seed + i + 2**63) % 2**64 - 2**63  # stays within what manual_seed accepts


# ---------------------------------------------------------------------------------------------
# OpenAI requests


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAIRequest(_Strict):
    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=_MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopList = Field(default_factory=list)
    seed: Seed | None = None
    user: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # SGLang's extensions of the OpenAI API.
    top_k: TopK = -1
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0, le=_INT32_MAX)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    no_stop_trim: bool = False

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("is not supported by this server; omit it or send {}")
        return v

    @model_validator(mode="after")
    def _check_common(self) -> _OpenAIRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        limit = self._max_new_tokens()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({limit})")
        return self

    def _max_new_tokens(self) -> int | None:
        raise NotImplementedError

    def to_sampling_params(self) -> SamplingParamsModel:
        return SamplingParamsModel(
            max_new_tokens=self._max_new_tokens(),
            min_new_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            n=self.n,
            seed=self.seed,
            no_stop_trim=self.no_stop_trim,
        )


class CompletionRequest(_OpenAIRequest):
    prompt: PromptInput
    max_tokens: int = Field(16, ge=0, le=_INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("is not supported (this server does no fill-in-the-middle)")
        return v

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of ({self.best_of}): only best_of equal to n ({self.n}) is supported"
            )
        return self

    def _max_new_tokens(self) -> int | None:
        return self.max_tokens


def _check_text_parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"part {j} has type {kind!r}; only text parts are supported")
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise ValueError(f'part {j} must be {{"type": "text", "text": <string>}}')
    return parts


ContentInput = _shaped(
    {"str": str, "list": Annotated[list[dict[str, Any]], AfterValidator(_check_text_parts)]},
    _str_or_list,
    "a string or a list of content parts",
)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: ContentInput | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a {self.role} message")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, le=_INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=0, le=_INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "none" / "auto" (no tools) or omitted
    parallel_tool_calls: bool | None = None  # meaningless without tools, which are refused

    @field_validator("response_format")
    @classmethod
    def _text_format_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v != {"type": "text"}:
            raise ValueError(f'type {v.get("type")!r} is not supported; only {{"type": "text"}} is')
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v:
            raise ValueError("tool calling is not supported by this server")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        if v not in (None, "none", "auto"):
            raise ValueError("tool calling is not supported by this server; use 'none' or omit it")
        return v

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; give only one")
        return self

    def _max_new_tokens(self) -> int | None:
        # None: generate until a stop condition or the context length.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        """Messages for a chat template: content flattened to text, name kept when given."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


# ---------------------------------------------------------------------------------------------
# OpenAI responses

FinishReason = Literal["stop", "length", "abort"]


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None  # SGLang: the stop string or token id that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


# A streamed completion chunk's choice has the same fields, with text being the delta.
CompletionStreamChoice = CompletionChoice


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "lockstep"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Errors


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(
        error=ErrorDetail(message=message, type=kind, param=param, code=status)
    ).model_dump()


_MESSAGES: dict[str, str] = {
    "missing": "is required",
    "extra_forbidden": "unknown field (not supported by this server)",
    "finite_number": "must be a finite number",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be a boolean",
    "bool_parsing": "must be a boolean",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
}


def _num(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _describe(err: Mapping[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    bounds = {
        "greater_than_equal": ">=",
        "greater_than": ">",
        "less_than_equal": "<=",
        "less_than": "<",
    }
    if kind in bounds:
        return f"must be {bounds[kind]} {_num(next(iter(ctx.values())))}"
    if kind in ("too_short", "string_too_short"):
        n = ctx.get("min_length", 1)
        return "must not be empty" if n == 1 else f"must have at least {n} items"
    if kind in ("too_long", "string_too_long"):
        unit = "characters" if kind == "string_too_long" else "items"
        return f"must have at most {ctx.get('max_length')} {unit}"
    if kind == "literal_error":
        return f"must be {ctx.get('expected')}"
    if kind == "value_error" and "error" in ctx:
        return str(ctx["error"])
    return _MESSAGES.get(kind, err["msg"])


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _UNION_TAGS and "[" not in part:
            out += f".{part}" if out else part
    return out


def format_validation_error(exc: pydantic.ValidationError, max_errors: int = 5) -> str:
    """One sentence naming each bad field, e.g. "sampling_params.temperature: must be >= 0, got -1"."""
    parts = []
    errors = exc.errors(include_url=False)
    for err in errors[:max_errors]:
        text = _describe(err)
        value = err.get("input")
        if err["type"] not in ("missing", "extra_forbidden") and isinstance(
            value, (str, int, float)
        ):
            shown = (
                repr(value[:40] + "..." if len(value) > 40 else value)
                if isinstance(value, str)
                else str(value)
            )
            text += f", got {shown}"
        where = _where(tuple(err["loc"]))
        if not where and err["type"] in ("model_type", "dict_type"):
            where = "request body"
        parts.append(f"{where}: {text}" if where else text)
    if len(errors) > max_errors:
        parts.append(f"and {len(errors) - max_errors} more errors")
    return "; ".join(parts)
