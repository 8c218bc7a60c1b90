"""Typed messages between processes, and the one serializer they all go through."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from lockstep.constrained import Constraint


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
    matched: str  # a stop string (the detokenizer finds those)
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


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    # Generation stops when the output text matches one of these (Python `re`, searched).
    stop_regex: list[str] = field(default_factory=list)
    # At most one; checked in the front process (lockstep.constrained.validate_constraint).
    constraint: Constraint | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    input_text: str | None = None


@dataclass
class AbortReq:
    """Stop a request and free its KV: a client gone, a stop string the detokenizer matched (the
    client already has its finish), or the server shutting down (`reason` says why)."""

    rid: str
    reason: FINISH_ABORT = FINISH_ABORT()


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheOut:
    success: bool
    message: str = ""


@dataclass
class ReqOutput:
    """One request's progress since the last message: new tokens, and the finish if any."""

    rid: str
    new_token_ids: list[int]
    finish_reason: BaseFinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    input_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    dp_rank: int = 0  # which data-parallel replica served it
    # The detokenizer needs the stop strings and special-token settings (first output only).
    sampling_params: SamplingParams | None = None
    # The detokenizer's: the text these tokens add (a stop string it matched sets the finish).
    text_delta: str = ""


@dataclass
class BatchTokenIDOut:
    outputs: list[ReqOutput]


@dataclass
class BatchStrOut:
    outputs: list[ReqOutput]


@dataclass
class LoadReport:
    """Sent by a replica's scheduler to the DP controller."""

    dp_rank: int
    running: int
    queued: int
    tokens_in_use: int


def encode(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    return pickle.loads(data)
