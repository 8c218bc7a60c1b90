"""Prometheus metrics of the front process, fed by the TokenizerManager's observer hook. SGLang
0.5's figures carry its names, labels and buckets, so its Grafana dashboards work unchanged;
lockstep-only ones are lockstep:*. The scheduler's figures carry rank 0's labels: every rank of a
replica holds the same state, and with several replicas the figure is their sum."""

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

from lockstep.core import FINISH_ABORT
from lockstep.entrypoints.tokenizer_manager import ReqState, TokenizerManager, spec_rates
from lockstep.messages import ReqOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # the *_created series only double the scrape

# SGLang's default buckets.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = TTFT_BUCKETS + (600, 1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)


class Metrics:
    """Counters and histograms fed per output, gauges read at scrape time. Queued = admitted
    but no token yet; token_usage counts the prompt and output tokens of live requests against
    the KV pool (the prefix cache's idle entries excluded)."""

    def __init__(self, tm: TokenizerManager, model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine_type": "unified"}
        names = list(self.labels)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, names + list(extra), registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *extra: str) -> Histogram:
            return Histogram(name, doc, names + list(extra), buckets=buckets, registry=reg)

        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.",
                                     "is_streaming")
        self.generation_tokens = counter("sglang:generation_tokens",
                                         "Number of generation tokens processed.", "is_streaming")
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens by "
                                     "source (device/host/storage).", "cache_source"
                                     ).labels(cache_source="device", **self.labels)
        self.requests = counter("sglang:num_requests", "Number of requests processed.",
                                "is_streaming")
        self.aborted = counter("sglang:num_aborted_requests", "Number of requests aborted."
                               ).labels(**self.labels)
        self.by_reason = counter("lockstep:num_requests", "Finished requests by finish reason.",
                                 "finish_reason")
        self.ttft = histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS,
                              "is_streaming")
        self.itl = histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS
                             ).labels(**self.labels)
        self.tpot = histogram("sglang:request_time_per_output_token_seconds",
                              "Per-request TPOT in seconds: (finished_time - first_token_time) "
                              "/ (completion_tokens - 1).", ITL_BUCKETS, "is_streaming")
        self.e2e = histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds", E2E_BUCKETS,
                             "is_streaming")
        states = tm.states.values
        gauges = {
            "sglang:num_running_reqs": ("The number of running requests.", lambda: sum(
                s.first_token_time is not None for s in states())),
            "sglang:num_queue_reqs": ("The number of requests in the waiting queue.", lambda: sum(
                s.first_token_time is None for s in states())),
            "sglang:token_usage": ("The token usage.", lambda: min(
                1.0, sum(s.out.prompt_tokens + len(s.out.output_ids) for s in states())
                / max(1, tm.max_total_num_tokens))),
            "sglang:cache_hit_rate": ("The prefix cache hit rate.",
                                      lambda: self._cached_total / max(1, self._prompt_total)),
            "sglang:max_total_num_tokens": ("Maximum total number of tokens in the KV cache pool.",
                                            lambda: tm.max_total_num_tokens),
            "sglang:context_len": ("Maximum context length.", lambda: tm.context_len),
            # Speculative decoding over the finished requests that drafted: SGLang's names.
            "sglang:spec_accept_rate": ("The average acceptance rate of speculative decoding "
                                        "(accepted tokens / draft tokens).",
                                        lambda: spec_rates(*self._spec)[0]),
            "sglang:spec_accept_length": ("The average acceptance length of speculative "
                                          "decoding (tokens per verify pass).",
                                          lambda: spec_rates(*self._spec)[1]),
        }
        if tm.image_inputs is not None:  # a model that reads images; a text server shows none
            gauges.update({  # running totals, summed over replicas
                "lockstep:image_encoder_runs": ("Images the vision tower encoded.",
                                                lambda: sum(r for r, _ in self._encoder.values())),
                "lockstep:image_encoder_hits": ("Image lookups served by the encoder cache.",
                                                lambda: sum(h for _, h in self._encoder.values())),
            })
        ranks = {"tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, names + list(ranks), registry=reg
                  ).labels(**self.labels, **ranks).set_function(fn)
        self._prompt_total = 0
        self._cached_total = 0
        self._spec = [0, 0, 0]  # verify passes, draft tokens, accepted draft tokens
        self._encoder: dict[int, tuple[int, int]] = {}  # by replica: the latest (runs, hits)
        tm.observers.append(self.observe)

    def observe(self, state: ReqState, out: ReqOutput, now: float) -> None:
        """Called with each output before the request's state takes it in."""
        streaming = {"is_streaming": "true" if state.stream else "false", **self.labels}
        if out.encoder is not None:
            self._encoder[out.dp_rank] = out.encoder
        if state.outputs_seen == 0:
            self.prompt_tokens.labels(**streaming).inc(out.prompt_tokens)
            self.cached_tokens.inc(out.cached_tokens)
            self._prompt_total += out.prompt_tokens
            self._cached_total += out.cached_tokens
        n = len(out.new_token_ids)
        if n:
            self.generation_tokens.labels(**streaming).inc(n)
            last = state.last_token_time
            if last is None:
                self.ttft.labels(**streaming).observe(now - state.created)
            else:
                for _ in range(n):
                    self.itl.observe((now - last) / n)
        if (reason := out.finish_reason) is None:
            return
        self.requests.labels(**streaming).inc()
        self.by_reason.labels(finish_reason=reason.type, **self.labels).inc()
        self.e2e.labels(**streaming).observe(now - state.created)
        if out.spec is not None:  # the request's totals, on its last output
            self._spec = [a + b for a, b in zip(self._spec, out.spec)]
        if isinstance(reason, FINISH_ABORT):
            self.aborted.inc()
        elif out.completion_tokens > 1 and state.first_token_time is not None:
            self.tpot.labels(**streaming).observe(
                (now - state.first_token_time) / (out.completion_tokens - 1))

    def render(self) -> bytes:
        """The Prometheus text format (CONTENT_TYPE is its media type)."""
        return generate_latest(self.registry)
