"""Admission: which waiting requests join this step's prefill, and how much of each (SGLang's
PrefillAdder). Every decision reads only scheduler state every rank holds alike: the waiting
order (schedule_policy), the prefix tree, the KV pool and the new-token ratio, so all ranks admit
the same requests. A request needs its prompt's uncached part now and its estimated output later
(`future_tokens`); with priorities on, a request that does not fit may preempt less urgent running
ones (lockstep.managers.priority); a LoRA request waits while its adapter has no slot."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from lockstep.managers.schedule_batch import Req, ReqPhase
from lockstep.managers.schedule_policy import order_waiting
from lockstep.mem_cache.radix_cache import ChunkCache
from lockstep.multimodal.spans import chunk_take

# A waiting request sharing this many new tokens with one admitted this step waits a step, so
# that it reuses the other's KV from the tree instead of computing the same prefix twice.
IN_BATCH_PREFIX_THRESHOLD = 32


class Admitting(Protocol):
    """What admission reads and changes of its scheduler (lockstep.managers.scheduler.Scheduler)."""

    args: Any
    allocator: Any
    req_to_token_pool: Any
    tree: Any
    rng: Any
    priorities: Any
    lora: Any
    loop: Any
    stats: Any
    step_count: int
    waiting: list[Req]
    running: list[Req]
    chunked_req: Req | None

    def future_tokens(self, req: Req) -> int: ...

    def alloc(self, n: int) -> torch.Tensor | None: ...

    def lora_in_use(self, admitted: list[Req]) -> list[Any]: ...


def admit_waiting(sched: Admitting, admitted: list[Req], locs: list[torch.Tensor], budget: int) -> None:
    """Admits waiting requests into `admitted` (their new KV in `locs`) within `budget` tokens."""
    available = sched.allocator.available_size() + sched.tree.evictable_size()
    reserved = sum(map(sched.future_tokens, sched.running))
    reserved += sum(r.seq_len - r.kv.cached_len for r in admitted)
    order = order_waiting(sched.args.schedule_policy, sched.waiting, sched.tree, sched.rng)
    for req in sched.priorities.order(order):
        if budget <= 0:
            break
        if req.lora is not None and not sched.lora.make_resident(  # else it waits for a slot
                req.lora, sched.lora_in_use(admitted), sched.step_count, sched.loop.resolve):
            continue
        for attempt in range(2):  # matched again after preempting: the tree changed
            fill = req.prefix_key
            indices, node = sched.tree.match_prefix(fill)
            limit = len(fill) - 1
            if req.prompt_logprob_start is not None:
                limit = min(limit, req.prompt_logprob_start)
            prefix = min(int(indices.numel()), limit)
            shares = _shares_new_prefix(sched.tree, fill, prefix, admitted)
            extend = len(fill) - prefix
            need = extend + sched.future_tokens(req)
            slot_short = (len(sched.running) + len(admitted) >= sched.args.max_running_requests
                          or sched.req_to_token_pool.available_size() == 0)
            if attempt or shares or not (slot_short or reserved + need > available):
                break
            room = sched.priorities.preempt(sched, req, reserved + need - available, slot_short)
            if room is None:
                break
            available += room
        if slot_short:
            break
        if shares:
            continue
        if reserved + need > available:
            break
        sched.tree.inc_lock_ref(node)
        take = chunk_take(req.images, prefix, min(extend, budget), extend)
        loc = sched.alloc(take)
        if loc is None:
            sched.tree.dec_lock_ref(node)
            break
        kv = req.kv
        kv.req_pool_idx = sched.req_to_token_pool.alloc()
        sched.req_to_token_pool.req_to_token[kv.req_pool_idx, :prefix] = indices[:prefix]
        kv.last_node, kv.prefix_len = node, prefix
        kv.cached_len, kv.device_len = prefix, prefix + take
        if not req.output_ids:
            req.cached_tokens = prefix
            sched.stats.cached_tokens += prefix
        req.phase = ReqPhase.PREFILL
        sched.waiting.remove(req)
        admitted.append(req)
        locs.append(loc)
        budget -= take
        reserved += need
        if take < extend:
            sched.chunked_req = req
            break

def _shares_new_prefix(tree: Any, fill: list[int], prefix: int, admitted: list[Req]) -> bool:
    if isinstance(tree, ChunkCache) or len(fill) - prefix <= IN_BATCH_PREFIX_THRESHOLD:
        return False
    new = fill[prefix:prefix + IN_BATCH_PREFIX_THRESHOLD]  # shared whole by another: wait
    return any(other.prefix_key[prefix:prefix + IN_BATCH_PREFIX_THRESHOLD] == new
               for other in admitted)
