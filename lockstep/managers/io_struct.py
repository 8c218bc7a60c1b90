"""Typed messages between processes, and the one serializer they all go through."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any


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
    rid: str
    # Set when the abort is really a finish the front process detected (a stop string).
    finish_reason: dict[str, Any] | None = None


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
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    dp_rank: int = 0  # which data-parallel replica served it
    # The detokenizer needs the stop strings and special-token settings.
    sampling_params: SamplingParams | None = None
    # Filled in by the detokenizer.
    text_delta: str = ""
    # True when the detokenizer, not the scheduler, finished it (a stop string matched): the
    # tokenizer manager then tells the scheduler to stop the request and free its KV.
    finished_by_detokenizer: bool = False


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
