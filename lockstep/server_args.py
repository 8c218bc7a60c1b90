"""Server arguments: one frozen dataclass, the table the command line is built from, with SGLang's
names (`--model-path`, `--tp-size`, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import uuid
from dataclasses import dataclass, fields
from typing import Any

from lockstep.function_call.registry import TOOL_CALL_PARSERS
from lockstep.layers.quantization import (
    QUANTIZATION_METHODS,
    int8_activation_problems,
    quantization_problems,
)
from lockstep.lora.adapter import lora_arg_problems
from lockstep.model_loader.packaged import DEFAULT_MODEL, PACKAGED_MODELS
from lockstep.utils.flags import add_flags, below_min, flag
from lockstep.utils.process import free_port

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "minimum_tokens", "total_requests",
                        "total_tokens", "cache_aware")


@dataclass(frozen=True)
class ServerArgs:
    """Every server option, and the one table the command line is built from (`add_cli_args`,
    lockstep.utils.flags); /get_server_info hides the secret ones."""

    model_path: str | None = flag(
        DEFAULT_MODEL, "GGUF file, HF directory, or a packaged model's short name: "
        f"{', '.join(PACKAGED_MODELS)} (`lockstep models` says more).", "model")
    tokenizer_path: str | None = flag(None, "Defaults to the model's own.", "model")
    is_embedding: bool = flag(
        False, "Serve the model's pooled vectors (/v1/embeddings, /encode) instead of text: for a "
               "decoder, its last token's normalized state. Encoders (BERT), sentence-transformers "
               "directories and cross-encoder rerankers are detected from their files without it "
               "(docs/embeddings.md).", "model")
    served_model_name: str | None = flag(None, "Name in /v1/models.", "model")
    chat_template: str | None = flag(
        None, "Built-in name (gemma, llama3, chatml) or a Jinja file. qwen3-reranker (SGLang's "
              "qwen3_reranker) serves a decoder as a yes/no reranker (/v1/rerank): Qwen3-Reranker, "
              "found by its name without it (docs/embeddings.md).", "model")
    tool_call_parser: str | None = flag(
        None, "How tool calls are read from the model's replies under tool_choice 'auto' "
              "(SGLang's names). Default: the model family's format (Qwen2/3: qwen25, "
              "Llama: llama3); Gemma 3 has none.", "model", choices=list(TOOL_CALL_PARSERS))
    reasoning_parser: str | None = flag(
        None, "Split a reasoning model's thinking block off its chat replies into "
              "reasoning_content (SGLang's names: qwen3, qwen3-thinking, deepseek-r1, glm45, "
              "kimi, step3).", "model")
    dtype: str = flag("auto", "auto: float32 on a CPU (block weights; activations int8 per "
                              "block where --int8-activations applies, else float32; a "
                              "request's numbers independent of its batch), bfloat16 on CUDA.",
                      "model", choices=["auto", "float32", "bfloat16", "float16"])
    device: str = flag("cpu", "cpu or cuda.", "model", choices=["cpu", "cuda"])
    quantization: str | None = flag(
        None, "Pack a float (safetensors) model's weights into GGML blocks at load, for the CPU "
              "block kernels (a GGUF is in blocks already): q8_0, q4_0 or fp16 weights, float32 "
              "activations (--device cpu, --dtype auto or float32).", "model",
        choices=list(QUANTIZATION_METHODS))
    int8_activations: bool | None = flag(
        None, "CPU: multiply the integer weight blocks (every type docs/quant_types.md gives an int8 "
              "kernel) by activations "
              "quantized per block of 32 to int8 (llama.cpp's arithmetic) at every batch size, so a "
              "request's numbers still do not depend on its batch. Default: on wherever it applies "
              "(--device cpu, --dtype auto/float32, integer blocks: a GGUF or --quantization "
              "q8_0/q4_0, a compiled int8 kernel): integer dots do a block's multiply-adds in "
              "fewer instructions than dequantizing it to float32 (figures: "
              "docs/benchmarks.md, \"int8 activations by default\"). --no-int8-activations "
              "serves the exact float32 path (how closely the two agree: "
              "docs/benchmarks.md, \"Agreement with float32\").",
        "model")
    kv_cache_dtype: str = flag(
        "auto", "Type of the K/V cache. auto: float16 where int8 activations are on (llama.cpp's "
                "KV cache type; half the memory and half the bytes each decode step reads), else "
                "--dtype's, so the exact float32 path stays float32 throughout.", "model",
        choices=["auto", "float32", "bfloat16", "float16"])
    context_length: int | None = flag(None, "Override the model's.", "model")
    host: str = flag("127.0.0.1", "Address to listen on.", "server")
    port: int = flag(30000, "Port to listen on.", "server")
    api_key: str | None = flag(None, "Bearer key required on every route but /health.", "server",
                                secret=True)
    log_level: str = flag("info", "Log level of every process.", "server",
                          choices=["debug", "info", "warning", "error"])
    incremental_streaming_output: bool = flag(
        False, "Stream only the new text in each /generate event.", "server")
    graceful_shutdown_timeout: float = flag(
        20.0, "On SIGTERM: refuse new requests (503) and let running ones finish for up to this "
              "many seconds, then abort the rest and exit.", "server", min=0)
    max_request_body_bytes: int = flag(
        32 * 1024 * 1024, "Largest request body accepted; larger get 413.", "server",
        min=1)
    timeout_request_read: float = flag(
        60.0, "Seconds a request may take to arrive whole (headers and body) from its first "
              "byte; a slower client gets 408 and is disconnected.", "server", min=0.001)
    timeout_keep_alive: float = flag(
        30.0, "Seconds a connection may sit idle, before its first request or between two, "
              "before it is closed.", "server", min=0.001)
    max_connections: int = flag(
        1000, "Most client connections open at once; one opened beyond gets 503 with "
              "Retry-After and is closed.", "server", min=1)
    max_prompt_tokens: int | None = flag(
        None, "Longest prompt accepted, in tokens (default: the context length - 1).", "server",
        min=1)
    max_batch_size: int = flag(
        1024, "Most generations one HTTP request may fan out into (prompts x n); more get 400.",
        "server", min=1)
    responses_store_max_items: int = flag(
        1000, "Most responses /v1/responses keeps (store: true); past it the oldest is evicted.",
        "server", min=1)
    responses_store_max_bytes: int = flag(
        64 * 1024 * 1024, "Most bytes of stored responses (JSON, conversations included); past "
                          "it the oldest are evicted.", "server", min=1)
    responses_store_file: str | None = flag(
        None, "Keep the stored responses in this file across restarts (rewritten atomically "
              "after each change).", "server")
    allow_image_urls: bool = flag(
        False, "Fetch http(s) image URLs (image_url parts, image_data); off: data URLs and base64 "
               "only. Local paths are never read.", "images")
    max_image_bytes: int = flag(20 << 20, "Largest image accepted, encoded, in bytes.", "images", min=1)
    max_images_per_request: int = flag(16, "Most images one prompt may hold.", "images", min=1)
    max_total_tokens: int | None = flag(None, "KV pool size in tokens.", "memory")
    mem_fraction_static: float = flag(
        0.2, "Share of free memory for the KV pool when --max-total-tokens is unset.", "memory")
    max_running_requests: int = flag(64, "Most requests decoding at once.", "memory", min=1)
    max_queued_requests: int | None = flag(
        None, "Most requests waiting beyond the running ones; past it a 503 with Retry-After.",
        "memory", min=0)
    schedule_policy: str = flag(
        "fcfs", "Order in which waiting requests are admitted (lpm: longest prefix match).",
        "scheduling", choices=list(SCHEDULE_POLICIES))
    enable_priority_scheduling: bool = flag(
        False, "Admit waiting requests by their `priority` first, then by --schedule-policy, and "
               "let a request preempt (retract, to resume later with the same output) running "
               "ones less urgent than it when KV or running slots are short. Without it a "
               "request's priority is a 400.", "scheduling")
    disable_priority_preemption: bool = flag(
        False, "With priorities: order the queue by them but never preempt.", "scheduling")
    schedule_low_priority_values_first: bool = flag(
        False, "With priorities: a smaller value is more urgent (default: a larger one).",
        "scheduling")
    priority_scheduling_preemption_threshold: int = flag(
        10, "With priorities: a request preempts only running ones less urgent than it by more "
            "than this.", "scheduling", min=0)
    default_priority_value: int | None = flag(
        None, "With priorities: the priority of a request that gives none (default: the least "
              "urgent there is).", "scheduling")
    chunked_prefill_size: int = flag(
        512, "Max prefill tokens per step; -1 disables chunking.", "scheduling")
    enable_mixed_chunk: bool = flag(
        False, "Run prefill chunks and decodes in one batch.", "scheduling")
    disable_radix_cache: bool = flag(
        False, "Do not share KV between requests with a common prefix.", "scheduling")
    enable_overlap_schedule: bool | None = flag(
        None, "Run the model on a forward thread while the scheduler processes the previous "
              "batch's result and prepares the next one (never with --pp-size > 1). Default: "
              "on with --device cuda; off on cpu, where the scheduler's work is a sliver of a "
              "step, so there is little to hide, and the thread competes with the forward for "
              "the same cores (docs/benchmarks.md, \"Overlap scheduling\").", "scheduling",
        aliases={"--disable-overlap-schedule": False})
    new_token_ratio: float = flag(
        0.7, "Initial estimate of max_new_tokens actually used.", "scheduling")
    random_seed: int = flag(0, "Seed of the sampling of requests that give none.", "scheduling")
    enable_lockstep_check: int = flag(
        0, "Every N steps the ranks compare schedule fingerprints (0 = off).", "scheduling")
    debug_fingerprints: bool = flag(False, "Record per-step schedule fingerprints.", "scheduling")
    watchdog_timeout: float = flag(
        300.0, "Seconds a scheduler, the detokenizer or the DP controller may hold work without "
               "finishing a step (a message) before it dumps every thread's stack to the log and "
               "brings the server down (0 = off).",
        "scheduling", min=0)
    speculative_algorithm: str | None = flag(
        None, "NGRAM: each decoding request drafts its next tokens from n-grams of its own prompt "
              "and output (and of recent requests), and one pass verifies them; the output is "
              "bitwise the same as without it. NONE: off. Default: NGRAM on cpu, where a step "
              "costs its weight reads whatever its few rows, so verifying drafted tokens in one "
              "pass is nearly free, and a request drafts beside others only while its drafts are "
              "taken whole (docs/benchmarks.md, \"Speculation by default\"); off on cuda and "
              "with --enable-overlap-schedule.",
        "speculative decoding", choices=["NGRAM", "NONE"],
        aliases={"--disable-speculative-decoding": "NONE"})
    speculative_num_draft_tokens: int = flag(
        15, "Most draft tokens one verify pass checks per request (15: a request's verify pass is "
            "then 16 rows, one group of lanes of the CPU int8 kernels, whose cost is flat up to "
            "a full group; docs/benchmarks.md, \"Cheaper few-row int8 dots\").",
        "speculative decoding", min=1)
    # the windows are narrower than SGLang's 1..12: the drafter's index costs a dict entry per token
    # and window size, and a one-token match drafts mostly noise
    speculative_ngram_min_match_window_size: int = flag(
        2, "Shortest suffix (tokens) matched to draft.", "speculative decoding", min=1)
    speculative_ngram_max_match_window_size: int = flag(
        6, "Longest suffix (tokens) matched to draft.", "speculative decoding", min=1)
    speculative_ngram_capacity: int = flag(
        100_000, "N-grams of finished requests kept for drafting.", "speculative decoding", min=0)
    enable_lora: bool = flag(False, "Serve LoRA adapters (implied by --lora-paths; docs/lora.md).", "lora")
    lora_paths: list[str] = flag(
        [], "Adapters loaded at start (PEFT directories, or llama.cpp's LoRA GGUFs), as name=path, "
            "or JSON: {\"lora_name\": ..., \"lora_path\": ...} (SGLang's) or {\"name\": ..., "
            "\"path\": ...} (vLLM's). A request names its adapter: lora_path on /generate, model "
            "'base:name' or 'name' on the OpenAI routes. --lora-modules: vLLM's name.", "lora",
        names=["--lora-modules"])
    max_loras_per_batch: int = flag(
        8, "Adapters resident at once (one batch mixes at most this many); requests for others "
           "wait until a slot frees. --max-loras: vLLM's name.", "lora", min=1, names=["--max-loras"])
    max_lora_rank: int | None = flag(
        None, "Largest adapter rank this server loads. Default: the largest of --lora-paths "
              "(64 without them).", "lora", min=1)
    lora_target_modules: list[str] = flag(
        [], "Modules adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, "
            "or all. Default: those of --lora-paths (all without them).", "lora")
    max_loaded_loras: int | None = flag(
        None, "Most adapters held in host memory (POST /load_lora_adapter beyond it is a 400). "
              "Default: no limit. --max-cpu-loras: vLLM's name.", "lora", min=1,
        names=["--max-cpu-loras"])
    lora_dtype: str = flag(
        "auto", "What the resident adapters' A and B are held in (vLLM's --lora-dtype). auto: int8 "
                "with a scale per row where activations are int8 (a decode step streams every "
                "adapter row's weights: fewer bytes, a faster step), else the model's dtype "
                "(docs/lora.md, \"Precision\").", "lora",
        choices=["auto", "float32", "bfloat16", "float16", "int8"])
    tp_size: int = flag(1, "Tensor-parallel ranks per replica.", "parallelism", min=1)
    pp_size: int = flag(1, "Pipeline stages per replica.", "parallelism", min=1)
    pp_micro_batches: int | None = flag(
        None, "With --pp-size > 1: split each batch by requests into up to this many "
              "micro-batches that the stages work on at once (1: one batch at a time). "
              "Default: --pp-size on cuda, 1 on cpu, where a decode step reads every weight "
              "whatever its rows, so each slice pays that read again "
              "(docs/benchmarks.md, \"Pipeline micro-batches\").", "parallelism", min=1)
    dp_size: int = flag(1, "Data-parallel replicas.", "parallelism", min=1)
    load_balance_method: str = flag(
        "round_robin", "How the data-parallel controller picks a replica: in turn (round_robin), "
                       "or the one with the least load its replicas report (total_requests, "
                       "also shortest_queue: running + queued requests; total_tokens: prompt tokens "
                       "still to compute, then KV in use; minimum_tokens: KV in use), or by prefix "
                       "affinity (cache_aware).", "parallelism",
        choices=list(LOAD_BALANCE_METHODS))
    dp_cache_threshold: float = flag(
        0.5, "cache_aware: prefix match rate above which affinity wins.", "parallelism")
    dp_balance_abs_threshold: int = flag(
        32, "cache_aware: load gap (requests) past which the least-loaded replica wins.",
        "parallelism")
    dp_balance_rel_threshold: float = flag(
        1.0001, "cache_aware: ... and the max/min load ratio past which it wins.", "parallelism")
    nnodes: int = flag(1, "Number of machines.", "parallelism", min=1)
    node_rank: int = flag(0, "This machine's rank among --nnodes.", "parallelism")
    dist_init_addr: str | None = flag(
        None, "HOST:PORT of node 0 for torch.distributed.", "parallelism")

    def __post_init__(self) -> None:
        if self.model_path is None:  # Engine(model_path=None): the default, by its name
            object.__setattr__(self, "model_path", DEFAULT_MODEL)
        problems = below_min(self)
        if self.node_rank >= self.nnodes or self.node_rank < 0:
            problems.append("--node-rank must be in [0, nnodes)")
        if (self.tp_size * self.pp_size) % self.nnodes:
            problems.append("--nnodes must divide tp_size * pp_size")
        if self.dp_size > 1 and self.nnodes > 1:
            problems.append("--dp-size > 1 runs on one node; use the router across nodes")
        if self.nnodes > 1 and not self.dist_init_addr:
            problems.append("--dist-init-addr is required with --nnodes > 1")
        problems += quantization_problems(self.quantization, self.device, self.dtype)
        problems += int8_activation_problems(self.int8_activations, self.device, self.dtype,
                                             self.quantization)
        if (self.speculative_ngram_min_match_window_size
                > self.speculative_ngram_max_match_window_size):
            problems.append("--speculative-ngram-min-match-window-size must be <= the max one")
        problems += lora_arg_problems(self.lora_paths, self.lora_target_modules)
        if not 0 < self.mem_fraction_static < 1:
            problems.append("--mem-fraction-static must be in (0, 1)")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)

    @property
    def micro_batches(self) -> int:
        """--pp-micro-batches resolved: on a CPU a decode step reads every weight whatever its
        rows, so slicing a batch multiplies that cost and the stages gained less than it cost."""
        if self.pp_micro_batches is not None:
            return self.pp_micro_batches
        return self.pp_size if self.device == "cuda" else 1

    @property
    def overlap_schedule(self) -> bool:
        """Whether the schedulers run the overlap loop: on for cuda, off for cpu (where it did not
        pay) unless asked for. Never with pipeline stages (a forward thread would interleave their
        collectives with the scheduler's) or speculation (drafts need the last real tokens)."""
        if self.pp_size > 1 or self.enable_overlap_schedule is False or self.speculation:
            return False
        return self.device == "cuda" or bool(self.enable_overlap_schedule)

    @property
    def speculation(self) -> str | None:
        """--speculative-algorithm resolved: NGRAM on a CPU unless asked otherwise (its output is
        plain decoding's, bit for bit; a verify pass costs about a plain step's weight reads, and
        in a batch only requests whose drafts are taken whole draft:
        docs/benchmarks.md, "Speculation by default"); off on cuda, where the overlap loop is on, and beside an
        explicit --enable-overlap-schedule."""
        if self.speculative_algorithm is not None:
            return None if self.speculative_algorithm == "NONE" else self.speculative_algorithm
        return "NGRAM" if self.device == "cpu" and not self.enable_overlap_schedule else None

    def info(self) -> dict[str, Any]:
        """Every field for /get_server_info and Engine.get_server_info, secrets redacted. The
        two fields whose unset value is decided at launch show the decision (as SGLang's
        post-init resolution does): what runs, not None."""
        info = {f.name: "<redacted>" if f.metadata["secret"] and getattr(self, f.name)
                else getattr(self, f.name) for f in fields(self)}
        info.update(speculative_algorithm=self.speculation,
                    enable_overlap_schedule=self.overlap_schedule)
        return info

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field, filed under its group in --help (SGLang's name for it)."""
        add_flags(parser, ServerArgs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class PortArgs:
    """IPC endpoints and ports of one server instance, unique so two servers never collide."""

    tokenizer_ipc: str  # detokenizer -> tokenizer manager
    scheduler_input_ipc: str  # tokenizer manager (or DP controller) -> scheduler rank 0
    detokenizer_ipc: str  # scheduler -> detokenizer
    dist_init_addr: str  # host:port for torch.distributed
    dp_load_ipc: str = ""  # replica schedulers -> DP controller load reports

    @staticmethod
    def new(args: ServerArgs) -> PortArgs:
        base = f"ipc://{tempfile.gettempdir()}/lockstep-{uuid.uuid4().hex[:12]}"
        dist = args.dist_init_addr or f"127.0.0.1:{free_port()}"
        return PortArgs(f"{base}-tok", f"{base}-sched", f"{base}-detok", dist, f"{base}-load")

    def for_replica(self, dp_rank: int) -> PortArgs:
        """A replica's own input socket and torch.distributed rendezvous."""
        return dataclasses.replace(self,
                                   scheduler_input_ipc=f"{self.scheduler_input_ipc}-dp{dp_rank}",
                                   dist_init_addr=f"127.0.0.1:{free_port()}")
