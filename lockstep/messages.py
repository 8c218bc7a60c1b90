"""The wire messages between processes, grouped by direction, and the one serializer they all
go through. front -> scheduler: TokenizedGenerateReq, AbortReq, FlushCacheReq; a replica's input
rank -> its every rank (in the broadcast inputs): GrammarsReady; scheduler -> detokenizer:
BatchTokenIDOut (and FlushCacheOut, passed through); detokenizer -> front: BatchStrOut;
scheduler -> DP controller: LoadReport."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import zmq

from lockstep.core import FINISH_ABORT, BaseFinishReason, TokenLogprob
from lockstep.multimodal.refs import ImageRef
from lockstep.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReq:
    """One prompt, one sample: the front process's single request (its routes fan a batch and n
    out into these) and, once the tokenizer manager has filled in input_ids and resolved
    max_new_tokens, the message the scheduler gets."""

    rid: str
    input_ids: list[int] | None  # None until the tokenizer manager tokenizes input_text
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    input_text: str | None = None
    # The front process's own: logprob entries get their text; the sample's place in its request.
    return_text_in_logprobs: bool = False
    prompt_index: int = 0
    sample_index: int = 0
    # The client's images (data URLs, base64): the front's only. The tokenizer manager turns them
    # into `images` (content hash + shared-memory handle) before the request leaves it.
    image_data: list[str] | None = None
    images: list[ImageRef] = field(default_factory=list)


@dataclass
class AbortReq:
    """Stop a request and free its KV: a client gone, or the server shutting down (`reason` says
    why)."""

    rid: str
    reason: FINISH_ABORT = FINISH_ABORT()


@dataclass
class FlushCacheReq:
    pass


@dataclass
class GrammarsReady:
    """The input rank found these waiting requests' grammars compiled: every rank admits them at
    this point of this step (lockstep.managers.grammar_queue)."""

    rids: list[str]


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
    # What the detokenizer needs of the request: (skip_special_tokens, spaces_between_special_tokens).
    decode_options: tuple[bool, bool] = (True, True)
    # Stop strings (checked in the scheduler): how many characters of the output's text are final,
    # holding back what could still become a stop, or cut at the stop matched. None: all of it.
    text_limit: int | None = None
    # The detokenizer's: the text these tokens add.
    text_delta: str = ""
    # With speculative decoding: (verify passes, draft tokens, accepted draft tokens) so far.
    spec: tuple[int, int, int] | None = None
    # A model that reads images: its replica's vision tower runs and encoder-cache hits so far.
    encoder: tuple[int, int] | None = None


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


def zmq_socket(ctx: zmq.Context, kind: int, addr: str) -> zmq.Socket:
    """A PULL socket bound at `addr` (the one reader there), or a PUSH socket connected to it."""
    sock = ctx.socket(kind)
    (sock.bind if kind == zmq.PULL else sock.connect)(addr)
    return sock


def recv_all(sock: zmq.Socket) -> list[Any]:
    """Every message already queued on `sock`, decoded, without waiting for more."""
    msgs: list[Any] = []
    while True:
        try:
            msgs.append(decode(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return msgs
