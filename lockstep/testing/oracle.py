"""HF transformers as the correctness oracle for tests (never used on the serving path).

Each prompt runs alone (batch 1, no padding) with ``attn_implementation="eager"`` so that
sliding windows and soft-capping are applied exactly as the reference implementation does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lockstep.testing.hf_weights import hf_float_model

_MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


@dataclass
class OracleResult:
    output_ids: list[int]
    # log_softmax over the full raw logits (float32) of each chosen greedy token
    logprobs: list[float]
    # raw-logit gap between the chosen token and the runner-up at each step; where it is tiny
    # (random tiny models hit ~1e-6 now and then) another correct implementation may pick the
    # runner-up, so compare with ``greedy_matches`` rather than plain equality.
    margins: list[float] = field(default_factory=list)


def greedy_matches(actual_ids: list[int], expected: OracleResult, tie_tol: float = 1e-3) -> bool:
    """True if ``actual_ids`` equals the oracle's greedy output, allowing a near-tie divergence.

    Tokens must agree up to the first mismatch; a mismatch is accepted (and the rest of the
    sequence ignored, as it then legitimately differs) only where the oracle's top-2 logit margin
    at that step is below ``tie_tol``. Lengths must match.
    """
    if len(actual_ids) != len(expected.output_ids):
        return False
    for i, (a, e) in enumerate(zip(actual_ids, expected.output_ids)):
        if a != e:
            return i < len(expected.margins) and expected.margins[i] < tie_tol
    return True


def load_hf_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load (once per process, per (dir, dtype)) an eval-mode AutoModelForCausalLM."""
    key = (str(Path(model_dir).resolve()), dtype)
    model = _MODELS.get(key)
    if model is None:
        model = hf_float_model(model_dir, dtype)  # a GGUF's cache entry too
        _MODELS[key] = model
    return model


def clear_oracle_cache() -> None:
    _MODELS.clear()


_GGUF_READERS: dict[tuple[str, str], Any] | None = None  # while gguf_parsed_once() is active


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within: `gguf.GGUFReader` parses each file once and hands the same (read-only) reader to
    every later call. transformers parses the GGUF on each `from_pretrained(gguf_file=...)`, and
    Gemma 3 270M's 262k-entry vocabulary takes gguf ~20 s; sharing the reader changes
    nothing but the time. Re-entrant: a nested use shares the outer one's readers."""
    global _GGUF_READERS
    if _GGUF_READERS is not None:
        yield
        return
    import gguf
    import pytest

    real_reader, readers = gguf.GGUFReader, {}

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    _GGUF_READERS = readers
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(gguf, "GGUFReader", shared_reader)
            yield
    finally:
        _GGUF_READERS = None


def transformers_gguf_tokenizer(gguf_path: str | Path) -> Any:
    """transformers' own tokenizer of a GGUF (`from_pretrained(gguf_file=...)`: its converter
    reading the GGUF's vocabulary, not lockstep's), built once per process: it is read-only, and
    for Gemma 3 270M it takes tens of seconds to build."""
    return _transformers_gguf_tokenizer(os.path.realpath(gguf_path))


@functools.cache
def _transformers_gguf_tokenizer(gguf_path: str) -> Any:
    from transformers import AutoTokenizer

    with gguf_parsed_once():
        return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                             gguf_file=os.path.basename(gguf_path))


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers >= 5.2x renamed forward's `past_key_values` to `cache` (old name deprecated).
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.inference_mode()
def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    model: torch.nn.Module | None = None,
) -> list[OracleResult]:
    """Greedy-decode exactly ``max_new_tokens`` tokens for each prompt (no EOS stop), with the
    model in ``model_dir`` or an already modified ``model``."""
    model = model if model is not None else load_hf_model(model_dir, dtype)
    cache_kw = _cache_kwarg(model)
    results = []
    for prompt in prompts:
        if not prompt:
            raise ValueError("empty prompt")
        out_ids: list[int] = []
        logprobs: list[float] = []
        margins: list[float] = []
        input_ids = torch.tensor([prompt], dtype=torch.long)
        cache = None
        for _ in range(max_new_tokens):
            out = model(input_ids=input_ids, use_cache=True, **{cache_kw: cache})
            cache = _output_cache(out)
            logits = out.logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            top = torch.topk(logits, 2)
            tok = int(top.indices[0])
            out_ids.append(tok)
            logprobs.append(float(lp[tok]))
            margins.append(float(top.values[0] - top.values[1]))
            input_ids = torch.tensor([[tok]], dtype=torch.long)
        results.append(OracleResult(output_ids=out_ids, logprobs=logprobs, margins=margins))
    return results


@torch.inference_mode()
def hf_packed_weight_model(model_dir: Path, qtype: str) -> torch.nn.Module:
    """The oracle for `--quantization`: a fresh float32 HF model whose linear weights, embedding
    table and LM head went through `qtype` blocks and back, as lockstep packs them at load
    (a tied head shares the packed table, as it does in lockstep)."""
    from lockstep.kernels import dequantize, quantize

    def rounded(w: torch.Tensor) -> torch.Tensor:
        return dequantize(qtype, quantize(qtype, w.float().contiguous()), w.shape[-1])

    model = hf_float_model(model_dir)
    done: set[int] = set()  # a tied weight is one tensor: round it once
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            if module.weight.data_ptr() not in done:
                done.add(module.weight.data_ptr())
                module.weight.data.copy_(rounded(module.weight.data))  # biases stay float32
    return model


@torch.inference_mode()
def hf_prompt_logprobs(
    model_dir: Path, prompt: list[int], dtype: torch.dtype = torch.float32
) -> list[float]:
    """``[log p(prompt[i] | prompt[:i]) for i in 1..len(prompt)-1]`` (float32 log_softmax)."""
    model = load_hf_model(model_dir, dtype)
    if len(prompt) < 2:
        return []
    ids = torch.tensor([prompt], dtype=torch.long)
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, ids[0, 1:, None])[:, 0].tolist()
