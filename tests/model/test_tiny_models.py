"""The tiny test models, tokenizer and HF oracle themselves: built locally, deterministic,
non-degenerate, and faithful to what HF transformers does."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from lockstep.testing.corpus import corpus_text, random_prompt
from lockstep.testing.oracle import (
    OracleResult,
    greedy_matches,
    hf_greedy,
    hf_prompt_logprobs,
    load_hf_model,
)
from lockstep.testing.tiny_models import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    PAD_ID,
    TINY_ARCHS,
    make_tiny_model,
    tiny_tokenizer_dir,
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "今天 天气 很好，我们去公园散步吧。東京は日本の首都です。",
    "Emoji 😀🎉🚀 ❤️ and a rare one 🦩, plus Ωμέγα and ñ.",
    "  leading spaces,\ttabs\nand newlines  ",
]


def _prompts(tok, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tok(random_prompt(rng, rng.randint(3, 25))).input_ids for _ in range(n)]


def test_corpus_and_random_prompt_are_deterministic():
    assert len(corpus_text()) > 4000
    a = [random_prompt(random.Random(7), n) for n in (0, 1, 5, 40)]
    b = [random_prompt(random.Random(7), n) for n in (0, 1, 5, 40)]
    assert a == b
    assert a[0] == "" and len(a[3].split()) == 40
    rng = random.Random(1)
    assert len({random_prompt(rng, 6) for _ in range(20)}) > 10


def test_tokenizer_round_trips_and_specials():
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    assert len(tok) == 512
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START_ID, IM_END_ID]
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
        assert max(ids) < 512
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids[1:]) == text
    # Corpus text compresses (merges were learned) but unseen bytes still round-trip.
    assert len(tok(corpus_text()).input_ids) < 0.6 * len(corpus_text().encode())
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi 你好"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<bos><|im_start|>user\nHi 你好<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok(chat, add_special_tokens=False).input_ids
    assert chat_ids[:2] == [BOS_ID, IM_START_ID] and chat_ids.count(BOS_ID) == 1


def test_every_arch_tokenizes_identically():
    # transformers 5 forces Qwen2Tokenizer (which rebuilds the normalizer and pre-tokenizer) for
    # model_type qwen2 whatever tokenizer_config.json says; the tiny pipeline matches it.
    ref = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    raw = Tokenizer.from_file(str(tiny_tokenizer_dir() / "tokenizer.json"))
    texts = TEXTS + corpus_text().splitlines()
    expected = [ref(t).input_ids for t in texts]
    assert [e.ids for e in raw.encode_batch(texts)] == expected
    for arch in TINY_ARCHS:
        tok = AutoTokenizer.from_pretrained(make_tiny_model(arch))
        assert [tok(t).input_ids for t in texts] == expected, arch
        assert tok.chat_template == ref.chat_template


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_builds_loads_and_is_not_degenerate(arch):
    model_dir = make_tiny_model(arch)
    assert make_tiny_model(arch) == model_dir  # cached
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert cfg["vocab_size"] == len(tok) == 512
    heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"])
    assert cfg["hidden_size"] == 64 and heads == (4, 2)
    assert cfg["bos_token_id"] == tok.bos_token_id and cfg["eos_token_id"] == tok.eos_token_id
    assert cfg["max_position_embeddings"] == 4096

    model = load_hf_model(model_dir)
    assert model.config.model_type == {"gemma3": "gemma3_text"}.get(arch, arch)
    assert model.config._attn_implementation == "eager"
    names = set(load_file(str(model_dir / "model.safetensors")))
    if arch == "llama":
        assert cfg["rope_parameters"]["rope_type"] == "llama3"
        assert "lm_head.weight" in names
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in names
        assert model.model.layers[0].self_attn.q_proj.bias.abs().min() > 0  # not left at zero
    if arch == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in names
    if arch == "gemma3":
        assert cfg["sliding_window"] == 32
        assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}
        rope = cfg["rope_parameters"]
        assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]
    assert ("lm_head.weight" in names) != cfg["tie_word_embeddings"]

    prompts = _prompts(tok, 3, seed=0)
    refs = hf_greedy(model_dir, prompts, 16)
    for prompt, ref in zip(prompts, refs):
        assert len(ref.output_ids) == len(ref.logprobs) == len(ref.margins) == 16
        assert len(set(ref.output_ids)) >= 4, f"{arch}: degenerate greedy output {ref.output_ids}"
        assert all(m >= 0 for m in ref.margins) and all(lp <= 0 for lp in ref.logprobs)
        # The cached decode loop agrees with one full forward over prompt + output.
        full = hf_prompt_logprobs(model_dir, prompt + ref.output_ids)
        assert full[len(prompt) - 1 :] == pytest.approx(ref.logprobs, abs=1e-4)
        assert greedy_matches(ref.output_ids, ref)


def test_building_twice_gives_identical_weights(tmp_path):
    for arch in TINY_ARCHS:
        a = load_file(str(make_tiny_model(arch, tmp_path / f"{arch}-a") / "model.safetensors"))
        b = load_file(str(make_tiny_model(arch, tmp_path / f"{arch}-b") / "model.safetensors"))
        cached = load_file(str(make_tiny_model(arch) / "model.safetensors"))
        assert a.keys() == b.keys() == cached.keys()
        assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], cached[k]) for k in a)
    seed1 = make_tiny_model("llama", tmp_path / "llama-s1", seed=1)
    other = load_file(str(seed1 / "model.safetensors"))
    assert not torch.equal(other["model.embed_tokens.weight"], a["model.embed_tokens.weight"])


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_config_overrides_for_tp(kv_heads):
    model_dir = make_tiny_model("qwen3", num_key_value_heads=kv_heads)
    assert model_dir != make_tiny_model("qwen3")
    assert json.loads((model_dir / "config.json").read_text())["num_key_value_heads"] == kv_heads
    k = load_file(str(model_dir / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"]
    assert k.shape == (kv_heads * 16, 64)


def test_hf_sliding_window_excludes_key_at_distance_window():
    """Documents HF's semantics the serving path must match: a sliding layer with window W lets
    the query see itself and the W - 1 keys before it (a key at distance == W is masked)."""
    window = 4
    model_dir = make_tiny_model(
        "gemma3", num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=window
    )
    model = load_hf_model(model_dir)
    base = [BOS_ID, 50, 60, 70, 80, 90, 100, 110, 120]
    q = len(base) - 1
    with torch.no_grad():
        ref = model(torch.tensor([base])).logits[0, q]
        for dist in range(1, window + 3):
            ids = list(base)
            ids[q - dist] = 300
            out = model(torch.tensor([ids])).logits[0, q]
            assert torch.equal(out, ref) == (dist >= window), dist


def test_greedy_matches_tolerates_only_near_ties():
    ref = OracleResult(output_ids=[5, 6, 7], logprobs=[-1.0] * 3, margins=[0.5, 1e-5, 0.5])
    assert greedy_matches([5, 6, 7], ref)
    assert greedy_matches([5, 9, 9], ref)  # diverged at a near-tie: rest is ignored
    assert not greedy_matches([9, 6, 7], ref)
    assert not greedy_matches([5, 6], ref)
