"""Request and response models of OpenAI's API. Request models forbid unknown fields and declare
their constraints as types, so FastAPI validates them and /openapi.json states them; SGLang's
fields that lockstep does not serve are in lockstep.entrypoints.sglang_fields."""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from lockstep.constrained.constraint import SchemaObject, json_schema_constraint
from lockstep.entrypoints.generate_request import (
    IdLists,
    Ids,
    SchedulingFields,
    StrictModel,
    Texts,
    shaped,
)
from lockstep.entrypoints.sglang_fields import CHAT, COMPLETIONS
from lockstep.entrypoints.tokenizer_manager import RequestError
from lockstep.sampling_params import (
    LogitBias,
    MinP,
    NewTokens,
    NonEmptyStr,
    Penalty,
    RepetitionPenalty,
    SampleCount,
    SamplingParams,
    Seed,
    StopList,
    StopRegexList,
    Temperature,
    TokenId,
    TopK,
    TopP,
)


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


PromptInput = shaped(
    {"str": str, "list[str]": Texts, "list[int]": Ids, "list[list]": IdLists},
    "a string, a list of strings, a list of token ids or a list of lists of token ids",
    _prompt_shape,
)


class StreamOptions(StrictModel):
    include_usage: bool = False


class TextResponseFormat(StrictModel):
    type: Literal["text"]


class JsonObjectResponseFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaSpec(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # "schema" would shadow a BaseModel attribute; clients send it under that name.
    schema_: SchemaObject | None = Field(None, alias="schema")
    # The schema is always enforced: strict false (best effort) gets the same guarantee.
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_required(self) -> JsonSchemaSpec:
        if self.schema_ is None:  # SGLang 0.5 refuses it too; it used to mean any object here
            raise ValueError("schema is required for json_schema response format request")
        return self


class JsonSchemaResponseFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    Union[TextResponseFormat, JsonObjectResponseFormat, JsonSchemaResponseFormat],  # noqa: UP007
    Field(discriminator="type"),
]


class _OpenAIRequest(SchedulingFields):
    model: str | None = None  # also a LoRA adapter: "base:adapter" or the adapter's name
    lora_path: str | None = None  # SGLang's other way to name the adapter
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: SampleCount = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopList = Field(default_factory=list)
    seed: Seed | None = None
    user: str | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    logit_bias: LogitBias = Field(default_factory=dict)
    # SGLang's extensions of the OpenAI API.
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_tokens: NewTokens = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    no_stop_trim: bool = False
    stop_regex: StopRegexList = Field(default_factory=list)
    # Structured output: OpenAI's response_format, or SGLang's regex / ebnf extensions.
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None

    _sampling_params: SamplingParams = PrivateAttr()

    def _json_schema(self) -> str | None:
        """The JSON schema constraint's text, from response_format."""
        fmt = self.response_format
        if isinstance(fmt, JsonObjectResponseFormat):
            return json_schema_constraint({"type": "object"}).text  # any JSON object
        if isinstance(fmt, JsonSchemaResponseFormat):
            return json_schema_constraint(fmt.json_schema.schema_).text
        return None

    @model_validator(mode="after")
    def _check_common(self) -> _OpenAIRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        limit = self._max_new_tokens()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({limit})")
        # The sampling params, built once: the fields both name alike, and OpenAI's lengths.
        shared = {f: getattr(self, f) for f in type(self).model_fields
                  if f in SamplingParams.__dataclass_fields__}
        try:
            self._sampling_params = SamplingParams(**{
                **shared, "json_schema": self._json_schema(),
                "max_new_tokens": self._max_new_tokens(), "min_new_tokens": self.min_tokens})
        except ValidationError as e:  # what only the whole can get wrong: the constraint
            raise ValueError("; ".join(str(err.get("ctx", {}).get("error", err["msg"]))
                                       for err in e.errors())
                             .replace("json_schema", "response_format.json_schema")
                             .replace("Only one of regex, response_format.json_schema, or ebnf",
                                      "Only one of regex, response_format, or ebnf")) from None
        return self

    def _max_new_tokens(self) -> int | None:
        raise NotImplementedError

    def to_sampling_params(self, json_schema: str | None = None) -> SamplingParams:
        """`json_schema`: a constraint the route adds (a forced tool call); RequestError (400)
        when the request has its own constraint too."""
        if json_schema is None:
            return self._sampling_params
        if self._sampling_params.constraint is not None:
            raise RequestError("a forced tool call cannot be combined with response_format, "
                               "regex or ebnf: only one constraint applies to an output")
        return dataclasses.replace(self._sampling_params, json_schema=json_schema)


class CompletionRequest(_OpenAIRequest):
    _sglang_fields = COMPLETIONS
    prompt: PromptInput
    max_tokens: NewTokens = 16
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    json_schema: str | None = None  # SGLang's: a JSON schema (text) the output must match

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}): only best_of equal to n ({self.n}) "
                             "is supported")
        return self

    def _max_new_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[tuple[str | None, list[int] | None]]:  # (text, ids) per prompt
        p = self.prompt
        many = p if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]
        return [(x, None) if isinstance(x, str) else (None, x) for x in many]

    def _json_schema(self) -> str | None:
        if self.json_schema is not None and self.response_format is not None:
            raise ValueError("json_schema: give it or response_format, not both")
        return self.json_schema if self.json_schema is not None else super()._json_schema()


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageUrl(StrictModel):
    url: str  # a data URL (or bare base64); an http(s) URL where --allow-image-urls
    detail: Literal["auto"] | None = None  # one resolution: the model's own


class ImageUrlPart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageUrl


# Parts are told apart by their "type".
ContentPart = Annotated[Union[TextPart, ImageUrlPart], Field(discriminator="type")]  # noqa: UP007
ContentInput = shaped({"str": str, "list": list[ContentPart]},
                      "a string or a list of content parts")


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule
    description: str | None = None
    # A JSON Schema for the arguments object (checked as one in lockstep.entrypoints.openai.tool_calls).
    parameters: SchemaObject | None = None
    # Strict schemas are not enforced under "auto"; "required" or a named function forces them.
    strict: Literal[False] | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: NonEmptyStr


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = shaped(
    {"str": Literal["none", "auto", "required"], "dict": NamedToolChoice},
    '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
)


class CalledFunction(StrictModel):
    name: NonEmptyStr
    arguments: str  # JSON text of an object, as OpenAI sends it


class MessageToolCall(StrictModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: ContentInput | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a {self.role} message")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message makes tool calls")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message needs one, and only a tool message")
        return self

    def text(self, image_placeholder: str = "") -> str:
        """The content as text, each image part written as `image_placeholder` (the model's
        marker of where an image goes)."""
        if isinstance(self.content, list):
            return "".join(p.text if isinstance(p, TextPart) else image_placeholder for p in self.content)
        return self.content or ""

    def parts(self) -> list[dict[str, str]]:
        """The content as typed parts, an image as {"type": "image"}: for a chat template that
        iterates them (SmolVLM's), which writes the image's placeholder itself."""
        if isinstance(self.content, list):
            return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                    for p in self.content]
        return [{"type": "text", "text": self.content}] if self.content else []


class ChatCompletionRequest(_OpenAIRequest):
    _sglang_fields = CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: NewTokens | None = None
    max_completion_tokens: NewTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Checked together, against the server's tool-call parser, in lockstep.entrypoints.openai.tool_calls.
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Handed to the chat template as variables (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's: split the thinking block into reasoning_content (with --reasoning-parser), and
    # stream it delta by delta rather than in one piece when the block ends.
    separate_reasoning: bool = True
    stream_reasoning: bool = True

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
        limit = self.max_completion_tokens
        return limit if limit is not None else self.max_tokens

    def messages_as_dicts(self, image_placeholder: str = "", parts: bool = False) -> list[dict[str, Any]]:
        """Messages for a chat template: content flattened to text (images as the model's
        placeholder), or as typed parts for a template that reads only those; the other fields
        kept when given."""
        return [{**m.model_dump(exclude_none=True, include={"name", "tool_calls", "tool_call_id"}),
                 "role": m.role, "content": m.parts() if parts else m.text(image_placeholder)}
                for m in self.messages]

    def image_urls(self) -> list[str]:
        """Every image_url part's URL, in message and part order (the prompt's image order)."""
        return [p.image_url.url for m in self.messages if isinstance(m.content, list)
                for p in m.content if isinstance(p, ImageUrlPart)]


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class _Choice(BaseModel):
    index: int
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None  # SGLang: the stop string or token id that ended it


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionChoice(_Choice):  # also a stream chunk's, with text being the delta
    text: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(CompletionResponse):
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(_Choice):
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # on a call's first delta only
    arguments: str = ""


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None  # id and type come with the call's first delta
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(ChatResponseMessage):  # a stream's piece of the message: the fields it sets
    role: Literal["assistant"] | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(_Choice):
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "lockstep"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class AbortRequestInput(StrictModel):
    """Body of /abort_request: one request by its rid, or every running one."""

    rid: NonEmptyStr | None = None
    abort_all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortRequestInput:
        if not self.abort_all and self.rid is None:
            raise ValueError('rid: give the request id to abort (or send {"abort_all": true})')
        return self
