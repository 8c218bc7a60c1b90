"""The scheduler: one per rank, all deciding identically from the same inputs.

Each step: process inputs -> get_next_batch_to_run -> run on the worker -> process results
(`OutputProcessor`). The plain loop runs those in order; with overlap scheduling the worker runs
on a forward thread: the step launches its batch, then processes the previous step's result
while that batch computes (lockstep.managers.step_loops).

Determinism: nothing here reads wall-clock time, iterates a set, or draws unseeded randomness:
two schedulers fed the same inputs make the same batches (see `fingerprints`). The one fact that
depends on time, whether a grammar has compiled (its compile runs on the grammar backend's
thread, off this loop), is turned into an input: a constrained request waits in the grammar
queue, not admitted, until the *input rank* (the one that reads the sockets: global rank 0, or
a lone scheduler) finds its grammar compiled in `collect_inputs` and adds `GrammarsReady(rids)`
to the inputs it broadcasts; every rank admits exactly those requests where that message falls
among the step's inputs, a rank whose own compile is behind blocking there for it. So a compile
never stalls the running batch, and the ranks stay in lockstep (lockstep.managers.grammar_queue)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from lockstep.constrained.backend import NO_GRAMMAR_BACKEND, GrammarBackend, grammar_backend_for
from lockstep.core import FINISH_ABORT, BaseFinishReason
from lockstep.forward_batch import ForwardMode
from lockstep.lora.adapter import AdapterError
from lockstep.lora.manager import create_lora_manager, lora_of
from lockstep.managers.grammar_queue import GrammarQueue
from lockstep.managers.prefill_adder import admit_waiting
from lockstep.managers.priority import PriorityRule
from lockstep.managers.schedule_batch import KVState, LogprobState, Req, ReqPhase, ScheduleBatch
from lockstep.managers.scheduler_output_processor import OutputProcessor, SchedulerStats
from lockstep.managers.speculative import Speculator
from lockstep.managers.step_loops import OverlapLoop, PlainLoop
from lockstep.managers.stop_checker import stop_checker
from lockstep.managers.tp_worker import TpModelWorker
from lockstep.mem_cache.radix_cache import ChunkCache, RadixCache
from lockstep.messages import (
    AbortReq,
    FlushCacheOut,
    FlushCacheReq,
    GrammarsReady,
    LoadLoraAdapterReq,
    LoraUpdateOut,
    ReqOutput,
    TokenizedGenerateReq,
    UnloadLoraAdapterReq,
)
from lockstep.multimodal.spans import chunk_take
from lockstep.server_args import ServerArgs

logger = logging.getLogger(__name__)

MIN_NEW_TOKEN_RATIO_FACTOR = 0.2
NEW_TOKEN_RATIO_DECAY_STEPS = 600


class KVLeakError(RuntimeError):
    pass


class Scheduler:
    def __init__(self, args: ServerArgs, worker: TpModelWorker, eos_token_ids: Iterable[int] = (),
                 strict_integrity: bool = False, grammar: GrammarBackend | None = None,
                 tokenizer: Any = None, dp_rank: int = 0) -> None:
        self.args = args
        self.worker = worker
        runner = worker.runner
        self.device = runner.device
        self.vocab_size = runner.model_cfg.vocab_size
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.allocator
        self.max_total_tokens = runner.max_total_tokens
        self.context_len = runner.context_len
        self.max_req_len = min(self.context_len, self.req_to_token_pool.max_context_len - 1)
        self.tree = ChunkCache(self.allocator) if args.disable_radix_cache else RadixCache(self.allocator)
        self.tokenizer = tokenizer  # decodes the output of requests with stop strings
        # Only ranks that sample compute grammar masks; every rank advances the matchers alike.
        self.grammar = grammar  # None: the tokenizer is not a fast one to compile against
        self._fill_masks = grammar.fill_masks if grammar and runner.pp.is_last else None
        self.strict_integrity = strict_integrity
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.grammar_queue = GrammarQueue()  # constrained requests whose grammar is compiling
        self.step_count = 0
        self.init_ratio = self.new_token_ratio = args.new_token_ratio
        self.rng = random.Random(args.random_seed)
        self.priorities = PriorityRule(args)  # --enable-priority-scheduling and its companions
        self.fingerprints: list[str] = []
        self.stats = SchedulerStats()
        self.control_replies: list[Any] = []
        # Called with (step, fingerprint) before each step's batch runs; the lockstep check.
        self.before_run: Callable[[int, str], None] | None = None
        self.dp_rank = dp_rank  # which data-parallel replica this scheduler serves
        self.speculator = Speculator(args) if args.speculation else None
        self.lora = create_lora_manager(args, runner) if args.lora_enabled else None
        self.outputs = OutputProcessor(self, self.stats, frozenset(eos_token_ids), self.max_req_len,
                                       self.speculator, dp_rank)
        self.outputs.encoder_stats = runner.encoder_stats
        self.overlap = args.overlap_schedule
        self.loop = (OverlapLoop(self, args.max_running_requests + 1) if self.overlap
                     else PlainLoop(self))

    def process_inputs(self, msgs: Iterable[Any]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReq):
                self._add_request(msg)
            elif isinstance(msg, GrammarsReady):
                self._grammars_ready(msg.rids)
            elif isinstance(msg, AbortReq):
                self.abort(msg.rid, msg.reason)
            elif isinstance(msg, FlushCacheReq):
                self.control_replies.append(self.flush_cache())
            elif isinstance(msg, (LoadLoraAdapterReq, UnloadLoraAdapterReq)):
                self.control_replies.append(
                    self.lora.update(msg, self.lora_in_use(), self.loop.resolve) if self.lora
                    else LoraUpdateOut(False, "LoRA adapters are off: start with --enable-lora", 400))
            else:
                logger.error("scheduler ignored unknown message %r", type(msg).__name__)

    def _add_request(self, msg: TokenizedGenerateReq) -> None:
        """Every check of a request, once: a 400 is its first output, which the front awaits."""
        req = Req(msg.rid, list(msg.input_ids), msg.sampling_params, arrival=self.step_count,
                  logprobs=LogprobState(msg.return_logprob, msg.logprob_start_len,
                                        msg.top_logprobs_num), images=list(msg.images))
        p = req.sampling_params
        req.priority, error = self.priorities.resolve(msg.priority)
        error = error or req.limits_error(self.context_len, self.max_req_len, self.vocab_size)
        if error is None:
            req.sampling.stops, error = stop_checker(self.tokenizer, p)
        if error is None and p.constraint is not None and self.grammar is None:
            error = NO_GRAMMAR_BACKEND
        status = 400
        if error is None and msg.lora_path is not None:
            try:
                req.lora = lora_of(self.lora, msg.lora_path)
            except AdapterError as e:
                error, status = str(e), e.status
        self.stats.prompt_tokens += len(req.origin_input_ids)
        if error:
            self.finish(req, FINISH_ABORT(error, status_code=status))
        elif p.constraint is not None:  # admitted once its grammar compiled (a 400 if it fails)
            self.grammar_queue.add(req, self.grammar.compile(p.constraint))
        else:
            self.waiting.append(req)

    def collect_inputs(self, received: list[Any]) -> list[Any]:
        """The input rank's inputs for this step: what it read off its socket, then which
        grammars have compiled (GrammarsReady). The caller broadcasts the result to every rank."""
        ready = self.grammar_queue.ready(wait=not received and self._no_batch_work())
        return [*received, GrammarsReady(ready)] if ready else received

    def lora_in_use(self, admitted: Iterable[Req] = ()) -> list[Any]:
        """The adapters of the requests that hold KV (their slots stay as they are)."""
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        return [r.lora for r in (*self.running, *chunked, *admitted) if r.lora is not None]

    def _no_batch_work(self) -> bool:
        """Nothing to batch or await: only the grammar queue may hold requests."""
        return not (self.waiting or self.running or self.chunked_req or self.loop.in_flight)

    def _grammars_ready(self, rids: list[str]) -> None:
        for req, error in self.grammar_queue.take(rids):
            if error is None:
                self.waiting.append(req)
            else:
                self.finish(req, FINISH_ABORT(error, status_code=400))

    def abort(self, rid: str, reason: FINISH_ABORT = FINISH_ABORT()) -> None:
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        for req in [*self.grammar_queue, *self.waiting, *chunked, *self.running]:
            if req.rid == rid:
                self.finish(req, reason)

    def flush_cache(self) -> FlushCacheOut:
        self.loop.resolve()  # the tree may not change under a batch in flight
        if self.grammar_queue or self.waiting or self.running or self.chunked_req:
            return FlushCacheOut(False, "cannot flush the cache while requests are running")
        self.tree.reset()
        self.check_integrity()
        return FlushCacheOut(True)

    def step(self, received: Iterable[Any] = ()) -> list[ReqOutput]:
        """One step of a scheduler that is its own input rank (one rank; in-process runs)."""
        return self.run_step(self.collect_inputs(list(received)))

    def run_step(self, msgs: Iterable[Any]) -> list[ReqOutput]:
        """One step on this step's inputs (the same on every rank): the step's outputs."""
        self.process_inputs(msgs)
        self.loop.step()
        self.step_count += 1
        return self.outputs.take_outputs()

    # ---- what the output processor asks of the scheduler (SchedulerQueues)

    def start_decoding(self, req: Req) -> None:
        self.running.append(req)

    def finish(self, req: Req, reason: BaseFinishReason) -> None:
        """End a request, whatever ended it: out of every queue, its KV released, its last
        output queued. The one place a request ends."""
        self.grammar_queue.remove(req)
        self.waiting = [r for r in self.waiting if r is not req]
        self.running = [r for r in self.running if r is not req]
        if self.chunked_req is req:
            self.chunked_req = None
        self._release(req)
        self.outputs.finished(req, reason)

    def load(self) -> tuple[int, int, int, int]:
        """(running, queued, KV tokens in use, prompt tokens still to compute): the DP
        controller's dispatch (lockstep.messages.LoadReport)."""
        used = self.max_total_tokens - self.allocator.available_size() - self.tree.evictable_size()
        running = len(self.running) + (1 if self.chunked_req else 0)
        pending = [*self.waiting, *self.grammar_queue, *([self.chunked_req] if self.chunked_req else [])]
        return (running, len(self.waiting) + len(self.grammar_queue), used,
                sum(r.seq_len - r.kv.cached_len for r in pending))

    def is_idle(self) -> bool:
        return not self.grammar_queue and self._no_batch_work()

    def form_batch(self) -> ScheduleBatch | None:
        """This step's requests: a prefill (mixed with decodes when enabled), else a decode."""
        self._decay_ratio()
        prefill = self._prefill_batch()
        if prefill is not None and self.args.enable_mixed_chunk and self.running:
            decode = self._decode_batch()
            if decode is not None:
                prefill = ScheduleBatch(prefill.reqs + decode.reqs, ForwardMode.MIXED,
                                        prefill.samples + decode.samples,
                                        torch.cat((prefill.out_cache_loc, decode.out_cache_loc)))
        return prefill if prefill is not None else self._decode_batch()

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """This step's batch, ready for the worker; `before_run` hears of it (or of none)."""
        batch = self.form_batch()
        if batch is not None:
            batch.extend_lens = [r.kv.extend_len for r in batch.reqs]
            batch.worker_batch = batch.to_worker_batch(self.vocab_size, self.args.random_seed,
                                                       self.device, self._fill_masks)
            if self.lora is not None:
                batch.worker_batch.forward_batch.lora_slots = [self.lora.slot_of(r.lora) for r in batch.reqs]
            if self.args.debug_fingerprints or self.args.enable_lockstep_check:
                self.fingerprints.append(batch.fingerprint())
        if self.before_run is not None:
            self.before_run(self.step_count, batch.fingerprint() if batch else "idle")
        return batch

    def future_tokens(self, req: Req) -> int:
        """KV the request's output will still need, by the estimated new-token ratio."""
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return int(max(0, left) * self.new_token_ratio)

    def alloc(self, n: int) -> torch.Tensor | None:
        short = n - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.alloc(n)

    def _prefill_batch(self) -> ScheduleBatch | None:
        budget = self.args.chunked_prefill_size if self.args.chunked_prefill_size > 0 else 1 << 62
        admitted: list[Req] = []
        locs: list[torch.Tensor] = []
        if self.chunked_req is not None:
            req = self.chunked_req
            take = chunk_take(req.images, req.kv.cached_len, min(req.seq_len - req.kv.cached_len, budget),
                              req.seq_len - req.kv.cached_len)
            loc = self._alloc_retracting(lambda: take)
            if loc is None:  # admission reserved the prompt; only decodes compete for it
                raise RuntimeError("KV for an admitted chunked prefill was not available")
            req.kv.device_len = req.kv.cached_len + take
            budget -= take
            admitted.append(req)
            locs.append(loc)
            self.chunked_req = None if req.kv.device_len == req.seq_len else req
        if self.chunked_req is None and budget > 0 and self.waiting:
            admit_waiting(self, admitted, locs, budget)
        if not admitted:
            return None
        for kv, loc in zip((r.kv for r in admitted), locs):
            self.req_to_token_pool.req_to_token[kv.req_pool_idx, kv.cached_len:kv.device_len] = loc
        return ScheduleBatch(admitted, ForwardMode.EXTEND,
                             [int(r.kv.device_len == r.seq_len) for r in admitted], torch.cat(locs))

    def _decode_batch(self) -> ScheduleBatch | None:
        if any(r.needs_real_outputs for r in self.running):
            self.loop.resolve()
        if not self.running:
            return None
        if self.lora is not None:
            self.running = self.lora.grouped(self.running)
        loc = None
        if self.speculator is not None:
            loc = self.speculator.draft(self.running, self.max_req_len, self.alloc)
        if loc is None:  # drafts never retract anyone: no draft got KV, or none was made
            loc = self._alloc_retracting(lambda: len(self.running))
        if loc is None or not self.running:
            return None
        rows, at = self.req_to_token_pool.req_to_token, 0
        for req in self.running:
            kv, n = req.kv, 1 + len(req.spec.draft)
            kv.device_len = kv.cached_len + n
            rows[kv.req_pool_idx, kv.cached_len:kv.device_len] = loc[at:at + n]
            at += n
        return ScheduleBatch(list(self.running), ForwardMode.DECODE,
                             [1 + len(r.spec.draft) for r in self.running], loc)

    def _alloc_retracting(self, size: Callable[[], int]) -> torch.Tensor | None:
        """KV slots for `size()` (re-read as requests go), retracting running requests while the
        pool is short: decodes mixed between a chunked prefill's chunks can use up its share."""
        loc = self.alloc(size())
        while loc is None and self.running:
            if not self.loop.resolve():  # a retraction picks by real outputs: those first
                self._retract_one()
            loc = self.alloc(size())
        return loc

    def retract(self, victim: Req) -> None:
        """Back to waiting, its KV to the prefix tree; resumed later with the same output."""
        self.running.remove(victim)
        self._release(victim)
        victim.phase, victim.retractions = ReqPhase.WAITING, victim.retractions + 1
        self.waiting.append(victim)
        self.stats.retractions += 1

    def _retract_one(self) -> None:
        """Retract the request that loses least: least urgent, fewest tokens decoded, then
        longest prompt."""
        victim = min(self.running, key=lambda r: (self.priorities.retract_order(r),
                                                  len(r.output_ids), -len(r.origin_input_ids), r.rid))
        self.retract(victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        logger.info("KV pool full: retracted %s after %d tokens (%d retractions so far)",
                    victim.rid, len(victim.output_ids), self.stats.retractions)

    def _decay_ratio(self) -> None:
        floor = self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        step = (self.init_ratio - floor) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = max(floor, self.new_token_ratio - step)

    def _to_tree(self, req: Req) -> list[int]:
        """Insert the request's computed tokens; the tree keeps those it did not hold, and the
        request's copies of the others are freed. Returns the tokens."""
        kv = req.kv
        tokens = req.prefix_key[: kv.cached_len]
        indices = self.req_to_token_pool.req_to_token[kv.req_pool_idx, : kv.cached_len].clone()
        present = self.tree.insert(tokens, indices)
        self.allocator.free(indices[kv.prefix_len:present])
        return tokens

    def cache_unfinished(self, req: Req) -> None:
        """Hand the request's computed prefix to the tree now, so others can share it."""
        kv = req.kv
        if isinstance(self.tree, ChunkCache) or kv.cached_len <= kv.prefix_len:
            return
        tokens = self._to_tree(req)
        new_indices, node = self.tree.match_prefix(tokens)
        self.req_to_token_pool.req_to_token[kv.req_pool_idx, : kv.cached_len] = new_indices
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(kv.last_node)
        kv.last_node, kv.prefix_len = node, kv.cached_len

    def _release(self, req: Req) -> None:
        """Give up the request's KV: into the tree (radix) or back to the allocator."""
        if req.kv.req_pool_idx is None:
            return
        self._to_tree(req)  # a ChunkCache keeps none: every slot is freed
        self.tree.dec_lock_ref(req.kv.last_node)
        self.free_uncached(req)  # slots for a step that never ran (abort mid-batch)
        self.loop.free_row(req.kv.req_pool_idx)  # parked while a launched batch may read it
        req.kv = KVState()

    def free_uncached(self, req: Req) -> None:
        """Free the request's KV slots past `cached_len`: allocated for tokens it did not keep."""
        kv = req.kv
        if kv.device_len > kv.cached_len:
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
            self.allocator.free(row[kv.cached_len:kv.device_len].clone())
            kv.device_len = kv.cached_len

    def check_integrity(self) -> None:
        free, held, rows = self.allocator.available_size(), self.tree.total_size(), self.req_to_token_pool
        if (free + held == self.max_total_tokens and self.tree.protected_size() == 0
                and rows.available_size() == rows.size):
            return
        msg = (f"KV leak at idle: free {free} + tree {held} != total {self.max_total_tokens}, "
               f"protected {self.tree.protected_size()}, "
               f"req slots free {rows.available_size()}/{rows.size}")
        if self.strict_integrity:
            raise KVLeakError(msg)
        logger.error(msg)


@dataclass(frozen=True)
class ModelFiles:
    """What a scheduler reads from its model's files besides the weights. create_scheduler reads
    them itself unless given these: a process that builds many schedulers of one model (in-process
    tests) reads them once; every server process reads its own."""

    tokenizer: Any  # the HF tokenizer (stop strings, grammars)
    stop_token_ids: list[int]
    grammar_vocabulary: Callable[[], Any] | None = None  # builds the llguidance vocabulary (at start)


def create_scheduler(args: ServerArgs, tp=None, pp=None, local_ranks: int = 1,
                     strict_integrity: bool = False, files: ModelFiles | None = None,
                     dp_rank: int = 0) -> Scheduler:
    """Load the model for this rank and build its scheduler; used by every scheduler process
    and by in-process tests alike. The grammar vocabulary is built here, before the process
    reports ready, so that no request waits for it."""
    from lockstep.configs.model_config import ModelConfig
    from lockstep.detokenizer.incremental_detokenizer import load_tokenizer
    from lockstep.distributed.parallel_state import NO_PIPELINE, SINGLE
    from lockstep.managers.embedding_args import embedding_args, pooling_config
    from lockstep.model_executor.model_runner import ModelRunner, RunnerConfig, resolve_dtype
    from lockstep.model_loader import resolve_model
    from lockstep.model_loader.pooling import pooling_for
    from lockstep.model_loader.stop_tokens import stop_token_ids

    source = resolve_model(args.model_path)
    model_cfg = ModelConfig.from_hf(source.hf_config)
    pooling = pooling_for(source.model_dir, source.hf_config, args.is_embedding, source.origin,
                          args.chat_template)
    if pooling is not None:
        args, model_cfg = embedding_args(args), pooling_config(model_cfg, source.model_dir, pooling)

    def read_files() -> tuple[ModelFiles, GrammarBackend | None]:
        """The tokenizer (stop strings, grammars), then the grammar vocabulary built from it."""
        got = files or ModelFiles(load_tokenizer(args),
                                  stop_token_ids(source.model_dir, model_cfg.eos_token_ids))
        if pooling is not None:  # nothing is sampled: no grammar (a WordPiece vocabulary has none)
            return got, None
        return got, grammar_backend_for(got.tokenizer, model_cfg.vocab_size, got.stop_token_ids,
                                        got.grammar_vocabulary)

    runner_cfg = RunnerConfig(
        device=args.device, dtype=resolve_dtype(args.dtype, args.device),
        max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests, context_length=args.context_length,
        local_ranks=local_ranks, quantization=args.quantization,
        int8_activations=args.int8_activations,
        kv_cache_dtype=None if args.kv_cache_dtype == "auto" else resolve_dtype(args.kv_cache_dtype, args.device),
    )
    torch.manual_seed(args.random_seed)
    with ThreadPoolExecutor(1) as pool:  # the files on a thread, beside the weights' load
        reading = pool.submit(read_files)
        runner = ModelRunner(model_cfg, source, runner_cfg, tp or SINGLE, pp or NO_PIPELINE)
        read, grammar = reading.result()
    worker = TpModelWorker(runner, args.micro_batches, pooling)
    return Scheduler(args, worker, read.stop_token_ids, strict_integrity, grammar, read.tokenizer,
                     dp_rank)

