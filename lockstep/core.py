"""The shapes every stage shares, with no dependency at all: a token's logprob and the finish
reasons. The wire-facing sampling parameters live in lockstep.sampling_params (pydantic), the
model-facing forward batch in lockstep.forward_batch (torch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple


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
