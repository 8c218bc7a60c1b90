"""SGLang's /generate body (`GenerateReqInput`, also the offline Engine's arguments), validated,
and `fan_out`, which turns it (or an OpenAI request) into single requests of one prompt and one
sample each. Request models forbid unknown fields (a parameter silently ignored is a wrong answer
the client cannot see); a JSON null counts as "not given", as in OpenAI's API."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Mapping
from functools import partial
from typing import Annotated, Any, ClassVar, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from lockstep.entrypoints.sglang_fields import GENERATE, SAMPLING_PARAMS, Table, drop_off_fields
from lockstep.entrypoints.tokenizer_manager import RequestError
from lockstep.messages import SessionParams, TokenizedGenerateReq
from lockstep.sampling_params import NonEmptyStr, SamplingParams, TokenId, null_means_unset_schema


def json_kind(v: Any) -> str | None:
    """The JSON shape a union below is chosen by: "str", "list" or "dict" (an object, also as
    the model it validates to); None for anything else."""
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        return "list"
    return "dict" if isinstance(v, (Mapping, BaseModel, SamplingParams)) else None


def shaped(branches: dict[str, Any], expected: str,
           pick: Callable[[Any], str | None] = json_kind) -> Any:
    """A union chosen by the input's JSON shape, so that a bad value gets one error, not one per
    union member (a shape that is no branch's gets that error too)."""
    members = tuple(Annotated[t, Tag(tag)] for tag, t in branches.items())
    return Annotated[Union[members],  # noqa: UP007 - built from a tuple
                     Discriminator(pick, custom_error_type="invalid_shape",
                                   custom_error_message=f"must be {expected}")]


def _ids_shape(v: Any) -> str | None:
    if not isinstance(v, list):
        return None
    return "list[list]" if v and isinstance(v[0], list) else "list"


# The non-empty lists a prompt can be (here and in the OpenAI routes' models).
Texts = Annotated[list[str], Field(min_length=1)]
Ids = Annotated[list[TokenId], Field(min_length=1)]
IdLists = Annotated[list[Ids], Field(min_length=1)]
TextInput = shaped({"str": str, "list": Texts}, "a string or a non-empty list of strings")
IdsInput = shaped({"list": Ids, "list[list]": IdLists},
                  "a list of token ids or a list of lists of token ids", _ids_shape)
RidInput = shaped({"str": NonEmptyStr, "list": list[NonEmptyStr]}, "a string or a list of strings")

UNION_TAGS = frozenset({"str", "list", "dict", "bool", "list[str]", "list[int]", "list[list]"})


# SGLang's image_data: one image (a data URL or base64; an http(s) URL with --allow-image-urls)
# or a list; for a batch, one such entry per prompt.
Images = Annotated[list[str], Field(min_length=1)]
ImageDataInput = shaped({"str": str, "list": list[Union[str, Images]]},  # noqa: UP007
                        "a string or a list (of strings, or per prompt of a batch)")


LogprobFlag = shaped({"bool": bool, "list": list[bool]}, "a boolean or a list",
                     lambda v: "list" if isinstance(v, list) else "bool")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    # Fields for which null is a value of its own rather than "use the default".
    _null_means_something: ClassVar[frozenset[str]] = frozenset()
    # A request body's fields as SGLang defines them (lockstep.entrypoints.sglang_fields).
    _sglang_fields: ClassVar[Table] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        data = drop_off_fields(cls._sglang_fields, data)
        if isinstance(data, Mapping):
            keep = cls._null_means_something
            return {k: v for k, v in data.items() if v is not None or k in keep}
        return data

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        return null_means_unset_schema(core_schema, handler)


class SchedulingFields(StrictModel):
    """How a request is scheduled, on /generate and the OpenAI routes alike: its priority (with
    --enable-priority-scheduling, lockstep.managers.priority) and the data-parallel replica it
    must run on (SGLang's routed_dp_rank, or its older name data_parallel_rank)."""

    priority: int | None = None
    routed_dp_rank: int | None = Field(None, ge=0)
    data_parallel_rank: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one_replica(self) -> SchedulingFields:
        if None not in (self.routed_dp_rank, self.data_parallel_rank) and (
                self.routed_dp_rank != self.data_parallel_rank):
            raise ValueError("routed_dp_rank and data_parallel_rank name different replicas; "
                             "send one of them")
        return self

    def scheduling(self) -> dict[str, Any]:
        """The TokenizedGenerateReq fields these set (fan_out's keywords)."""
        dp = self.routed_dp_rank if self.routed_dp_rank is not None else self.data_parallel_rank
        return {"priority": self.priority, "routed_dp_rank": dp}


# SGLang's sampling params that lockstep does not serve are checked and dropped first.
_Sampling = Annotated[SamplingParams, BeforeValidator(partial(drop_off_fields, SAMPLING_PARAMS))]
SamplingParamsInput = shaped({"dict": _Sampling, "list": list[_Sampling]},
                             "an object or a list of objects")


class SessionParamsInput(StrictModel):
    """SGLang's session_params (lockstep.entrypoints.session_controller)."""

    id: NonEmptyStr
    rid: NonEmptyStr | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False


class GenerateReqInput(SchedulingFields):
    """Body of SGLang's native /generate."""

    _sglang_fields = GENERATE

    # What `_check_consistency` enforces first, stated for schema-driven clients.
    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]})

    text: TextInput | None = None
    input_ids: IdsInput | None = None
    sampling_params: SamplingParamsInput = Field(default_factory=SamplingParams)
    rid: RidInput | None = None
    stream: bool = False
    return_logprob: LogprobFlag = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    session_params: SessionParamsInput | None = None
    lora_path: shaped({"str": NonEmptyStr, "list": list[NonEmptyStr | None]},
                      "an adapter's name or a list of them") | None = None
    image_data: ImageDataInput | None = None

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or (self.input_ids is not None
                                               and isinstance(self.input_ids[0], list))

    @property
    def batch_size(self) -> int:
        prompts = self.text if self.text is not None else self.input_ids
        return len(prompts) if self.is_batch else 1  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _check_consistency(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        size = self.batch_size
        for name in ("sampling_params", "rid", "return_logprob", "lora_path"):
            value = getattr(self, name)
            if isinstance(value, list) and (not self.is_batch or len(value) != size):
                prompts = f"{size} prompts" if self.is_batch else "a single prompt"
                raise ValueError(f"{name}: a list must have one entry per prompt; got {len(value)} "
                                 f"for {prompts}")
        if self.session_params is not None and self.is_batch:
            raise ValueError("session_params: a session request has one prompt")
        if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
            raise ValueError("rid: the rids of a batch must be distinct")
        if self.image_data is not None:
            self._images_per_prompt()  # checks the shape against the prompts
        if self.top_logprobs_num and not any(_per_prompt(self.return_logprob, 1)):
            raise ValueError("top_logprobs_num: requires return_logprob to be true")
        return self

    def _images_per_prompt(self) -> list[list[str] | None]:
        data = self.image_data
        if data is None:
            return [None] * self.batch_size
        if not self.is_batch:
            if isinstance(data, list) and any(not isinstance(d, str) for d in data):
                raise ValueError("image_data: for a single prompt, a string or a list of strings")
            return [[data] if isinstance(data, str) else list(data)]
        if not isinstance(data, list) or len(data) != self.batch_size:
            raise ValueError(f"image_data: a batch of {self.batch_size} prompts needs a list with "
                             "one entry (an image or a list of images) per prompt")
        return [[d] if isinstance(d, str) else list(d) for d in data]

    def normalize(self, limit: int | None = None) -> list[TokenizedGenerateReq]:
        """The single requests this body fans out into (see fan_out)."""
        if self.text is not None:
            texts = self.text if isinstance(self.text, list) else [self.text]
            prompts: list[Prompt] = [(t, None) for t in texts]
        else:
            ids = self.input_ids if self.is_batch else [self.input_ids]
            prompts = [(None, p) for p in ids]  # type: ignore[union-attr]
        size = len(prompts)
        singles = fan_out(
            prompts, _per_prompt(self.sampling_params, size), limit=limit,
            rids=_per_prompt(self.rid, size) if self.rid is not None else None,
            return_logprob=_per_prompt(self.return_logprob, size), stream=self.stream,
            logprob_start_len=self.logprob_start_len, top_logprobs_num=self.top_logprobs_num,
            return_text_in_logprobs=self.return_text_in_logprobs, **self.scheduling(),
            session_params=(SessionParams(**self.session_params.model_dump())
                            if self.session_params is not None else None),
            image_data=self._images_per_prompt())
        return with_lora(singles, _per_prompt(self.lora_path, size))


Prompt = tuple[str | None, list[int] | None]  # (text, input_ids): one of them


def fan_out(prompts: list[Prompt], params: list[SamplingParams], *, limit: int | None = None,
            rids: list[str] | None = None, return_logprob: list[bool] | bool = False,
            image_data: list[list[str] | None] | None = None, **common: Any) -> list[TokenizedGenerateReq]:
    """One request per prompt and sample, prompt-major (rids `{rid}-{i}` for the samples); what
    /generate, the OpenAI routes and the Engine run. More than `limit` generations (prompts x n)
    is a RequestError before any request is built."""
    size = sum(p.n for p in params)
    if limit is not None and size > limit:
        raise RequestError(f"this request fans out into {size} generations (prompts x n); "
                           f"the limit is {limit} (--max-batch-size)")
    rids = rids if rids is not None else [uuid.uuid4().hex for _ in prompts]
    flags = return_logprob if isinstance(return_logprob, list) else [return_logprob] * len(prompts)
    images = image_data if image_data is not None else [None] * len(prompts)
    out = [TokenizedGenerateReq(rid if sp.n == 1 else f"{rid}-{i}", ids,
                                sp if sp.n == 1 else _nth_sample(sp, i), flag, input_text=text,
                                prompt_index=b, sample_index=i, image_data=im, **common)
           for b, ((text, ids), sp, rid, flag, im) in enumerate(zip(prompts, params, rids, flags, images))
           for i in range(sp.n)]
    if len({r.rid for r in out}) != len(out):
        raise RequestError("rid: the fanned-out rids collide; choose distinct rids")
    return out


def with_lora(singles: list[TokenizedGenerateReq], adapters: list[str | None]
              ) -> list[TokenizedGenerateReq]:
    """Each single request with its prompt's LoRA adapter (None: the base model)."""
    for r in singles:
        r.lora_path = adapters[r.prompt_index]
    return singles


def _per_prompt(value: Any, size: int) -> list[Any]:
    return list(value) if isinstance(value, list) else [value] * size


def _nth_sample(sp: SamplingParams, i: int) -> SamplingParams:
    """Sample i of n: n=1, and its own seed, or seeded samples would all be the same text."""
    out = copy.copy(sp)  # a validated object, copied as is (no second grammar check)
    out.n = 1
    if sp.seed is not None and i:
        out.seed = (sp.seed + i + 2**63) % 2**64 - 2**63  # stays within what manual_seed accepts
    return out
