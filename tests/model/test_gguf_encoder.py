"""GGUF embedding models as llama.cpp's converter writes them (lockstep.testing.gguf_writer): a
tiny BERT's GGUF gives bitwise the vectors of the HF directory it was converted from, pooled as
its pooling key says; its WordPiece tokenizer, rebuilt from the phantom-space vocabulary, gives
HF's ids; a Q8_0 one runs on Q8_0 blocks; a decoder GGUF with a pooling key embeds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from lockstep.kernels import compiled
from lockstep.layers.block_weight import Kind
from lockstep.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from lockstep.model_loader import resolve_model
from lockstep.model_loader.pooling import Pooling, pooling_for
from lockstep.testing.embedding_oracle import embed_in_process, sentences
from lockstep.testing.gguf_writer import write_bert_gguf, write_gguf
from lockstep.testing.inproc import make_scheduler
from lockstep.testing.tiny_encoders import make_tiny_encoder, tiny_hf_encoder

# accents, case, punctuation, words the vocabulary lacks, CJK, emoji, controls, specials in text
TEXTS = ["Héllo WÖRLD, naïve café; résumé!", "東京は日本の首都です。北京欢迎你", "zxqvbnmk flurbishly",
         "don't (stop) -- e.g. 3.14 $5 #tag @you", "Ünïcödé ÀÉÎ ß Ǆ ﬁ Ωmega", "tabs\tand\nnew  lines\x00",
         "emoji 🙂🚀 mixed 日本語text", "[CLS] inside [SEP] text [MASK]", "", "supercalifragilistic" * 8]


def _ids(model_dir: Path, texts: list[str]) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok(t).input_ids for t in texts]


@pytest.mark.parametrize("kind", ["embed-mean", "embed-cls"])
def test_bert_gguf_gives_the_vectors_of_its_hf_directory(kind: str, tmp_path: Path) -> None:
    """Mean pooling (the converter's pooling key from modules.json) and [CLS] (no key: BERT's
    default), normalized: bitwise the HF directory's vectors, on mixed-length texts in a batch."""
    hf_dir = make_tiny_encoder(kind)
    path = write_bert_gguf(hf_dir, tmp_path / f"{kind}.gguf")
    source = resolve_model(str(path))
    assert source.hf_config["model_type"] == "bert" and source.gguf_file == path
    expected = Pooling("mean" if kind == "embed-mean" else "cls", normalize=True)
    assert pooling_for(source.model_dir, source.hf_config, False) == expected
    prompts = _ids(hf_dir, sentences(16, seed=5, lines=4) + TEXTS)
    ours = torch.tensor(embed_in_process(make_scheduler(path), prompts))
    ref = torch.tensor(embed_in_process(make_scheduler(hf_dir), prompts))
    assert ours.shape == (len(prompts), 64) and torch.equal(ours, ref)


def _cased_copy(hf_dir: Path, out: Path) -> Path:
    """The tiny encoder's directory with a cased tokenizer (bert-base-cased's settings: no
    lowercasing, no accent stripping), as a cased BERT's files say it."""
    shutil.copytree(hf_dir, out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    tokenizer["normalizer"].update(lowercase=False, strip_accents=False)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config.update(do_lower_case=False, strip_accents=False)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return out


@pytest.mark.parametrize("cased", [False, True])
def test_bert_gguf_tokenizer_gives_hf_ids(cased: bool, tmp_path: Path) -> None:
    """The WordPiece tokenizer rebuilt from the GGUF (phantom spaces undone, the normalizer's
    lowercase / strip_accents keys) gives HF's ids on accents, punctuation, unknown words, CJK,
    emoji, control characters, special tokens in text, and pairs; and decodes alike."""
    hf_dir = make_tiny_encoder("embed-cls")
    if cased:
        hf_dir = _cased_copy(hf_dir, tmp_path / "cased")
    source = resolve_model(str(write_bert_gguf(hf_dir, tmp_path / "t.gguf")))
    theirs = AutoTokenizer.from_pretrained(str(hf_dir))
    ours = AutoTokenizer.from_pretrained(str(source.model_dir))
    texts = TEXTS + sentences(40, seed=8)
    assert [ours(t).input_ids for t in texts] == [theirs(t).input_ids for t in texts]
    assert ours(TEXTS[0], TEXTS[2]) == theirs(TEXTS[0], TEXTS[2])  # segments of a pair too
    ids = theirs(TEXTS[0]).input_ids
    assert ours.decode(ids) == theirs.decode(ids)
    # the case matters here: a cased tokenizer keeps "WÖRLD" apart from "wörld"
    assert (theirs("WÖRLD").input_ids == theirs("world").input_ids) is not cased


def _q8_0_reference(hf_dir: Path, gguf_path: Path) -> torch.nn.Module:
    """transformers' BertModel with the GGUF's matrices, its Q8_0 blocks dequantized."""
    hf = tiny_hf_encoder("embed-cls")
    stored = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, hf.config.num_hidden_layers)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            base, suffix = name.rsplit(".", 1)
            t = stored.get(f"{names.get_name(base)}.{suffix}")
            if t is not None and t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
                values = gguf.quants.dequantize(t.data, t.tensor_type)
                p.copy_(torch.from_numpy(np.ascontiguousarray(values)).view(p.shape))
    return hf


def _linear_parts(sched) -> list:  # noqa: ANN001 - an in-process Scheduler
    return [p for m in sched.worker.runner.model.modules()
            if isinstance(m, (QKVParallelLinear, ColumnParallelLinear, RowParallelLinear))
            for p in m.parts or ()]


@pytest.mark.parametrize("int8", [True, False])
def test_q8_0_bert_gguf_runs_on_q8_0_blocks(int8: bool, tmp_path: Path) -> None:
    """A Q8_0 GGUF (--outtype q8_0: every matrix but positions and segments) keeps its blocks in
    the linears, on the kernels generation uses: by default int8 activations (llama.cpp's
    arithmetic, cosine >= 0.999 with transformers over the dequantized weights); with
    --no-int8-activations the exact kernel, transformers' vectors to float32 rounding."""
    hf_dir = make_tiny_encoder("embed-cls")
    path = write_bert_gguf(hf_dir, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    sched = make_scheduler(path, **({} if int8 else {"int8_activations": False}))
    parts = _linear_parts(sched)
    assert len(parts) == 2 * 4 and {p.qtype.name for p in parts} == {"Q8_0"}
    if int8 and not compiled("linear_int8"):
        pytest.skip("int8 activations need the compiled int8 kernel")
    assert {p.kind for p in parts} == {Kind.INT8 if int8 else Kind.EXACT}
    prompts = _ids(hf_dir, sentences(8, seed=6, lines=2))
    ours = torch.tensor(embed_in_process(sched, prompts))
    hf = _q8_0_reference(hf_dir, path)
    with torch.no_grad():
        ref = torch.stack([F.normalize(hf(torch.tensor([p])).last_hidden_state[0, 0], dim=-1)
                           for p in prompts])
    if int8:
        assert F.cosine_similarity(ours, ref).min().item() >= 0.999
    else:
        assert (ours - ref).abs().max().item() < 2e-6, (ours - ref).abs().max().item()


def test_decoder_gguf_with_a_pooling_key_embeds_without_the_flag(tmp_path: Path) -> None:
    """A Qwen3 GGUF whose converter wrote qwen3.pooling_type = LAST (Qwen3-Embedding's) embeds as
    the key says without --is-embedding: bitwise its HF directory's vectors with the flag, given
    the directory's float32 K/V cache."""
    from lockstep.testing.tiny_models import make_tiny_model, tiny_hf_model

    hf_dir = make_tiny_model("qwen3")
    path = write_gguf(tiny_hf_model("qwen3"), "qwen3", tmp_path / "e.gguf",
                      pooling_type=gguf.PoolingType.LAST)
    source = resolve_model(str(path))
    assert pooling_for(source.model_dir, source.hf_config, False) == Pooling("last", True)
    prompts = _ids(hf_dir, sentences(8, seed=4, lines=2))
    # a GGUF's K/V cache is float16 by default (as llama.cpp's); the directory's is float32
    ours = embed_in_process(make_scheduler(path, kv_cache_dtype="float32"), prompts)
    assert ours == embed_in_process(make_scheduler(hf_dir, is_embedding=True), prompts)
