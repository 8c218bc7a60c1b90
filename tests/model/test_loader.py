"""Model loader: a GGUF's config, tokenizer and blocks against transformers as the oracle, cache,
error reporting.

Tiny GGUFs are written (lockstep.testing.gguf_writer) from the tiny random HF models with
llama.cpp's own transforms and tensor names, so loading them back (blocks dequantized) must
reproduce the HF weights. Gemma 3 270M (packaged) is checked
against transformers' `from_pretrained(gguf_file=...)`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lockstep.layers.block_weight import BlockWeight
from lockstep.model_loader import (
    ModelLoadError,
    ModelSource,
    gguf_loader,
    iter_weights,
    resolve_model,
)
from lockstep.model_loader.layout import TENSOR_INDEX
from lockstep.model_loader.source import CONVERSION_MARKER
from lockstep.testing.gguf_writer import GGUF_ARCH, write_gguf
from lockstep.testing.hf_weights import float_state_dict, hf_float_model
from lockstep.testing.live_server import GEMMA
from lockstep.testing.oracle import gguf_parsed_once, transformers_gguf_tokenizer
from lockstep.testing.tiny_models import tiny_hf_model

SOURCE_LOGGER = "lockstep.model_loader.source"

# --------------------------------------------------------------------------- tiny models

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
)
# Shapes the loader must get right beyond the tiny defaults: a head_dim that is not hidden / heads
# (as in real Qwen3), and a Gemma 3 layer pattern that is not a repeat of its sliding window.
LOADER_SHAPES = {
    "qwen3": {"head_dim": 32},
    "gemma3": {"num_hidden_layers": 4, "sliding_window": 8,
               "layer_types": ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]},
}


def load_state(source: ModelSource) -> dict[str, torch.Tensor]:
    """Every weight as float32 (blocks dequantized)."""
    return {name: w.dequantize() if isinstance(w, BlockWeight) else w
            for name, w in iter_weights(source)}


@pytest.fixture(scope="module")
def tiny_models() -> dict[str, torch.nn.Module]:
    return {arch: tiny_hf_model(arch, **LOADER_SHAPES.get(arch, {})) for arch in GGUF_ARCH}


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, tiny_models) -> Path:
    """A valid tiny HF directory (a GGUF's config and tokenizer, its weights as float
    safetensors), for tests that break copies of it."""
    root = tmp_path_factory.mktemp("tiny_llama")
    gguf_path = write_gguf(tiny_models["llama"], "llama", root / "tiny-llama.gguf")
    entry = resolve_model(str(gguf_path), cache_dir=root / "cache").model_dir
    hf_dir = root / "hf"
    shutil.copytree(entry, hf_dir, ignore=shutil.ignore_patterns(TENSOR_INDEX, CONVERSION_MARKER))
    save_file(float_state_dict(entry), str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return hf_dir


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def assert_load_error(path: str | Path, *fragments: str, cache_dir: Path | None = None) -> str:
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(path), cache_dir=cache_dir)
    msg = str(info.value)
    for fragment in (str(path), *fragments):
        assert fragment in msg, msg
    return msg


# --------------------------------------------------------------------------- tiny conversions


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_tiny_gguf_converts_back_to_hf_weights(arch, tiny_models, tmp_path):
    model = tiny_models[arch]
    gguf_path = write_gguf(model, arch, tmp_path / f"tiny-{arch}.gguf", chat_template=TEMPLATE)
    source = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")

    assert source.origin == str(gguf_path)
    assert source.chat_template == TEMPLATE
    assert source.hf_config["model_type"] == model.config.model_type
    assert source.hf_config["architectures"] == [type(model).__name__]
    cfg = model.config
    assert source.hf_config["head_dim"] == (getattr(cfg, "head_dim", None) or 64 // 4)
    for key in ("num_key_value_heads", "tie_word_embeddings", "rope_parameters"):
        assert source.hf_config[key] == getattr(cfg, key), key
    if arch == "gemma3":
        for key in ("layer_types", "sliding_window", "query_pre_attn_scalar"):
            assert source.hf_config[key] == getattr(model.config, key), key

    expected = {k: v for k, v in model.state_dict().items()
                if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    got = load_state(source)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        # Gemma norms went through (w + 1) - 1 in float32: equal to within rounding.
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)

    # End to end: the oracle's HF model of the entry computes the original model's logits.
    converted = hf_float_model(source.model_dir)
    ids = torch.tensor([[1, 10, 200, 7, 42, 99, 150, 3, 60, 61, 62, 63]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)

    tok = AutoTokenizer.from_pretrained(str(source.model_dir))
    oracle_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_path.name)
    for text in ["the theory", "<|im_start|>user\nhi<|im_end|>", "naïve 東京 🙂"]:
        assert tok(text).input_ids == oracle_tok(text).input_ids, text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_tiny_quantized_gguf_matches_transformers(tiny_models, tmp_path):
    """Q8_0 / F16 tensors dequantize exactly as transformers' own GGUF loader does."""
    gguf_path = write_gguf(tiny_models["llama"], "llama", tmp_path / "q.gguf", quantize=True)
    source = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    oracle = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_path.name,
                                                  dtype=torch.float32).state_dict()
    got = load_state(source)
    assert got.keys() == oracle.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, oracle[name]), name


def test_llama3_rope_recovered_from_rope_freqs(tiny_models, tmp_path):
    gguf_path = write_gguf(tiny_models["llama"], "llama", tmp_path / "l.gguf")
    source = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert source.hf_config["rope_parameters"] == tiny_models["llama"].config.rope_parameters
    assert "rope_freqs.weight" not in load_state(source)


def test_cache_keeps_the_gguf_blocks_not_floats(tiny_models, tmp_path):
    """The cache entry holds no weights; the matrices are the GGUF's own bytes, memory-mapped."""
    gguf_path = write_gguf(tiny_models["qwen2"], "qwen2", tmp_path / "s.gguf", quantize=True)
    source = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert source.gguf_file == gguf_path and source.weight_files == ()
    assert source.model_dir.name.endswith("-blocks")  # never a float (format 1) entry's name
    assert not list(source.model_dir.glob("*.safetensors"))
    file_bytes = gguf_path.read_bytes()
    weights = dict(iter_weights(source))
    w = weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(w, BlockWeight) and w.qtype == "Q8_0" and w.shape == (64, 128)
    assert w.blocks.numpy().tobytes() in file_bytes
    assert isinstance(weights["model.norm.weight"], torch.Tensor)


# --------------------------------------------------------------------------- cache


def test_cache_reuse_logs_and_layout(tiny_models, tmp_path, caplog):
    import hashlib

    gguf_path = write_gguf(tiny_models["qwen3"], "qwen3", tmp_path / "c.gguf")
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger=SOURCE_LOGGER):
        first = resolve_model(str(gguf_path), cache_dir=cache)
        assert "converted in" in caplog.text
        caplog.clear()
        second = resolve_model(str(gguf_path), cache_dir=cache)
        assert "loaded from cache in" in caplog.text and "converted in" not in caplog.text
    assert first == second
    assert first.model_dir == cache / f"{hashlib.sha256(gguf_path.read_bytes()).hexdigest()[:16]}-blocks"
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]

    # Same path, new content: a new cache entry, never the stale one.
    write_gguf(tiny_models["qwen2"], "qwen2", gguf_path)
    os.utime(gguf_path, ns=(time.time_ns(), time.time_ns() + 10**9))
    third = resolve_model(str(gguf_path), cache_dir=cache)
    assert third.model_dir != first.model_dir and third.hf_config["model_type"] == "qwen2"


def test_crash_mid_conversion_leaves_no_cache(tiny_models, tmp_path, monkeypatch):
    gguf_path = write_gguf(tiny_models["gemma3"], "gemma3", tmp_path / "g.gguf")
    cache = tmp_path / "cache"

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # like Ctrl-C after the weights were written

    with monkeypatch.context() as m:
        m.setattr(gguf_loader, "_write_tokenizer", crash)
        with pytest.raises(KeyboardInterrupt):
            resolve_model(str(gguf_path), cache_dir=cache)
    assert not [p for p in cache.iterdir() if p.is_dir()]
    source = resolve_model(str(gguf_path), cache_dir=cache)
    assert (source.model_dir / CONVERSION_MARKER).is_file()


def test_concurrent_resolves_convert_once(tiny_models, tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    gguf_path = write_gguf(tiny_models["qwen2"], "qwen2", tmp_path / "p.gguf")
    real_convert, calls = gguf_loader.convert_gguf, []

    def slow_convert(*args):
        calls.append(args)
        time.sleep(0.5)  # keep the first conversion running while the others arrive
        real_convert(*args)

    monkeypatch.setattr(gguf_loader, "convert_gguf", slow_convert)
    with ThreadPoolExecutor(3) as pool:
        sources = list(pool.map(lambda _: resolve_model(str(gguf_path), tmp_path / "c"), range(3)))
    assert len(calls) == 1
    assert sources[0] == sources[1] == sources[2]


def test_damaged_cache_is_rebuilt(tiny_models, tmp_path, caplog):
    gguf_path = write_gguf(tiny_models["qwen2"], "qwen2", tmp_path / "d.gguf")
    cache = tmp_path / "cache"
    source = resolve_model(str(gguf_path), cache_dir=cache)
    (source.model_dir / TENSOR_INDEX).write_bytes(b"\0" * 100)
    with caplog.at_level(logging.WARNING, logger=SOURCE_LOGGER):
        again = resolve_model(str(gguf_path), cache_dir=cache)
    assert "damaged cache entry" in caplog.text
    assert load_state(again).keys() == load_state(source).keys()


# --------------------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    assert_load_error(tmp_path / "nope.gguf", "no such file")


def test_garbage_gguf(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    assert_load_error(bad, "not a GGUF file", cache_dir=tmp_path / "cache")


def test_empty_gguf(tmp_path):
    (tmp_path / "empty.gguf").touch()
    assert_load_error(tmp_path / "empty.gguf", "not a GGUF file", cache_dir=tmp_path / "cache")


def test_corrupt_gguf_header(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(4096))
    assert_load_error(bad, "truncated or corrupt GGUF", cache_dir=tmp_path / "cache")


def test_truncated_tiny_gguf(tiny_models, tmp_path):
    full = write_gguf(tiny_models["llama"], "llama", tmp_path / "full.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[: len(full) * 2 // 3])  # metadata intact, tensor data cut short
    assert_load_error(cut, "truncated or corrupt GGUF", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not [
        p for p in (tmp_path / "cache").iterdir() if p.is_dir()
    ]


def test_unsupported_gguf_arch(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_load_error(path, "unsupported GGUF architecture 'phi2'", cache_dir=tmp_path / "cache")


def test_dir_without_config(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    (d / "config.json").unlink()
    assert_load_error(d, "config.json", "missing")


def test_dir_with_broken_config(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    assert_load_error(d, "config.json", "unreadable")


def test_dir_without_tokenizer(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    assert_load_error(d, "no tokenizer")


def test_dir_without_weights(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    assert_load_error(d, "no model.safetensors")


def test_truncated_safetensors(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    assert_load_error(st.parent, str(st), "truncated safetensors")
    # the lazy reader reports it too, for callers that skip resolve_model
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_state(ModelSource(d, {}, (st,), None, str(d)))


@pytest.mark.parametrize("payload", [b"\xff" * 64, b"\x10\0\0\0\0\0\0\0{garbage!}......"])
def test_corrupt_safetensors(tiny_llama_dir, tmp_path, payload):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    st = d / "model.safetensors"
    st.write_bytes(payload)
    assert_load_error(d, str(st), "corrupt")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_state(ModelSource(d, {}, (st,), None, str(d)))


def test_sharded_dir_with_missing_shard(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_load_error(d, "model-00002-of-00002.safetensors", "missing")


def test_valid_hf_dir(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    source = resolve_model(str(d))
    assert source.model_dir == d and source.origin == str(d)
    assert source.weight_files == (d / "model.safetensors",)
    assert source.chat_template is None
    names = [name for name, _ in iter_weights(source)]
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names


# --------------------------------------------------------------------------- Gemma 3 270M (packaged)

PROMPTS = [
    "Hello, world!",
    "東京は日本の首都です。",
    "emoji 🙂🚀👍🏽 ok",
    "<start_of_turn>user\nhi<end_of_turn>",
]


@pytest.fixture(scope="module")
def gemma_source() -> ModelSource:
    return resolve_model(GEMMA)  # the real cache dir: converted once, reused by later runs


@pytest.fixture(scope="module")
def oracle(gemma_source):
    """transformers' own GGUF path on the same file: the model and the tokenizer."""
    gguf_path = Path(gemma_source.origin)
    with gguf_parsed_once():  # the model and the tokenizer parse the GGUF once between them
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        # shared with tests/scheduler/test_stop_matching.py (built once per process)
        tok = transformers_gguf_tokenizer(str(gguf_path))
    return model.eval(), tok


@pytest.mark.real_model
def test_gemma_config(gemma_source):
    cfg = gemma_source.hf_config
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["head_dim"]) == (18, 640, 256)
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert cfg["sliding_window"] == 512 and cfg["query_pre_attn_scalar"] == 256
    assert cfg["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["tie_word_embeddings"] is True
    assert gemma_source.chat_template is None
    assert gemma_source.gguf_file == Path(gemma_source.origin)


@pytest.mark.real_model
def test_gemma_tensors_match_transformers_gguf(gemma_source, oracle):
    expected = oracle[0].state_dict()
    seen = set()
    for name, weight in iter_weights(gemma_source):
        tensor = weight.dequantize() if isinstance(weight, BlockWeight) else weight
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name
        seen.add(name)
    assert seen == set(expected) - {"lm_head.weight"}  # tied to the embedding
    assert torch.equal(expected["lm_head.weight"], expected["model.embed_tokens.weight"])


@pytest.mark.real_model
def test_gemma_tokenizer_matches_transformers_gguf(gemma_source, oracle):
    tok = AutoTokenizer.from_pretrained(str(gemma_source.model_dir))
    for text in PROMPTS:
        assert tok(text).input_ids == oracle[1](text).input_ids, text
    assert tok.convert_tokens_to_ids("<start_of_turn>") == 105  # one special token, not pieces


@pytest.mark.real_model
def test_gemma_cached_resolve_is_fast(gemma_source, caplog):
    with caplog.at_level(logging.INFO, logger=SOURCE_LOGGER):
        start = time.perf_counter()
        again = resolve_model(GEMMA)
        elapsed = time.perf_counter() - start
    assert "loaded from cache in" in caplog.text
    assert again == gemma_source
    assert elapsed < 5.0, elapsed


@pytest.mark.real_model
def test_truncated_gemma_gguf(gemma_source, tmp_path):
    cut = tmp_path / "gemma-cut.gguf"
    with open(gemma_source.origin, "rb") as fh:
        cut.write_bytes(fh.read(1 << 20))  # cut inside the vocabulary metadata
    assert_load_error(cut, "truncated or corrupt GGUF", cache_dir=tmp_path / "cache")


def test_dir_holding_a_gguf_points_at_the_file(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert_load_error(tmp_path, "config.json", "pass the .gguf file itself")


def test_end_of_turn_ids_read_from_tokenizer_json_match_the_tokenizer(tiny_model_dirs):
    from tokenizers import Tokenizer

    from lockstep.model_loader.stop_tokens import END_OF_TURN_TOKENS, _token_ids
    from lockstep.testing.tiny_models import tiny_tokenizer_dir

    dirs = [tiny_tokenizer_dir(), *tiny_model_dirs.values()]
    for d in dirs:
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        expected = {t: i for t in END_OF_TURN_TOKENS if (i := tok.token_to_id(t)) is not None}
        assert _token_ids(d / "tokenizer.json", END_OF_TURN_TOKENS) == expected, d
    assert _token_ids(tiny_tokenizer_dir() / "tokenizer.json", ["<|im_end|>"]) == {"<|im_end|>": 5}


@pytest.mark.real_model
def test_gemma_end_of_turn_id(gemma_source):
    from lockstep.model_loader.stop_tokens import END_OF_TURN_TOKENS, _token_ids

    assert _token_ids(gemma_source.model_dir / "tokenizer.json", END_OF_TURN_TOKENS) == {
        "<end_of_turn>": 106}
