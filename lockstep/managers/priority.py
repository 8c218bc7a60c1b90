"""Request priorities, as SGLang's `--enable-priority-scheduling` defines them: a request's
`priority` (an integer; by default a larger one is more urgent, with
`--schedule-low-priority-values-first` a smaller one) orders the waiting queue before the schedule
policy does, and a waiting request that cannot be admitted for want of KV or a running slot
preempts running requests less urgent than it by more than
`--priority-scheduling-preemption-threshold`: they are retracted (their KV goes to the prefix
tree, as any retraction's) and resumed later with the same output.

Every decision here is a pure function of the requests' priorities, arrival steps, rids and KV
lengths, the same on every rank (the scheduler's determinism rules)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from lockstep.managers.schedule_batch import Req
from lockstep.server_args import ServerArgs

# What an unset priority means when no --default-priority-value is given: the least urgent
# there is (SGLang's choice), so a request that names none never preempts one that does.
LEAST_URGENT_HIGH_FIRST = -sys.maxsize - 1
LEAST_URGENT_LOW_FIRST = sys.maxsize
DISABLED = ("priority: this server does not schedule by priority; start it with "
            "--enable-priority-scheduling, or omit priority")


class Preempting(Protocol):
    """What preemption uses of its scheduler (lockstep.managers.scheduler.Scheduler)."""

    running: list[Req]
    allocator: Any
    tree: Any
    loop: Any

    def future_tokens(self, req: Req) -> int: ...

    def retract(self, victim: Req) -> None: ...


class PriorityRule:
    """The server's priority settings, and every decision they make."""

    def __init__(self, args: ServerArgs) -> None:
        self.enabled = args.enable_priority_scheduling
        self.preempts = self.enabled and not args.disable_priority_preemption
        self.low_first = args.schedule_low_priority_values_first
        self.threshold = args.priority_scheduling_preemption_threshold
        least = LEAST_URGENT_LOW_FIRST if self.low_first else LEAST_URGENT_HIGH_FIRST
        self.default = args.default_priority_value if args.default_priority_value is not None else least

    def resolve(self, priority: int | None) -> tuple[int, str | None]:
        """The request's priority, or why it is refused (a 400)."""
        if priority is None:
            return (self.default if self.enabled else 0), None
        if not self.enabled:
            return 0, DISABLED
        return priority, None

    def urgency(self, req: Req) -> int:
        """Larger is more urgent, whichever way the server reads priority values."""
        return -req.priority if self.low_first else req.priority

    def order(self, ordered: list[Req]) -> list[Req]:
        """The policy's order, most urgent first (a stable sort: the policy orders each level)."""
        if not self.enabled:
            return ordered
        return sorted(ordered, key=lambda r: -self.urgency(r))

    def retract_order(self, req: Req) -> int:
        """Leading key of the KV-short retraction's choice: the least urgent goes first."""
        return self.urgency(req) if self.enabled else 0

    def victims(self, req: Req, running: Iterable[Req], tokens_short: int, slot_short: bool,
                frees: Callable[[Req], int]) -> list[Req]:
        """The running requests to preempt so that `req` fits: least urgent first (the latest to
        arrive first among equals), each less urgent than `req` by more than the threshold, until
        they free `tokens_short` tokens (by `frees`) and, if `slot_short`, a running slot. Empty
        when they cannot: then nobody is preempted."""
        if not self.preempts:
            return []
        mine = self.urgency(req)
        candidates = sorted((r for r in running if mine - self.urgency(r) > self.threshold),
                            key=lambda r: (self.urgency(r), -r.arrival, r.rid))
        chosen: list[Req] = []
        for r in candidates:
            if tokens_short <= 0 and (chosen or not slot_short):
                break
            chosen.append(r)
            tokens_short -= frees(r)
        if tokens_short > 0 or (slot_short and not chosen):
            return []
        return chosen

    def preempt(self, sched: Preempting, req: Req, tokens_short: int, slot_short: bool
                ) -> int | None:
        """Retract running requests less urgent than `req` so that it fits: the room that made
        (KV free or evictable, less what the running requests reserve), or None if it could
        not."""
        def room() -> int:
            free = sched.allocator.available_size() + sched.tree.evictable_size()
            return free - sum(map(sched.future_tokens, sched.running))

        def frees(r: Req) -> int:
            return r.kv.device_len + sched.future_tokens(r)

        if not self.victims(req, sched.running, tokens_short, slot_short, frees):
            return None  # nobody to preempt: a batch in flight is left to run on
        before = room()
        sched.loop.resolve()  # the victims' outputs must be real before they are retracted
        chosen = self.victims(req, sched.running, tokens_short, slot_short, frees)
        for victim in chosen:
            sched.retract(victim)
        return room() - before if chosen else None
