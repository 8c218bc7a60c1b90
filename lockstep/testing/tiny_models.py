"""Tiny random-weight models in Hugging Face format, built locally for tests and benchmarks.

Nothing is downloaded. A small byte-level BPE tokenizer is trained on the built-in corpus
(``lockstep.testing.corpus``), and each tiny model is instantiated from a transformers config with
transformers' own model class, so that HF transformers can serve as the correctness oracle for the
serving path (see ``lockstep.testing.oracle``).

Everything is cached under ``<lockstep cache>/tiny`` (lockstep.utils.cache) in
directories keyed by ``TINY_VERSION`` (and, for models, by arch / seed / dtype / overrides).
Directories are published by an atomic rename, so concurrent test processes may race safely.

Design notes
------------
* hidden 64, 4 heads of dim 16, 2 KV heads (GQA), intermediate 128, vocab exactly the tokenizer's
  size (512), max_position_embeddings 4096. Layers: 4 (gemma3: 6, sliding/sliding/full x 2).
* Weights use ``initializer_range`` 0.2 (not 0.02) so greedy decoding is not degenerate.
* All 1-D parameters (RMSNorm weights, q/k norms, qkv biases) get N(0, 0.2^2) noise added after
  init. Stock init leaves them at exactly 1 (or 0 for Gemma's ``1 + w`` norms, and for biases),
  which would let a loader that silently drops biases or norm weights pass the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lockstep.testing.corpus import corpus_text, random_prompt
from lockstep.utils.cache import cache_dir

# Bump whenever the corpus, the tokenizer recipe or any tiny config / init changes.
TINY_VERSION = "v3"

TINY_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

TOKENIZER_VOCAB_SIZE = 512

# Special tokens, in id order (ids 0..5).
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
IM_START_TOKEN, IM_END_TOKEN = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
PAD_ID, BOS_ID, EOS_ID, UNK_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

# GPT-2 / Qwen2 style pre-tokenization split (same string as transformers' Qwen2Tokenizer).
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML turns, prefixed with <bos> like Gemma / Llama templates. The rendered text already
# holds <bos>, so tokenize it with add_special_tokens=False (as apply_chat_template does).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

HIDDEN_SIZE = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE_SIZE = 128
MAX_POSITIONS = 4096
INIT_RANGE = 0.2
ONE_D_NOISE = 0.2
GEMMA3_SLIDING_WINDOW = 32


def tiny_cache_dir(cache_root: Path | None = None) -> Path:
    """``cache_root/tiny``, by default under lockstep's cache (lockstep.utils.cache)."""
    return Path(cache_root) / "tiny" if cache_root else cache_dir("tiny")


def built_tiny_dir(name: str, build: Callable[[Path], None], out_dir: Path | None = None) -> Path:
    """A tiny model directory: written fresh into `out_dir`, or built once into the cache as `name`."""
    if out_dir is not None:
        shutil.rmtree(out_dir, ignore_errors=True)
        Path(out_dir).mkdir(parents=True)
        build(Path(out_dir))
        return Path(out_dir)
    return _publish(tiny_cache_dir() / name, build)


def mark_fast_tokenizer(out: Path) -> None:
    """Name the fast tokenizer class in tokenizer_config.json, as tiny_models writes it (transformers
    5 writes "TokenizersBackend", which transformers 4 cannot resolve)."""
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _publish(final: Path, build: Callable[[Path], None]) -> Path:
    """Build into a temp dir next to ``final`` and atomically rename it into place."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- tokenizer


def _train_tokenizer():
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    # Exactly the pipeline transformers 5's Qwen2Tokenizer rebuilds (AutoTokenizer forces that
    # class for model_type "qwen2" whatever tokenizer_config.json says), so that every tiny arch
    # tokenizes identically, whether loaded by AutoTokenizer or from tokenizer.json directly.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    if tok.get_vocab_size() != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected 512")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def _write_tokenizer(out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out))
    # transformers 5 writes tokenizer_class "TokenizersBackend", which transformers 4 cannot
    # resolve; "PreTrainedTokenizerFast" loads the same tokenizer.json in both.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def tiny_tokenizer_dir(cache_root: Path | None = None) -> Path:
    """Directory holding the tiny tokenizer (built once, then cached).

    Byte-level BPE with exactly 512 tokens; ids 0..5 are <pad> <bos> <eos> <unk> <|im_start|>
    <|im_end|>. ``AutoTokenizer.from_pretrained(dir)(text).input_ids`` starts with <bos> (1).
    """
    root = tiny_cache_dir(cache_root)
    return _publish(root / f"tokenizer-{TINY_VERSION}", _write_tokenizer)


# --------------------------------------------------------------------------- models


def _base_config(arch: str) -> dict[str, Any]:
    common: dict[str, Any] = dict(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=4,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_RANGE,
        rms_norm_eps=1e-6,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if arch == "llama":
        return dict(
            common,
            model_type="llama",
            head_dim=HEAD_DIM,
            tie_word_embeddings=False,
            # original_max_position_embeddings 64 puts the 8 frequencies of head_dim 16 in all
            # three llama3 regimes (kept / smoothly interpolated / divided by factor).
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    qwen_rope = {"rope_type": "default", "rope_theta": 1000000.0}
    if arch == "qwen2":
        # Qwen2 always has q/k/v biases; head_dim is hidden_size // num_attention_heads.
        return dict(common, model_type="qwen2", tie_word_embeddings=True, rope_parameters=qwen_rope)
    if arch == "qwen3":
        return dict(common, model_type="qwen3", head_dim=HEAD_DIM, tie_word_embeddings=False,
                    attention_bias=False, rope_parameters=qwen_rope)
    if arch == "gemma3":
        return dict(
            common,
            model_type="gemma3_text",
            head_dim=HEAD_DIM,
            num_hidden_layers=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            sliding_window=GEMMA3_SLIDING_WINDOW,
            query_pre_attn_scalar=16,
            tie_word_embeddings=True,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        )
    raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")


def tiny_config(arch: str, **config_overrides: Any):
    """The transformers config object for a tiny ``arch`` (overrides applied)."""
    from transformers import AutoConfig

    kw = _base_config(arch)
    model_type = kw.pop("model_type")
    n_layers = config_overrides.get("num_hidden_layers")
    if arch == "gemma3" and n_layers is not None and "layer_types" not in config_overrides:
        kw["layer_types"] = [
            "full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(n_layers)
        ]
    kw.update(config_overrides)
    return AutoConfig.for_model(model_type, **kw)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _model_key(arch: str, seed: int, dtype: torch.dtype, overrides: dict[str, Any]) -> str:
    blob = json.dumps(
        {
            "v": TINY_VERSION,
            "arch": arch,
            "seed": seed,
            "dtype": _dtype_name(dtype),
            "o": overrides,
        },
        sort_keys=True,
        default=str,
    )
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return f"{arch}-s{seed}-{_dtype_name(dtype)}-{TINY_VERSION}-{digest}"


def tiny_hf_model(arch: str, seed: int = 0, **config_overrides: Any) -> torch.nn.Module:
    """The tiny random-weight transformers model of ``arch`` in float32, in memory (what
    ``make_tiny_model`` saves; tests that write their own files, e.g. GGUFs, start from it)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **config_overrides),
                                             dtype=torch.float32)
    with torch.no_grad():
        for name, p in perturbed_params(model, seed):
            if arch == "gemma3":
                _gemma3_tweak(name, p)
    return model.eval()


def perturbed_params(model: torch.nn.Module, seed: int) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """A tiny model's parameters in name order, each 1-D one first moved off its stock 1 / 0 (so a
    dropped bias or norm shows against the oracle); iterate under torch.no_grad()."""
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    for name, p in sorted(model.named_parameters()):
        if p.ndim == 1:
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * ONE_D_NOISE)
        yield name, p


def _write_model(
    arch: str, out: Path, seed: int, dtype: torch.dtype, overrides: dict[str, Any], tok_dir: Path
) -> None:
    model = tiny_hf_model(arch, seed, **overrides).to(dtype)
    model.config.dtype = dtype
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for f in sorted(tok_dir.iterdir()):
        if f.is_file():
            shutil.copy2(f, out / f.name)


def _gemma3_tweak(name: str, p: torch.nn.Parameter) -> None:
    """Keep tiny Gemma 3 from collapsing into repeating one token.

    Post-norms pin every sublayer's output to unit scale, and q/k norms make attention nearly
    uniform at this size, so with stock init the residual stream is dominated by the
    (sqrt(hidden)-scaled, tied) input embedding and greedy decoding repeats the last token.
    Shrinking the embedding and raising the q/k-norm and final-norm weights (Gemma norms scale by
    ``1 + w``, so these are also far from the ``w == 0`` a loader bug would hide behind) gives
    outputs as varied as the other tiny archs.
    """
    if name.endswith("embed_tokens.weight"):
        p.mul_(0.25)
    elif name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        p.add_(2.0)
    elif name == "model.norm.weight":
        p.add_(2.0)


def make_tiny_model(
    arch: str,
    out_dir: Path | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    cache_root: Path | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random-weight HF model dir for ``arch`` and return it.

    The dir holds config.json, generation_config.json, model.safetensors and the tiny tokenizer
    files. With ``out_dir`` None it is cached under the cache root, keyed by (arch, seed, dtype,
    overrides); otherwise it is (re)written into ``out_dir``. ``config_overrides`` go straight to
    the transformers config class (e.g. ``num_key_value_heads=4`` or ``1`` for TP tests).
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")
    tok_dir = tiny_tokenizer_dir(cache_root)

    def build(path: Path) -> None:
        _write_model(arch, path, seed, dtype, config_overrides, tok_dir)

    if out_dir is not None:
        build(Path(out_dir))
        return Path(out_dir)
    root = tiny_cache_dir(cache_root)
    return _publish(root / _model_key(arch, seed, dtype, config_overrides), build)


def make_tiny_yes_no_reranker(tied: bool = False) -> Path:
    """A tiny Qwen3 whose directory's name says it is a Qwen3-Reranker (lockstep.model_loader.pooling
    finds it so): the tiny tokenizer with "yes" and "no" added as tokens (ids 512 and 513; the
    trained one has neither whole), and a vocabulary of 514 to hold them."""
    from transformers import AutoTokenizer

    overrides = {"vocab_size": TOKENIZER_VOCAB_SIZE + 2, "tie_word_embeddings": tied}

    def build(out: Path) -> None:
        tiny_hf_model("qwen3", 0, **overrides).save_pretrained(str(out))
        tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
        if tok.add_tokens(["yes", "no"]) != 2:
            raise RuntimeError("the tiny tokenizer already has 'yes' or 'no'")
        tok.save_pretrained(str(out))
        mark_fast_tokenizer(out)

    return built_tiny_dir(f"qwen3-reranker-{'tied-' if tied else ''}{TINY_VERSION}", build)


def tiny_prompts(model_dir: Path, n: int, seed: int = 0, min_words: int = 3,
                 max_words: int = 30) -> list[list[int]]:
    """``n`` token-id prompts of the built-in corpus's words, in ``model_dir``'s tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    return [tok(random_prompt(rng, rng.randint(min_words, max_words))).input_ids for _ in range(n)]
