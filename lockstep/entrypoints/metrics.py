"""Prometheus metrics of the front process, fed by the TokenizerManager's observer hook."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from lockstep.entrypoints.tokenizer_manager import ReqState, TokenizerManager
from lockstep.messages import ReqOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # the *_created series only double the scrape


class Metrics:
    """Prometheus metrics fed by the tokenizer manager's observer hook, plus gauges read at
    scrape time. Queued = admitted to the server but no token yet; KV usage counts the prompt and
    output tokens of live requests against the pool (the prefix cache's idle entries excluded)."""

    def __init__(self, tm: TokenizerManager, model_name: str) -> None:
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]
        self.labels = {"model_name": model_name}
        self.prompt_tokens = Counter("lockstep:prompt_tokens", "Prompt tokens processed.",
                                     labels, registry=reg).labels(**self.labels)
        self.generation_tokens = Counter("lockstep:generation_tokens", "Tokens generated.",
                                         labels, registry=reg).labels(**self.labels)
        self.cached_tokens = Counter("lockstep:cached_tokens",
                                     "Prompt tokens served from the prefix cache.",
                                     labels, registry=reg).labels(**self.labels)
        self.requests = Counter("lockstep:num_requests", "Finished requests by finish reason.",
                                ["model_name", "finish_reason"], registry=reg)
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
        self.ttft = Histogram("lockstep:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=latency, registry=reg).labels(**self.labels)
        self.itl = Histogram("lockstep:inter_token_latency_seconds",
                             "Time between consecutive output tokens.", labels,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                      0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0), registry=reg
                             ).labels(**self.labels)
        self.e2e = Histogram("lockstep:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=latency, registry=reg).labels(**self.labels)
        states = tm.states.values
        gauges = {
            "lockstep:num_running_reqs": ("Requests generating tokens.", lambda: sum(
                s.first_token_time is not None for s in states())),
            "lockstep:num_queue_reqs": ("Requests waiting for their first token.", lambda: sum(
                s.first_token_time is None for s in states())),
            "lockstep:token_usage": ("Share of the KV pool held by live requests.", lambda: min(
                1.0, sum(len(s.prompt_ids) + len(s.output_ids) for s in states())
                / max(1, tm.max_total_num_tokens))),
            "lockstep:cache_hit_rate": ("Prompt tokens served from the prefix cache / all.",
                                        lambda: self._cached_total / max(1, self._prompt_total)),
            "lockstep:max_total_num_tokens": ("KV pool size in tokens.",
                                              lambda: tm.max_total_num_tokens),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, labels, registry=reg).labels(**self.labels).set_function(fn)
        self._prompt_total = 0
        self._cached_total = 0
        tm.observers.append(self.observe)

    def observe(self, state: ReqState, out: ReqOutput, now: float) -> None:
        """Called with each output before the request's state takes it in."""
        if state.outputs_seen == 0:
            self.prompt_tokens.inc(out.prompt_tokens)
            self.cached_tokens.inc(out.cached_tokens)
            self._prompt_total += out.prompt_tokens
            self._cached_total += out.cached_tokens
        n = len(out.new_token_ids)
        if n:
            self.generation_tokens.inc(n)
            last = state.last_token_time
            if last is None:
                self.ttft.observe(now - state.created)
            else:
                for _ in range(n):
                    self.itl.observe((now - last) / n)
        if out.finish_reason is not None:
            self.e2e.observe(now - state.created)
            self.requests.labels(finish_reason=out.finish_reason.type, **self.labels).inc()

    def render(self) -> bytes:
        """The Prometheus text format (CONTENT_TYPE is its media type)."""
        return generate_latest(self.registry)
