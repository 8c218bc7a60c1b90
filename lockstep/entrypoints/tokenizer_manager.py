"""The front process's request tracker: tokenize, send to the scheduler, await outputs (one
background task routes the detokenizer's outputs to each request's queue)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from lockstep.core import FINISH_ABORT, BaseFinishReason, TokenLogprob
from lockstep.entrypoints.session_controller import SessionController, SessionError
from lockstep.lora.adapter import parse_lora_paths
from lockstep.messages import (
    AbortReq,
    BatchStrOut,
    FlushCacheOut,
    FlushCacheReq,
    LoadLoraAdapterReq,
    LoraUpdateOut,
    ReqOutput,
    TokenizedGenerateReq,
    UnloadLoraAdapterReq,
    decode,
    encode,
    zmq_socket,
)
from lockstep.multimodal.images import ImageError
from lockstep.multimodal.processing import ImageInputs
from lockstep.multimodal.refs import ImageRef
from lockstep.multimodal.shm import ImageSegments
from lockstep.sampling_params import SamplingParams
from lockstep.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the server cannot serve as asked: becomes a 4xx (or a 503 when the server is
    full or going down, with Retry-After), never a crash."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# Texts longer than this are tokenized on a worker thread, so that a long prompt never stalls the
# event loop (and every stream it serves) while the tokenizer runs.
TOKENIZE_OFF_LOOP_CHARS = 16_384


def spec_rates(passes: int, drafted: int, accepted: int) -> tuple[float, float]:
    """Speculative decoding's acceptance rate (accepted / drafted) and length (tokens per verify
    pass), as SGLang defines them: for one request's meta_info and the server's /metrics."""
    return (accepted / drafted if drafted else 0.0,
            (passes + accepted) / passes if passes else 1.0)


@dataclass
class GenerateOutput:
    """One output of a request: everything so far (`text`, `output_ids`, the logprob lists,
    which are the request's own and keep growing) and what this output added."""

    rid: str
    text: str
    output_ids: list[int]
    text_delta: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: BaseFinishReason | None
    e2e_latency: float
    dp_rank: int | None = None  # with --dp-size > 1
    spec: tuple[int, int, int] | None = None  # with speculative decoding: passes, drafted, accepted
    embedding: list[float] | None = None  # an embedding / scoring model's pooled output
    # With return_logprob (the top lists also with top_logprobs_num):
    output_token_logprobs: list[TokenLogprob] | None = None
    input_token_logprobs: list[TokenLogprob] | None = None
    output_top_logprobs: list[list[TokenLogprob]] | None = None
    input_top_logprobs: list[list[TokenLogprob] | None] | None = None

    def meta_info(self) -> dict[str, Any]:
        """SGLang's meta_info, for the HTTP and Engine outputs."""
        meta: dict[str, Any] = {
            "id": self.rid, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason.to_json() if self.finish_reason else None,
            "e2e_latency": self.e2e_latency,
        }
        if self.dp_rank is not None:
            meta["dp_rank"] = self.dp_rank
        if self.spec is not None:  # SGLang's names
            passes, drafted, accepted = self.spec
            rate, length = spec_rates(*self.spec)
            meta.update(spec_verify_ct=passes, spec_draft_token_num=drafted,
                        spec_accept_token_num=accepted, spec_accept_rate=rate,
                        spec_accept_length=length)
        return meta | {name: value for name in ("output_token_logprobs", "input_token_logprobs",
                                                "output_top_logprobs", "input_top_logprobs")
                       if (value := getattr(self, name)) is not None}


@dataclass
class ReqState:
    """What the front keeps per request: `out`, its output so far (the text, ids and logprob
    lists grow in place; each output yielded is a copy of it), and what the metrics time."""

    out: GenerateOutput
    stream: bool = False  # labels the metrics as SGLang's do
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    created: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None  # of the last output that carried tokens
    outputs_seen: int = 0


class TokenizerManager:
    def __init__(self, args: ServerArgs, ports: PortArgs, tokenizer: Any, context_len: int,
                 max_total_num_tokens: int, vocab_size: int) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.max_total_num_tokens = max_total_num_tokens
        self.vocab_size = vocab_size
        self.ctx = zmq.asyncio.Context()
        # LINGER 0: a message for a scheduler that is gone must never block this process's exit.
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.to_scheduler = zmq_socket(self.ctx, zmq.PUSH, ports.scheduler_input_ipc)
        self.from_detokenizer = zmq_socket(self.ctx, zmq.PULL, ports.tokenizer_ipc)
        self.states: dict[str, ReqState] = {}
        # Each data-parallel replica's state, by dp_rank: active, or, while the server runs,
        # warming / draining / retired (lockstep.entrypoints.elastic).
        self.replicas: list[str] = ["active"] * args.dp_size
        self.sessions = SessionController()  # /open_session, a request's session_params
        self.control_waiters: list[asyncio.Future] = []
        # Called with (state, output, now) on every output, before the state takes it in.
        self.observers: list[Callable[[ReqState, ReqOutput, float], None]] = []
        self._loop_task: asyncio.Task | None = None
        # the LoRA adapters loaded {name: path}, as the schedulers' last reply said
        self.lora_adapters: dict[str, str] = parse_lora_paths(args.lora_paths)
        # What the model serves (model_loader.pooling.model_kind): "generate", "embed" or "score";
        # set at launch. A request of another kind is a 400 (check_kind).
        self.kind = "generate"
        # The model's image handling (None: it reads no images), and the shared-memory segments
        # of requests in flight, each freed once its request has ended at the scheduler.
        self.image_inputs: ImageInputs | None = None
        self.image_segments = ImageSegments()

    def check_kind(self, wanted: str, route: str) -> None:
        """A 400 when this server's model does not serve `wanted` (lockstep.entrypoints.embedding_routes)."""
        if self.kind == wanted:
            return
        serves = {"generate": "generates text", "embed": "serves embeddings",
                  "score": "scores (rerank)"}[self.kind]
        hint = {"generate": "start a server with a generative model",
                "embed": "start a server with an embedding model (--is-embedding)",
                "score": "start a server with a reranker: a cross-encoder, or a Qwen3-Reranker "
                         "(its name says so, or --chat-template qwen3-reranker)"}[wanted]
        raise RequestError(f"{route}: this server's model {serves}; {hint}")

    def close(self) -> None:
        """Release the sockets; the output loop then ends by itself (ContextTerminated)."""
        self.ctx.destroy(linger=0)
        self.image_segments.release_all()

    def start(self) -> None:
        """The output loop, on the running event loop (the first request's: it serves them all)."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._handle_loop())

    @property
    def max_prompt_tokens(self) -> int:
        limit = self.context_len - 1
        return min(limit, self.args.max_prompt_tokens) if self.args.max_prompt_tokens else limit

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """No longer text fits `max_prompt_tokens` tokens (a token covers at most its longest
        vocabulary entry's characters, x4 for Unicode normalization): longer ones are refused
        before the tokenizer spends seconds on them."""
        try:
            longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: no early refusal
            return 1 << 62
        return self.max_prompt_tokens * max(1, longest) * 4

    async def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise RequestError(
                f"the prompt has {len(text)} characters, more than a prompt of at most "
                f"{self.max_prompt_tokens} tokens can have")
        if len(text) > TOKENIZE_OFF_LOOP_CHARS:
            return (await asyncio.to_thread(self.tokenizer, text,
                                            add_special_tokens=add_special_tokens)).input_ids
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def check_ids(self, ids: list[int], where: str) -> list[int]:
        """`ids`, or a 400 naming `where` when one is outside the vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"{where}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return list(ids)

    def resolve_params(self, sp: SamplingParams, prompt_len: int) -> SamplingParams:
        """The request's params with max_new_tokens a number; checks --max-prompt-tokens and
        logit_bias's ids (the scheduler checks the context and the KV pool)."""
        # Unset: as many as fit, in the context and in the KV pool (which may be smaller).
        fits = min(self.context_len, self.max_total_num_tokens) - prompt_len
        max_new = sp.max_new_tokens if sp.max_new_tokens is not None else max(fits, 0)
        if self.args.max_prompt_tokens and prompt_len > self.args.max_prompt_tokens:
            raise RequestError(f"the prompt has {prompt_len} tokens; this server accepts at most "
                               f"{self.args.max_prompt_tokens} (--max-prompt-tokens)")
        self.check_ids([int(t) for t in sp.logit_bias], "logit_bias")
        out = copy.copy(sp)  # validated at the edge; copied, not validated again
        out.max_new_tokens = max_new
        return out

    async def generate(self, req: TokenizedGenerateReq) -> AsyncIterator[GenerateOutput]:
        """Yields one output per message; the last has its finish_reason set. If the consumer
        stops early (client gone), the request is aborted and its KV freed."""
        # Given ids are the scheduler's to check against its vocabulary.
        text = req.input_text or ""
        if req.image_data and self.image_inputs is not None:
            text = self.image_inputs.expand_text(text)  # as HF's processor places images
        ids = (list(req.input_ids) if req.input_ids is not None else await self.tokenize_text(text))
        if req.sampling_params.max_new_tokens != 0:  # the Engine's way in; routes check first
            self.check_kind("generate", "generation")
        if req.image_data and req.session_params is not None:
            raise RequestError("session_params: a session's turns are text only; send the images "
                               "without a session")
        limit = self.args.max_queued_requests
        running = self.args.max_running_requests * self.replicas.count("active")
        if limit is not None and len(self.states) >= limit + running:
            raise RequestError(f"the server is full: {len(self.states)} requests in flight "
                               f"(--max-queued-requests {limit}); retry later", status=503)
        dp = req.routed_dp_rank
        if dp is not None and not (0 <= dp < len(self.replicas)
                                   and self.replicas[dp] in ("active", "warming")):
            live = [i for i, s in enumerate(self.replicas) if s == "active"]
            raise RequestError(f"routed_dp_rank: {dp} names no replica taking requests; "
                               f"this server's are {live}")
        if req.lora_path is not None and req.lora_path not in self.lora_adapters:
            if not self.args.lora_enabled:
                raise RequestError(f"lora_path {req.lora_path!r}: this server serves no LoRA "
                                   "adapters (start it with --enable-lora or --lora-paths)")
            raise RequestError(f"LoRA adapter {req.lora_path!r} is not loaded (loaded: "
                               f"{', '.join(sorted(self.lora_adapters)) or 'none'})", 404)
        rid = req.rid or uuid.uuid4().hex
        if rid in self.states:
            raise RequestError(f"rid {rid!r} is already in use")
        images: list[ImageRef] = []
        if req.image_data:  # decoded, preprocessed, hashed and shared off the event loop; first,
            # as an image's tokens (Idefics3's tiles) may lengthen the prompt the checks below see
            ids, images = await self._share_images(rid, ids, req)
        session = None
        if req.session_params is not None:  # the session's earlier turn, then this one
            try:
                session = self.sessions.begin(req.session_params, ids, self.tokenizer.bos_token_id)
            except SessionError as e:
                raise RequestError(str(e), e.status) from None
            ids = session.input_ids
            if dp is None:  # where the earlier turn's KV is
                req = dataclasses.replace(req, routed_dp_rank=session.dp_rank)
        try:
            params = self.resolve_params(req.sampling_params, len(ids))
        except RequestError:
            if session is not None:
                self.sessions.end(session, rid, None, None)
            self.image_segments.release(rid)  # never sent: no rank reads them
            raise
        lp, top = req.return_logprob, bool(req.return_logprob and req.top_logprobs_num)
        state = ReqState(GenerateOutput(
            rid, "", [], "", [], len(ids), 0, 0, None, 0.0,
            output_token_logprobs=[] if lp else None, input_token_logprobs=[] if lp else None,
            output_top_logprobs=[] if top else None, input_top_logprobs=[] if top else None),
            req.stream)
        self.states[rid] = state
        self.start()
        await self.to_scheduler.send(encode(dataclasses.replace(
            req, rid=rid, input_ids=ids, sampling_params=params, image_data=None, images=images)))
        try:
            while True:
                out: ReqOutput = await state.queue.get()
                merged = self._merge(state, out, req)
                if session is not None and state.finished:  # a turn to continue, if it finished
                    ok = not isinstance(out.finish_reason, FINISH_ABORT)
                    self.sessions.end(session, rid, merged.output_ids if ok else None,
                                      out.dp_rank)
                    session = None
                yield merged
                if state.finished:
                    return
        finally:
            self.states.pop(rid, None)
            if session is not None:  # ended before its last output (client gone)
                self.sessions.end(session, rid, None, None)
            if not state.finished:
                await self.abort(rid)

    async def _share_images(self, rid: str, ids: list[int], req: TokenizedGenerateReq
                            ) -> tuple[list[int], list[ImageRef]]:
        """The prompt with its images' tokens marked, and the images (their pixels held in
        shared memory under `rid` until the request ends); a 400 naming what is wrong."""
        if self.image_inputs is None:
            raise RequestError(f"image input: the model {self.args.model_path!r} takes no images")
        if req.return_logprob and req.logprob_start_len >= 0:
            raise RequestError("logprob_start_len: prompt logprobs of a prompt with images are not "
                               "served; leave it at -1")
        try:
            prepared = await asyncio.to_thread(self.image_inputs.prepare, ids, req.image_data or [])
        except ImageError as e:
            raise RequestError(str(e)) from None
        self.image_segments.hold(rid, prepared.segments)
        return prepared.input_ids, prepared.images

    def _merge(self, state: ReqState, out: ReqOutput, req: TokenizedGenerateReq
               ) -> GenerateOutput:
        now = time.perf_counter()
        for observe in self.observers:
            observe(state, out, now)
        state.outputs_seen += 1
        if out.new_token_ids:
            if state.first_token_time is None:
                state.first_token_time = now
            state.last_token_time = now
        acc, text = state.out, req.return_text_in_logprobs
        acc.text += out.text_delta
        acc.output_ids.extend(out.new_token_ids)
        state.finished = out.finish_reason is not None
        if acc.output_token_logprobs is not None:
            acc.output_token_logprobs.extend(self._with_text(out.output_token_logprobs, text))
            acc.input_token_logprobs.extend(self._with_text(out.input_token_logprobs, text))
        if acc.output_top_logprobs is not None:
            acc.output_top_logprobs.extend(self._with_text(t, text) for t in out.output_top_logprobs)
            acc.input_top_logprobs.extend(
                self._with_text(t, text) if t else None for t in out.input_top_logprobs)
        return dataclasses.replace(
            acc, output_ids=list(acc.output_ids), text_delta=out.text_delta,
            new_token_ids=list(out.new_token_ids), prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
            finish_reason=out.finish_reason, e2e_latency=now - state.created,
            dp_rank=out.dp_rank if self.args.dp_size > 1 else None, spec=out.spec,
            embedding=out.embedding)

    def _with_text(self, entries: list[TokenLogprob], text: bool) -> list[TokenLogprob]:
        if not text:
            return entries
        return [e._replace(text=self.tokenizer.decode([e.token_id])) for e in entries]

    async def abort(self, rid: str, reason: FINISH_ABORT = FINISH_ABORT()) -> None:
        await self.to_scheduler.send(encode(AbortReq(rid, reason)))

    async def _control(self, msg: Any, replies: int, timeout: float) -> Any:
        """Send a control message and await one reply per replica it reaches: the first refusal,
        else the first reply (replies come back in the order they were awaited)."""
        self.start()
        futs = [asyncio.get_running_loop().create_future() for _ in range(replies)]
        self.control_waiters.extend(futs)
        await self.to_scheduler.send(encode(msg))
        got = await asyncio.wait_for(asyncio.gather(*futs), timeout=timeout)
        return next((r for r in got if not r.success), got[0])

    def _live_replicas(self) -> int:
        """Replicas a broadcast reaches (every one not yet retired)."""
        return sum(s != "retired" for s in self.replicas)

    async def flush_cache(self) -> FlushCacheOut:
        """Every replica flushes; the flush succeeds only if all of them did."""
        return await self._control(FlushCacheReq(), self._live_replicas(), timeout=60)

    async def update_lora(self, msg: LoadLoraAdapterReq | UnloadLoraAdapterReq) -> LoraUpdateOut:
        """Load or unload an adapter on every replica, or on `msg.dp_rank`'s alone (each rank of
        each does it as an input of its step): the first refusal, else the success."""
        out = await self._control(msg, 1 if msg.dp_rank is not None else self._live_replicas(),
                                  timeout=300)
        if msg.dp_rank is None:
            self.lora_adapters = dict(out.adapters)
        return out

    async def _handle_loop(self) -> None:
        while True:
            try:
                msg = decode(await self.from_detokenizer.recv())
            except (zmq.ContextTerminated, zmq.ZMQError, asyncio.CancelledError):
                return
            if isinstance(msg, BatchStrOut):
                for out in msg.outputs:
                    if (state := self.states.get(out.rid)) is not None:
                        state.queue.put_nowait(out)
                    if out.finish_reason is not None:  # no rank reads its images any more
                        self.image_segments.release(out.rid)
            elif isinstance(msg, (FlushCacheOut, LoraUpdateOut)):
                if self.control_waiters:
                    self.control_waiters.pop(0).set_result(msg)
            else:
                logger.error("tokenizer manager ignored %s", type(msg).__name__)
