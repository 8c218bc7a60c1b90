"""`--quantization`: pack a float (safetensors) checkpoint's weights into GGML blocks at load, so
it runs on the same block kernels as a GGUF (`lockstep.kernels`, see block_weight.py); with
--dtype bfloat16 on a CPU with AMX, on the AMX bfloat16 kernels over the same blocks.

Every linear, the embedding table and the LM head are packed; norms and biases stay float. The
kernels take float32 activations and run on the CPU, so the flag needs both; a GGUF's weights are
blocks already. Imported by server_args for its choices: keep this module free of torch."""

from __future__ import annotations

# --quantization METHOD -> the GGML block type the weights are packed into.
QUANTIZATION_TYPES = {
    "q8_0": "Q8_0",  # int8 per block of 32 with a float16 scale: 8.5 bits a weight
    "q4_0": "Q4_0",  # 4 bits per block of 32 with a float16 scale: 4.5 bits a weight
    "fp16": "F16",  # float16 weights, float32 compute
}
QUANTIZATION_METHODS = tuple(QUANTIZATION_TYPES)


def quantization_problems(method: str | None, device: str, dtype: str) -> list[str]:
    """What is wrong with `--quantization method` beside --device / --dtype (names as on the
    command line), each saying what to change; empty when they combine."""
    if method is None:
        return []
    if method not in QUANTIZATION_TYPES:
        return [f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, not {method!r}"]
    problems = []
    if device != "cpu":
        problems.append(f"--quantization {method} packs weights for the CPU kernels: serve it "
                        "with --device cpu, or drop --quantization and use --dtype float16 or "
                        "bfloat16 on a GPU")
    if dtype == "bfloat16" and device == "cpu":
        if lacking := _amx_bf16_lacking():
            problems.append(f"--quantization {method} with --dtype bfloat16 runs the AMX bfloat16 "
                            f"kernels, and this CPU lacks the flag(s) {', '.join(lacking)}: use "
                            "--dtype auto or float32 instead of --dtype bfloat16, or drop "
                            "--quantization")
    elif dtype not in ("auto", "float32"):
        problems.append(f"--quantization {method} runs float32 activations on the packed "
                        f"weights (or bfloat16 ones on an AMX CPU): use --dtype auto or float32 "
                        f"instead of --dtype {dtype}, or drop --quantization")
    return problems


def _amx_bf16_lacking() -> list[str]:
    # Imported here: the kernels' build module imports torch, which this module's importers avoid.
    from lockstep.kernels.build import missing_flags

    return missing_flags("amx_bf16")


def int8_activation_problems(enabled: bool | None, device: str, dtype: str,
                             quantization: str | None) -> list[str]:
    """What is wrong with an explicit `--int8-activations` beside --device / --dtype /
    --quantization, each saying what to change; empty when they combine, when it is off, or when
    it is the default (None: on only where it applies)."""
    if not enabled:
        return []
    problems = []
    if device != "cpu":
        problems.append("--int8-activations runs the CPU block kernels: serve it with --device cpu, "
                        "or drop --int8-activations")
    if dtype not in ("auto", "float32"):
        problems.append(f"--int8-activations quantizes float32 activations to int8: use --dtype "
                        f"auto or float32 instead of --dtype {dtype}, or drop --int8-activations")
    if QUANTIZATION_TYPES.get(quantization or "") in ("F16", "BF16", "F32"):
        problems.append(f"--int8-activations multiplies integer weight blocks, and --quantization "
                        f"{quantization} packs float ones: use --quantization q8_0 or q4_0, or drop "
                        "--int8-activations")
    return problems

