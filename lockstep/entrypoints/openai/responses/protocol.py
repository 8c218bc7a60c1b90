"""The Responses API's request and reply shapes, as the `openai` client 3.63.0 defines them
(openai/types/responses/: response_create_params.py, response.py, response_usage.py and the
item and event types). The request forbids unknown fields; OpenAI's fields lockstep does not
serve are in OFF_FIELDS, refused (400, naming the field) unless they ask for nothing."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from lockstep.constrained.constraint import SchemaObject
from lockstep.entrypoints.generate_request import StrictModel, shaped
from lockstep.entrypoints.sglang_fields import Table, _off
from lockstep.sampling_params import (
    MinP,
    NewTokens,
    NonEmptyStr,
    Penalty,
    RepetitionPenalty,
    StopList,
    Temperature,
    TopK,
    TopP,
)

# OpenAI's request fields lockstep does not serve: each may be omitted or sent as the value that
# asks for nothing (what clients send by default); anything else is a 400 naming it.
OFF_FIELDS: Table = {
    **_off("no background responses", "background", False),
    **_off("no service tiers", "service_tier", "auto", "default"),
    **_off("no logprobs in responses (use /v1/chat/completions)", "top_logprobs", 0),
    **_off("no limit on built-in tool calls (no built-in tools)", "max_tool_calls"),
    **_off("no conversations objects; use previous_response_id", "conversation"),
    **_off("no stored prompt templates", "prompt"),
    **_off("no stream options", "stream_options"),
    **_off("no per-request cache keys or retention (the prefix cache is automatic)",
           "prompt_cache_key prompt_cache_retention"),
    **_off("no context management", "context_management"),
}


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):  # an assistant message handed back
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


MessagePart = shaped({"input_text": InputText, "output_text": OutputText},
                     "an input_text or output_text part (text-only: no images, files or audio)",
                     lambda v: v.get("type") if isinstance(v, dict) else None)


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: shaped({"str": str, "list": list[MessagePart]}, "a string or a list of parts")
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    id: str | None = None
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str  # JSON text of an object
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: NonEmptyStr
    output: shaped({"str": str, "list": list[InputText]}, "a string or a list of input_text parts")
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class SummaryText(StrictModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(StrictModel):
    """A reasoning item handed back: accepted, and left out of the prompt as chat templates
    leave out the thinking of earlier turns."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = shaped(
    {"message": MessageItem, "function_call": FunctionCallItem,
     "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem},
    "a message, function_call, function_call_output or reasoning item (lockstep serves no "
    "built-in tools, item references or non-text inputs)",
    lambda v: v.get("type", "message") if isinstance(v, dict) else None)


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: SchemaObject | None = None
    # Enforced (the grammar closes the schema) when the call is forced: tool_choice "required"
    # or a named function; under "auto" the reply is parsed, as on /v1/chat/completions.
    strict: bool | None = None


Tool = shaped({"function": FunctionTool},
              "a function tool (lockstep serves no built-in, MCP or custom tools)",
              lambda v: v.get("type") if isinstance(v, dict) else None)


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: NonEmptyStr


ToolChoice = shaped(
    {"str": Literal["none", "auto", "required"], "dict": NamedFunctionChoice},
    "'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema_: SchemaObject = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # always enforced


TextFormat = shaped(
    {"text": TextFormatText, "json_object": TextFormatJsonObject,
     "json_schema": TextFormatJsonSchema},
    "a format of type text, json_object or json_schema",
    lambda v: v.get("type") if isinstance(v, dict) else None)


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the model's own; no other level


class ReasoningConfig(StrictModel):
    # Handed to the chat template as `reasoning_effort` (templates that read it, e.g.
    # gpt-oss's, act on it); the reasoning parser (--reasoning-parser) splits the block off.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: None = None  # no summaries: the reasoning item carries the reasoning text
    generate_summary: None = None


class ResponsesRequest(StrictModel):
    _sglang_fields = OFF_FIELDS

    model: str | None = None
    input: shaped({"str": str, "list": list[InputItem]}, "a string or a list of items")
    instructions: str | None = None
    max_output_tokens: NewTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]
                   ] | None = Field(None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: NonEmptyStr | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping old items) is not served
    include: list[str] = Field(default_factory=list)
    # SGLang's sampling extensions, as on /v1/chat/completions.
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    stop: StopList = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input: give at least one item")
        if self.include:  # logprobs, encrypted reasoning, built-in tools' results
            raise ValueError(f"include: {', '.join(self.include)}: not served by lockstep "
                             "(no extra output data); omit it or send []")
        return self


# ---------------------------------------------------------------------------------------------
# The reply (openai.types.responses.Response and its parts)

Status = Literal["completed", "incomplete", "in_progress", "failed"]


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputTextPart]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[dict[str, Any]]  # [{"type": "reasoning_text", "text": ...}]
    status: Status


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # input tokens served from the prefix cache
    cache_write_tokens: int = 0  # the prefix cache is automatic: nothing is written on request


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float
    completed_at: float | None = None
    model: str
    status: Status
    output: list[OutputItem] = Field(default_factory=list)
    output_text: str = ""  # the client SDK's convenience property, sent as other servers do
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True

