"""The shapes every stage shares: a token's logprob, the finish reasons, the sampling parameters
(one type from the HTTP edge to the sampler) and the forward batch the model worker runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any, ClassVar, NamedTuple

import torch
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


class TokenLogprob(NamedTuple):
    logprob: float | None  # None for a prompt's first token, which nothing predicts
    token_id: int
    text: str | None = None  # filled in by the tokenizer manager when the client asks for text


# ---- finish reasons (SGLang's FINISH_* classes); `to_json()` only at the HTTP/Engine edge


@dataclass(frozen=True)
class BaseFinishReason:
    type: ClassVar[str]  # OpenAI's finish_reason: "stop", "length" or "abort"

    def to_json(self) -> dict[str, Any]:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return {"type": self.type, **fields}


@dataclass(frozen=True)
class FINISH_MATCHED_TOKEN(BaseFinishReason):  # noqa: N801 - SGLang's names
    matched: int  # a stop token id or an end-of-sequence token
    type: ClassVar[str] = "stop"


@dataclass(frozen=True)
class FINISH_MATCHED_STR(BaseFinishReason):  # noqa: N801
    matched: str  # a stop string or stop_regex pattern (the scheduler's stop_checker finds those)
    type: ClassVar[str] = "stop"


@dataclass(frozen=True)
class FINISH_LENGTH(BaseFinishReason):  # noqa: N801
    length: int
    type: ClassVar[str] = "length"


@dataclass(frozen=True)
class FINISH_ABORT(BaseFinishReason):  # noqa: N801
    """By the client, the server shutting down, or a request that can never run: then
    `status_code` is the HTTP status the client gets."""

    message: str = "aborted"
    status_code: int | None = None
    type: ClassVar[str] = "abort"


# ---- sampling parameters: a pydantic dataclass, so every bound is declared once, as a type
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


# ---- the forward batch: flat tokens of the whole batch plus a per-request descriptor


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill, prefill chunk or extend-from-prefix
    DECODE = "decode"  # one new token per request
    MIXED = "mixed"  # prefill chunks and decodes in one batch


@dataclass
class AttentionMetadata:
    """Built once per forward and shared by every layer: where each query row's keys live."""

    # CPU: every request's KV slots back to back, unpadded, and per query row [T] the first of its
    # request's keys in kv_flat and how many it sees (its position + 1). Each row runs alone in the
    # decode kernel, so its numbers never depend on how many rows its request extends by (a
    # prefix-cache hit, a prefill chunk, a speculative verify pass) or on its neighbours.
    kv_flat: torch.Tensor | None = None
    row_kv_starts: torch.Tensor | None = None
    row_kv_lens: torch.Tensor | None = None
    # GPU: one masked SDPA over the padded [B, Q, L] grid: KV slots per request padded with the
    # scratch slot 0, flat token -> row of the [B * Q] query grid, one mask per sliding window.
    kv_indices: torch.Tensor | None = None
    q_scatter: torch.Tensor | None = None
    max_q: int = 1
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot each new token writes
    req_pool_indices: torch.Tensor  # [B]
    prefix_lens: torch.Tensor  # [B] tokens already in KV before this pass
    extend_lens: torch.Tensor  # [B] new tokens in this pass
    logits_indices: torch.Tensor  # [S] flat positions whose logits are computed
    attn: AttentionMetadata | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.numel())

    def build_attention(self, req_to_token: torch.Tensor, windows: set[int | None]) -> None:
        b = self.batch_size
        ext, pre = self.extend_lens, self.prefix_lens
        seq = pre + ext
        max_q, max_l = int(ext.max()), int(seq.max())
        device = self.input_ids.device
        kv = req_to_token[self.req_pool_indices, :max_l]
        if device.type == "cpu":
            self.attn = _cpu_row_metadata(kv, ext, pre, seq, max_l)
            return
        q_idx = torch.arange(max_q, device=device)
        k_idx = torch.arange(max_l, device=device)
        starts = torch.cumsum(ext, 0) - ext
        row_of_token = torch.repeat_interleave(torch.arange(b, device=device), ext)
        col_of_token = torch.arange(ext.sum(), device=device) - starts[row_of_token]
        q_pos = pre[:, None] + q_idx[None, :]  # [B, Q] absolute position of each query
        dist = q_pos[:, :, None] - k_idx[None, None, :]  # [B, Q, L]
        base = (dist >= 0) & (k_idx[None, None, :] < seq[:, None, None])
        padded_q = q_idx[None, :] >= ext[:, None]  # [B, Q]
        masks = {}
        for w in windows:
            m = base if w is None else base & (dist < w)
            # Padding queries see key 0 only, so softmax never divides by zero; they are dropped.
            m = m | (padded_q[:, :, None] & (k_idx == 0)[None, None, :])
            masks[w] = m.unsqueeze(1)
        kv = torch.where(k_idx[None, :] < seq[:, None], kv, 0)
        self.attn = AttentionMetadata(kv_indices=kv, q_scatter=row_of_token * max_q + col_of_token,
                                      max_q=max_q, masks=masks)


def _cpu_row_metadata(kv: torch.Tensor, ext: torch.Tensor, pre: torch.Tensor, seq: torch.Tensor,
                      max_l: int) -> AttentionMetadata:
    """No masks and no padded grid on a CPU (building masks was a third of a decode step's set-up)."""
    device = kv.device
    kv_flat = kv[torch.arange(max_l, device=device)[None, :] < seq[:, None]]
    k_starts = torch.cumsum(seq, 0) - seq
    if int(ext.max()) == 1:  # a batch of decodes: one row per request, the common step kept cheap
        return AttentionMetadata(kv_flat, k_starts, seq)
    row_of_token = torch.repeat_interleave(torch.arange(seq.numel(), device=device), ext)
    col_of_token = torch.arange(int(ext.sum()), device=device) - (torch.cumsum(ext, 0) - ext)[row_of_token]
    return AttentionMetadata(kv_flat, k_starts[row_of_token], pre[row_of_token] + col_of_token + 1)


def micro_batch_ranges(extend_lens: list[int], n: int) -> list[tuple[int, int]]:
    """Cut requests [0, B) into up to n contiguous [start, end) ranges of about equal token counts
    (decode: request counts), each with a request: equal work keeps every stage equally busy."""
    b = len(extend_lens)
    n = max(1, min(n, b))
    total = sum(extend_lens)
    cuts = [0]
    acc = 0
    for i in range(b - 1):
        acc += extend_lens[i]
        made = len(cuts) - 1  # cuts so far
        if made == n - 1:
            break
        left_after = b - (i + 1)  # requests after a cut here
        parts_after = n - (made + 1)  # ranges that still need a request after a cut here
        # Cut once this range reached its share of tokens, or when waiting longer would leave
        # some later range without a request.
        if acc * n >= total * (made + 1) or left_after == parts_after:
            cuts.append(i + 1)
    return list(zip(cuts, cuts[1:] + [b]))


def split_forward_batch(fb: ForwardBatch, n: int) -> list[ForwardBatch]:
    """Contiguous micro-batches of `fb` for pipeline stages to work on at once (attention metadata
    left to build_attention). Tokens and logits_indices run request after request, so each
    range's tokens follow from extend_lens and its logits rows are one consecutive run of fb's,
    renumbered from 0: concatenated in order, they are exactly fb's."""
    ext = fb.extend_lens.tolist()
    ranges = micro_batch_ranges(ext, n)
    if len(ranges) == 1:
        return [fb]
    li, parts = fb.logits_indices, []
    for start, end in ranges:
        t0, t1 = sum(ext[:start]), sum(ext[:end])
        parts.append(ForwardBatch(
            mode=fb.mode, input_ids=fb.input_ids[t0:t1], positions=fb.positions[t0:t1],
            out_cache_loc=fb.out_cache_loc[t0:t1], req_pool_indices=fb.req_pool_indices[start:end],
            prefix_lens=fb.prefix_lens[start:end], extend_lens=fb.extend_lens[start:end],
            logits_indices=li[(li >= t0) & (li < t1)] - t0))
    return parts
