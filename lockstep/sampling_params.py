"""SamplingParams: the wire-facing sampling parameters, one type from the HTTP edge to the sampler,
with every bound declared once as a pydantic type (/openapi.json states it). The model layer
never imports this module: what it needs of a request reaches it as tensors
(lockstep.layers.sampler.SamplingBatchInfo, lockstep.forward_batch.ForwardBatch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    WithJsonSchema,
    model_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic_core import ArgsKwargs

from lockstep.constrained.constraint import (
    Constraint,
    ConstraintError,
    constraint_from_fields,
    validate_constraint,
)

# (/openapi.json states it). Fields are strict (no "1" for 1); the class accepts a dict.

INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 16
# The scheduler looks for each stop (and the start of one) in every new piece of text: its length
# bounds that work per token. 16k-character stops cost ~length^2 character compares per token.
MAX_STOP_CHARS = 1024
MAX_N = 16
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value


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


def _check_bias_keys(bias: dict[str, float]) -> dict[str, float]:
    for key in bias:
        if not key.isdigit() or int(key) > INT32_MAX:
            raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
    return bias


TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
# torch.Generator.manual_seed takes anything from int64's minimum to uint64's maximum.
Seed = Annotated[StrictInt, Field(ge=-(2**63), le=2**64 - 1)]
NewTokens = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
Temperature = Annotated[StrictFloat, Field(ge=0)]
TopP = Annotated[StrictFloat, Field(gt=0, le=1)]
TopK = Annotated[StrictInt, AfterValidator(_check_top_k)]
MinP = Annotated[StrictFloat, Field(ge=0, le=1)]
Penalty = Annotated[StrictFloat, Field(ge=-2, le=2)]
RepetitionPenalty = Annotated[StrictFloat, Field(gt=0)]
SampleCount = Annotated[StrictInt, Field(ge=1, le=MAX_N)]
# One string or a list: what _stop_to_list accepts, published as such.
_STOP_ITEM = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
_STOP_SCHEMA = WithJsonSchema({"anyOf": [
    _STOP_ITEM, {"type": "array", "items": _STOP_ITEM, "maxItems": MAX_STOP_STRINGS}]})
StopStr = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopStr], Field(max_length=MAX_STOP_STRINGS),
                     BeforeValidator(_stop_to_list), _STOP_SCHEMA]
StopRegexList = StopList  # each pattern is compiled (RE2) where it runs: the scheduler
# OpenAI's shape: token id (a decimal string) -> a bias added to that token's logit.
LogitBias = Annotated[
    dict[StrictStr, Annotated[StrictFloat, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    AfterValidator(_check_bias_keys)]


def null_means_unset_schema(core_schema: Any, handler: Any) -> dict[str, Any]:
    """A request model's published schema says what its validator does: null is accepted for
    every optional field (a schema fuzzer found `"echo": null` accepted where it said boolean)."""
    schema = handler.resolve_ref_schema(handler(core_schema))
    required = set(schema.get("required", ()))
    props = schema.get("properties", {})
    for name, prop in props.items():
        options = prop.get("anyOf", [prop])
        if name not in required and not any(o.get("type") == "null" for o in options):
            outer = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
            props[name] = {"anyOf": [prop, {"type": "null"}], **outer}
    return schema


@pydantic_dataclass(config=ConfigDict(extra="forbid", allow_inf_nan=False))
class SamplingParams:
    """SGLang's sampling params (those lockstep serves; lockstep.entrypoints.sglang_fields says
    what happens to the others). A JSON null counts as "not given", as in OpenAI's API, except
    for max_new_tokens, where null means "until the context is full"; the tokenizer manager
    turns that into a number before the request leaves the front process."""

    max_new_tokens: NewTokens | None = 128
    min_new_tokens: NewTokens = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: StopList = field(default_factory=list)
    stop_token_ids: list[TokenId] = field(default_factory=list)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    n: SampleCount = 1  # fanned out into n requests of n=1 before the scheduler sees them
    seed: Seed | None = None
    sampling_seed: Seed | None = None  # SGLang 0.5's name for seed; folded into seed
    # Generation stops when the output text matches one of these (RE2, managers/stop_checker.py).
    stop_regex: StopRegexList = field(default_factory=list)
    # Structured output (lockstep.constrained): at most one of regex, json_schema (a JSON
    # string), ebnf (GBNF); checked here, so a bad one is a 400 before dispatch.
    regex: StrictStr | None = None
    json_schema: StrictStr | None = None
    ebnf: StrictStr | None = None
    logit_bias: LogitBias = field(default_factory=dict)

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        return null_means_unset_schema(core_schema, handler)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        keep = lambda k, v: v is not None or k == "max_new_tokens"  # noqa: E731
        if isinstance(data, ArgsKwargs):
            return ArgsKwargs(data.args, {k: v for k, v in (data.kwargs or {}).items() if keep(k, v)})
        if isinstance(data, Mapping):
            return {k: v for k, v in data.items() if keep(k, v)}
        return data

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                             f"({self.max_new_tokens})")
        if self.sampling_seed is not None:
            if self.seed is not None and self.sampling_seed != self.seed:
                raise ValueError(f"seed ({self.seed}) and sampling_seed ({self.sampling_seed}) differ")
            self.seed, self.sampling_seed = self.sampling_seed, None  # one name from here on
        try:
            if (c := self.constraint) is not None:
                validate_constraint(c)
        except ConstraintError as e:
            raise ValueError(str(e)) from None
        return self

    @property
    def constraint(self) -> Constraint | None:
        return constraint_from_fields(self.regex, self.json_schema, self.ebnf)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1
