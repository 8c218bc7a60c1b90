"""The wire messages between processes, grouped by direction, and the one serializer they all
go through. front -> scheduler: TokenizedGenerateReq, AbortReq, FlushCacheReq,
LoadLoraAdapterReq, UnloadLoraAdapterReq (answered by LoraUpdateOut) (and, to the DP
controller only, ReplicaChange); a replica's input
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


@dataclass(frozen=True)
class SessionParams:
    """SGLang's session_params: the request continues request `rid` of session `id`
    (lockstep.entrypoints.session_controller, in the front process)."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False


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
    priority: int | None = None  # SGLang's; None: the server's default
    routed_dp_rank: int | None = None  # SGLang's: the data-parallel replica that must serve it
    # The front process's own: logprob entries get their text; the sample's place in its request.
    return_text_in_logprobs: bool = False
    prompt_index: int = 0
    sample_index: int = 0
    session_params: SessionParams | None = None
    lora_path: str | None = None  # the LoRA adapter's name (SGLang's field name); None: the base
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
class ReplicaChange:
    """front -> DP controller, for replicas added and removed while serving
    (lockstep.entrypoints.elastic): `add` connects to a started replica's input (`input_ipc`)
    without dispatching to it; `activate` dispatches to it; `remove` stops dispatching to it
    (what it runs drains); `retire` forgets it once it has drained and stopped."""

    op: str  # add | activate | remove | retire
    dp_rank: int
    input_ipc: str = ""


@dataclass
class LoadLoraAdapterReq:
    lora_name: str
    lora_path: str
    dp_rank: int | None = None  # one replica only (a replica added while serving); None: all


@dataclass
class UnloadLoraAdapterReq:
    lora_name: str
    dp_rank: int | None = None


@dataclass
class LoraUpdateOut:
    """A load or unload's outcome: `status` is the HTTP status; `adapters` {name: path} loaded
    after it."""

    success: bool
    message: str = ""
    status: int = 200
    adapters: dict[str, str] = field(default_factory=dict)


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
    # An embedding / scoring model's pooled vector (or scores), in place of tokens.
    embedding: list[float] | None = None
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
    queued_tokens: int = 0  # prompt tokens admitted or waiting whose KV is not computed yet
    received: int = 0  # generate requests the replica has read: which dispatches this report saw


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
