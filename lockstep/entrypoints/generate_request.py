"""The request a generation starts from, validated: SGLang's /generate body (`GenerateReqInput`,
also the offline Engine's arguments), its sampling params, and the single requests
(`SingleGenerateReq`: one prompt, one sample) it fans out into, which the TokenizerManager runs.

Every request model forbids unknown fields: a parameter that is silently ignored is a wrong answer
the client cannot see. A JSON null counts as "not given", as in OpenAI's API. Constraints are
declared once, as types, so FastAPI's /openapi.json states them too.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    WithJsonSchema,
    model_validator,
)

from lockstep.constrained.constraint import (
    Constraint,
    ConstraintError,
    constraint_from_fields,
)

INT32_MAX = 2**31 - 1
_MAX_STOP_STRINGS = 16
MAX_N = 16

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# torch.Generator.manual_seed takes anything from int64's minimum to uint64's maximum.
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


def shaped(branches: dict[str, Any], pick: Callable[[Any], str | None], expected: str) -> Any:
    """A union chosen by the input's JSON shape, so that a bad value gets one error, not one per
    union member."""
    members = tuple(Annotated[t, Tag(tag)] for tag, t in branches.items())
    return Annotated[
        Union[members],  # noqa: UP007 - built from a tuple
        Discriminator(
            pick, custom_error_type="invalid_shape", custom_error_message=f"must be {expected}"
        ),
    ]


def str_or_list(v: Any) -> str | None:
    return "str" if isinstance(v, str) else "list" if isinstance(v, list) else None


def _ids_shape(v: Any) -> str | None:
    if not isinstance(v, list):
        return None
    return "list[list]" if v and isinstance(v[0], list) else "list"


def _object_or_list(v: Any) -> str | None:
    return (
        "list" if isinstance(v, list) else "dict" if isinstance(v, (Mapping, BaseModel)) else None
    )


def _bool_or_list(v: Any) -> str:
    return "list" if isinstance(v, list) else "bool"


TextInput = shaped(
    {"str": str, "list": Annotated[list[str], Field(min_length=1)]},
    str_or_list,
    "a string or a non-empty list of strings",
)
IdsInput = shaped(
    {
        "list": Annotated[list[TokenId], Field(min_length=1)],
        "list[list]": Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)
        ],
    },
    _ids_shape,
    "a list of token ids or a list of lists of token ids",
)
RidInput = shaped(
    {"str": NonEmptyStr, "list": list[NonEmptyStr]}, str_or_list, "a string or a list of strings"
)

UNION_TAGS = frozenset({"str", "list", "dict", "bool", "list[str]", "list[int]", "list[list]"})


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


LogprobFlag = shaped({"bool": bool, "list": list[bool]}, _bool_or_list, "a boolean or a list")
# One string or a list: what _stop_to_list accepts, published as such.
_STOP_SCHEMA = WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": _MAX_STOP_STRINGS},
]})
StopList = Annotated[
    list[NonEmptyStr], Field(max_length=_MAX_STOP_STRINGS), BeforeValidator(_stop_to_list),
    _STOP_SCHEMA,
]
TopK = Annotated[int, AfterValidator(_check_top_k)]
StopRegexList = StopList  # each pattern is compiled (RE2) where it runs: the scheduler


def _not_served(why: str) -> Any:
    """A field SGLang defines that this server does not serve: refused by name, never ignored."""
    def check(v: Any) -> Any:
        if v is not None:
            raise ValueError(f"is not supported by this server ({why}); omit it")
        return v
    return Annotated[Any, AfterValidator(check)]


class StrictModel(BaseModel):
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

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        """The published schema says what `_null_is_unset` does: null is accepted for every
        optional field (a schema fuzzer found `"echo": null` accepted where it said boolean)."""
        schema = handler.resolve_ref_schema(handler(core_schema))
        required = set(schema.get("required", ()))
        props = schema.get("properties", {})
        for name, prop in props.items():
            options = prop.get("anyOf", [prop])
            if name not in required and not any(o.get("type") == "null" for o in options):
                outer = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
                props[name] = {"anyOf": [prop, {"type": "null"}], **outer}
        return schema


class SamplingParamsModel(StrictModel):
    _null_means_something = frozenset({"max_new_tokens"})

    max_new_tokens: int | None = Field(128, ge=0, le=INT32_MAX)  # None: until the context is full
    min_new_tokens: int = Field(0, ge=0, le=INT32_MAX)
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
    n: int = Field(1, ge=1, le=MAX_N)
    seed: Seed | None = None
    sampling_seed: Seed | None = None  # SGLang 0.5's name for seed
    no_stop_trim: bool = False
    # Structured output (lockstep.constrained): at most one of regex, json_schema (a JSON
    # string), ebnf (GBNF); each is compiled here, so a bad one is a 400 before dispatch.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    stop_regex: StopRegexList = Field(default_factory=list)
    structural_tag: _not_served("structural tags") = None
    custom_params: _not_served("no custom logit processors") = None
    logit_bias: _not_served("no logit bias") = None
    stream_interval: _not_served("every token is streamed") = None

    _constraint: Constraint | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_min_tokens(self) -> SamplingParamsModel:
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if (self.sampling_seed is not None and self.seed is not None
                and self.sampling_seed != self.seed):
            raise ValueError(f"seed ({self.seed}) and sampling_seed ({self.sampling_seed}) differ")
        if self.sampling_seed is not None:  # one name from here on (n > 1 derives per-sample seeds)
            self.seed, self.sampling_seed = self.sampling_seed, None
        try:
            self._constraint = constraint_from_fields(self.regex, self.json_schema, self.ebnf)
        except ConstraintError as e:
            raise ValueError(str(e)) from None
        return self

    @property
    def constraint(self) -> Constraint | None:
        return self._constraint

    def engine_fields(self) -> dict[str, Any]:
        """The fields as lockstep's SamplingParams names them (all but n and max_new_tokens)."""
        fields = self.model_dump(exclude={
            "n", "max_new_tokens", "sampling_seed", "regex", "json_schema", "ebnf",
            "structural_tag", "custom_params", "logit_bias", "stream_interval"})
        fields["constraint"] = self._constraint
        return fields


SamplingParamsInput = shaped(
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


class GenerateReqInput(StrictModel):
    """Body of SGLang's native /generate."""

    # What `_check_consistency` enforces first, stated for schema-driven clients.
    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]}
    )

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
