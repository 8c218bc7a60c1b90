"""Server arguments: one frozen dataclass that feeds argparse defaults and help.

Names follow SGLang's (`--model-path`, `--tp-size`, ...) so SGLang users feel at home.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from lockstep.function_call.registry import TOOL_CALL_PARSERS

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "minimum_tokens", "cache_aware")
QUANTIZATION_METHODS = ("fp16",)


@dataclass(frozen=True)
class ServerArgs:
    # Model
    model_path: str | None = field(
        default=None, metadata={"help": "GGUF file or HF directory; default: Gemma 3 270M (bundled)."}
    )
    tokenizer_path: str | None = field(default=None, metadata={"help": "Defaults to the model's own."})
    served_model_name: str | None = field(default=None, metadata={"help": "Name in /v1/models."})
    chat_template: str | None = field(
        default=None, metadata={"help": "Built-in name (gemma, llama3, chatml) or a Jinja file."}
    )
    tool_call_parser: str | None = field(default=None, metadata={
        "help": "How tool calls are read from the model's replies under tool_choice 'auto' "
                "(SGLang's names). Default: the model family's format (Qwen2/3: qwen25, "
                "Llama: llama3); Gemma 3 has none.",
        "choices": list(TOOL_CALL_PARSERS)})
    dtype: str = field(
        default="auto",
        metadata={"help": "auto: bfloat16 on CUDA or a CPU with AVX512-BF16/AMX, else float32.",
                  "choices": ["auto", "float32", "bfloat16", "float16"]},
    )
    device: str = field(default="cpu", metadata={"help": "cpu or cuda.", "choices": ["cpu", "cuda"]})
    quantization: str | None = field(default=None, metadata={
        "help": "Weight-only quantisation of the linears and the LM head. fp16: float16 weights "
                "(FBGEMM), float32 compute; CPU with --dtype float32 only. About 2x faster "
                "decode here; greedy agreement with float32 in docs/benchmarks.md.",
        "choices": list(QUANTIZATION_METHODS)})
    context_length: int | None = field(default=None, metadata={"help": "Override the model's."})
    # Server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = field(default=None, metadata={"help": "Bearer key required on every route but /health."})
    log_level: str = field(default="info", metadata={"choices": ["debug", "info", "warning", "error"]})
    incremental_streaming_output: bool = field(
        default=False, metadata={"help": "Stream only the new text in each /generate event."}
    )
    graceful_shutdown_timeout: float = field(
        default=20.0,
        metadata={"help": "On SIGTERM: refuse new requests (503) and let running ones finish for up "
                          "to this many seconds, then abort the rest and exit."})
    max_request_body_bytes: int = field(
        default=32 * 1024 * 1024, metadata={"help": "Largest request body accepted; larger get 413."})
    max_prompt_tokens: int | None = field(
        default=None, metadata={"help": "Longest prompt accepted, in tokens (default: the context length - 1)."})
    max_batch_size: int = field(
        default=1024,
        metadata={"help": "Most generations one HTTP request may fan out into (prompts x n); more get 400."})
    # Memory
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV pool size in tokens."})
    mem_fraction_static: float = field(
        default=0.2, metadata={"help": "Share of free memory for the KV pool when --max-total-tokens is unset."}
    )
    max_running_requests: int = 64
    max_queued_requests: int | None = field(
        default=None,
        metadata={"help": "Most requests waiting beyond the running ones; past it a 503 with Retry-After."})
    # Scheduling
    schedule_policy: str = field(default="fcfs", metadata={"choices": list(SCHEDULE_POLICIES)})
    chunked_prefill_size: int = field(default=512, metadata={"help": "Max prefill tokens per step; -1 disables chunking."})
    enable_mixed_chunk: bool = field(default=False, metadata={"help": "Run prefill chunks and decodes in one batch."})
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = field(default=False, metadata={
        "help": "Run the plain step loop (schedule, run the batch, process its result, in turn) "
                "where overlap scheduling is the default: --device cuda. The overlap loop runs "
                "the model on a forward thread while the scheduler processes the previous "
                "batch's result and prepares the next one (never with --pp-size > 1)."})
    enable_overlap_schedule: bool = field(default=False, metadata={
        "help": "Run the overlap loop on --device cpu too, where it is off by default: there the "
                "scheduler is <1%% of a step, so it gained nothing measurable "
                "(docs/benchmarks.md)."})
    new_token_ratio: float = field(default=0.7, metadata={"help": "Initial estimate of max_new_tokens actually used."})
    random_seed: int = 0
    enable_lockstep_check: int = field(
        default=0, metadata={"help": "Every N steps the ranks compare schedule fingerprints (0 = off)."}
    )
    debug_fingerprints: bool = field(default=False, metadata={"help": "Record per-step schedule fingerprints."})
    watchdog_timeout: float = field(
        default=300.0,
        metadata={"help": "Seconds a scheduler may hold work without finishing a step before it dumps "
                          "every thread's stack to the log and brings the server down (0 = off)."})
    # Parallelism
    tp_size: int = 1
    pp_size: int = 1
    pp_micro_batches: int | None = field(default=None, metadata={
        "help": "With --pp-size > 1: split each batch by requests into up to this many "
                "micro-batches that the stages work on at once (1: one batch at a time). "
                "Default: --pp-size on cuda, 1 on cpu, where splitting measured 6-13%% slower "
                "(docs/benchmarks.md)."})
    dp_size: int = 1
    load_balance_method: str = field(default="round_robin", metadata={"choices": list(LOAD_BALANCE_METHODS)})
    dp_cache_threshold: float = field(
        default=0.5, metadata={"help": "cache_aware: prefix match rate above which affinity wins."})
    dp_balance_abs_threshold: int = field(
        default=32, metadata={"help": "cache_aware: load gap (requests) past which the least-loaded replica wins."})
    dp_balance_rel_threshold: float = field(
        default=1.0001, metadata={"help": "cache_aware: ... and the max/min load ratio past which it wins."})
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = field(default=None, metadata={"help": "HOST:PORT of node 0 for torch.distributed."})

    def __post_init__(self) -> None:
        problems = []
        for name in ("tp_size", "pp_size", "dp_size", "nnodes", "max_running_requests",
                     "max_request_body_bytes", "max_batch_size"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be >= 1")
        if self.pp_micro_batches is not None and self.pp_micro_batches < 1:
            problems.append("--pp-micro-batches must be >= 1")
        if self.node_rank >= self.nnodes or self.node_rank < 0:
            problems.append("--node-rank must be in [0, nnodes)")
        if (self.tp_size * self.pp_size) % self.nnodes:
            problems.append("--nnodes must divide tp_size * pp_size")
        if self.dp_size > 1 and self.nnodes > 1:
            problems.append("--dp-size > 1 runs on one node; use the router across nodes")
        if self.nnodes > 1 and not self.dist_init_addr:
            problems.append("--dist-init-addr is required with --nnodes > 1")
        for name in ("watchdog_timeout", "graceful_shutdown_timeout", "max_queued_requests"):
            value = getattr(self, name)
            if value is not None and value < 0:
                problems.append(f"--{name.replace('_', '-')} must be >= 0")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            problems.append("--max-prompt-tokens must be >= 1")
        if self.quantization and (self.device != "cpu" or self.dtype in ("bfloat16", "float16")):
            problems.append("--quantization fp16 runs on --device cpu with float32 activations; "
                            "on a GPU use --dtype float16 or bfloat16 instead")
        if self.disable_overlap_schedule and self.enable_overlap_schedule:
            problems.append("--disable-overlap-schedule and --enable-overlap-schedule contradict")
        if not 0 < self.mem_fraction_static < 1:
            problems.append("--mem-fraction-static must be in (0, 1)")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def micro_batches(self) -> int:
        """--pp-micro-batches resolved: on a CPU a decode step reads every weight whatever its
        rows, so slicing a batch multiplies that cost and the stages gained less than it cost."""
        if self.pp_micro_batches is not None:
            return self.pp_micro_batches
        return self.pp_size if self.device == "cuda" else 1

    @property
    def overlap_schedule(self) -> bool:
        """Whether the schedulers run the overlap loop, resolved from the flags and the device:
        on for cuda, off for cpu (where it did not pay) unless --enable-overlap-schedule.
        Pipeline stages exchange hidden states and sampled tokens on the forward path, which a
        forward thread would interleave with the scheduler's own collectives: plain loop there."""
        if self.disable_overlap_schedule or self.pp_size > 1:
            return False
        return self.device == "cuda" or self.enable_overlap_schedule

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_text)
                continue
            # With postponed annotations f.type is a string such as "int | None".
            base = str(f.type).replace(" | None", "").replace("Optional[", "").rstrip("]")
            kind = {"int": int, "float": float}.get(base, str)
            parser.add_argument(
                flag, type=kind, default=f.default, choices=f.metadata.get("choices"),
                help=f"{help_text} (default: {f.default})".strip(),
            )

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
        import tempfile
        import uuid

        from lockstep.utils.process import free_port

        base = f"ipc://{tempfile.gettempdir()}/lockstep-{uuid.uuid4().hex[:12]}"
        dist = args.dist_init_addr or f"127.0.0.1:{free_port()}"
        return PortArgs(f"{base}-tok", f"{base}-sched", f"{base}-detok", dist, f"{base}-load")

    def for_replica(self, dp_rank: int) -> PortArgs:
        """A replica's own input socket and torch.distributed rendezvous."""
        import dataclasses

        from lockstep.utils.process import free_port

        return dataclasses.replace(self, scheduler_input_ipc=f"{self.scheduler_input_ipc}-dp{dp_rank}",
                                   dist_init_addr=f"127.0.0.1:{free_port()}")
