"""BERT encoders on lockstep's layers against their oracles: tiny random-weight embedding models
and a cross-encoder against HF transformers, the real all-MiniLM-L6-v2 against
sentence-transformers (vectors and a retrieval ranking), and a vector's bits alone and in a batch
of mixed lengths (the CPU path is batch invariant)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lockstep.model_loader import resolve_model
from lockstep.model_loader.pooling import Pooling, pooling_for
from lockstep.testing.embedding_oracle import embed_in_process, sentences
from lockstep.testing.inproc import make_scheduler, packaged_tokenizer
from lockstep.testing.tiers import marks
from lockstep.testing.tiny_encoders import KINDS, make_tiny_encoder, tiny_hf_encoder

MINILM = "all-minilm-l6-v2"
PAIRS = [("what is a panda?", "The giant panda is a bear species endemic to China."),
         ("what is a panda?", "hi"),
         ("how do trains work", "The river bends twice before it reaches the sea."),
         ("capital of France", "Paris is the capital and largest city of France.")]


@functools.cache
def _tokenizer(path: str):  # noqa: ANN202
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _hf_reference(kind: str, encodings: list[dict]) -> torch.Tensor:
    hf = tiny_hf_encoder(kind)
    rows = []
    with torch.no_grad():
        for enc in encodings:
            if kind.startswith("xlmr-"):  # one segment: RoBERTa tokenizers give no token types
                enc = {k: v for k, v in enc.items() if k != "token_type_ids"}
            out = hf(**{k: torch.tensor([v]) for k, v in enc.items()})
            if kind.endswith("rerank"):
                rows.append(out.logits[0])
            else:
                h = out.last_hidden_state[0]
                rows.append(F.normalize(h[0] if kind.endswith("embed-cls") else h.mean(0), dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_encoders_match_transformers(kind: str) -> None:
    """[CLS] and mean pooling with normalization, and a cross-encoder's score of (query, doc)
    pairs (whose second segment must get its own token-type embedding), as transformers computes
    them, to float32 rounding; the same for XLM-RoBERTa (positions past the padding id, one
    segment, RoBERTa's classifier head)."""
    path = make_tiny_encoder(kind)
    tok = _tokenizer(str(path))
    texts = sentences(12, seed=3)
    encodings = ([dict(tok(q, d)) for q, d in PAIRS] if kind.endswith("rerank")
                 else [dict(tok(t)) for t in texts])
    ours = torch.tensor(embed_in_process(make_scheduler(path), [e["input_ids"] for e in encodings]))
    ref = _hf_reference(kind, encodings)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 2e-6, (ours - ref).abs().max().item()
    if kind == "rerank":  # the segments matter: all-zero token types give other scores
        assert len({round(float(s), 4) for s in ours[:, 0]}) == len(PAIRS)


def test_pooling_read_from_the_files() -> None:
    """modules.json's Pooling and Normalize modules decide; a bare encoder pools [CLS]; a
    classifier is a cross-encoder; a decoder pools only when asked (--is-embedding)."""
    minilm = resolve_model(MINILM)
    assert pooling_for(minilm.model_dir, minilm.hf_config, False) == Pooling("mean", True)
    bare = make_tiny_encoder("embed-cls")
    assert pooling_for(bare, {"model_type": "bert"}, False) == Pooling("cls", True)
    assert pooling_for(bare, {"model_type": "xlm-roberta"}, False) == Pooling("cls", True)
    assert pooling_for(bare, {"model_type": "bert", "architectures": ["BertForSequenceClassification"]},
                       False).kind == "score"
    assert pooling_for(Path("/nonexistent"), {"model_type": "llama"}, False) is None
    assert pooling_for(Path("/nonexistent"), {"model_type": "llama"}, True) == Pooling("last", True)


def test_tiny_vector_is_bitwise_the_same_alone_and_in_a_batch_of_32() -> None:
    """A text's vector alone, and among 31 others of mixed lengths in one batch: the same bits;
    and no KV is kept after a pooled request."""
    path = make_tiny_encoder("embed-mean")
    tok = _tokenizer(str(path))
    prompts = [tok(t).input_ids for t in sentences(32, seed=5, max_words=60, lines=4)]
    sched = make_scheduler(path)
    alone = [embed_in_process(sched, [p], prefix=f"a{i}-")[0] for i, p in enumerate(prompts[:4])]
    batched = embed_in_process(sched, prompts, prefix="b")
    assert len({len(p) for p in prompts}) > 10
    assert batched[:4] == alone
    assert sched.allocator.available_size() == sched.max_total_tokens


@pytest.fixture(scope="module")
@marks("real_model")
def minilm() -> tuple:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(resolve_model(MINILM).model_dir), device="cpu")
    return make_scheduler(MINILM), packaged_tokenizer(MINILM), st


@pytest.mark.real_model
def test_minilm_matches_sentence_transformers(minilm: tuple) -> None:
    """300 sentences of 3 to 90 words: cosine >= 0.99999 each, largest element difference below
    1e-5 (docs/embeddings.md gives the measured figure)."""
    sched, tok, st = minilm
    texts = sentences(300, seed=1)
    ours = torch.tensor(embed_in_process(sched, [tok(t).input_ids for t in texts]))
    ref = st.encode(texts, convert_to_tensor=True, batch_size=32)
    cos = F.cosine_similarity(ours, ref)
    assert cos.min().item() >= 0.99999, cos.min().item()
    assert (ours - ref).abs().max().item() < 1e-5, (ours - ref).abs().max().item()


@pytest.mark.real_model
def test_minilm_ranks_documents_as_sentence_transformers(minilm: tuple) -> None:
    """A small retrieval set: for each query the documents in the same order by cosine, and the
    right document first."""
    sched, tok, st = minilm
    docs = ["The giant panda is a bear that eats bamboo in the mountains of China.",
            "Paris is the capital of France, on the river Seine.",
            "A compiler translates source code into machine instructions.",
            "The baker lights the oven at four and sells the first loaf at six.",
            "Rain is expected over the weekend, with storms on Sunday evening.",
            "The heart pumps blood through the arteries and veins of the body."]
    queries = ["which animal eats bamboo", "french capital city", "how are programs turned into code a CPU runs",
               "when does the bakery open", "weather forecast for the weekend", "what does the heart do"]
    ours = torch.tensor(embed_in_process(sched, [tok(t).input_ids for t in queries + docs]))
    ref = st.encode(queries + docs, convert_to_tensor=True)
    n = len(queries)
    our_order = (ours[:n] @ ours[n:].T).argsort(dim=1, descending=True)
    ref_order = (ref[:n] @ ref[n:].T).argsort(dim=1, descending=True)
    assert torch.equal(our_order, ref_order)
    assert our_order[:, 0].tolist() == list(range(n))


@pytest.mark.real_model
def test_minilm_vector_is_bitwise_the_same_alone_and_in_a_batch_of_32(minilm: tuple) -> None:
    sched, tok, _ = minilm
    prompts = [tok(t).input_ids for t in sentences(32, seed=9, lines=4)]
    alone = [embed_in_process(sched, [p], prefix=f"m{i}-")[0] for i, p in enumerate(prompts[:3])]
    assert embed_in_process(sched, prompts, prefix="mb")[:3] == alone


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoder_embedding_is_the_last_token_of_transformers(arch: str) -> None:
    """--is-embedding on a decoder: its last token's final-normed state, normalized (the
    Qwen3-Embedding recipe), as transformers computes it; bitwise alone and batched."""
    from lockstep.testing.tiny_models import make_tiny_model, tiny_hf_model

    path = make_tiny_model(arch)
    tok = _tokenizer(str(path))
    prompts = [tok(t).input_ids for t in sentences(8, seed=4, lines=2)]
    sched = make_scheduler(path, is_embedding=True)
    ours = torch.tensor(embed_in_process(sched, prompts))
    hf = tiny_hf_model(arch)
    with torch.no_grad():
        ref = torch.stack([F.normalize(hf.model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
                           for p in prompts])
    assert (ours - ref).abs().max().item() < 2e-5, (ours - ref).abs().max().item()
    assert embed_in_process(sched, prompts[:1], prefix="alone")[0] == ours[0].tolist()


@pytest.mark.real_model
def test_minilm_with_q8_0_stays_close_and_batch_invariant(minilm: tuple) -> None:
    """--quantization q8_0 (Q8_0 weights, int8 activations: the fast option, docs/embeddings.md):
    cosine >= 0.999 with sentence-transformers on 100 sentences, and a vector bitwise the same
    alone and in a batch of 100."""
    _, tok, st = minilm
    sched = make_scheduler(MINILM, quantization="q8_0")
    texts = sentences(100, seed=2)
    prompts = [tok(t).input_ids for t in texts]
    ours = torch.tensor(embed_in_process(sched, prompts))
    cos = F.cosine_similarity(ours, st.encode(texts, convert_to_tensor=True, batch_size=32))
    assert cos.min().item() >= 0.999, cos.min().item()
    alone = [embed_in_process(sched, [p], prefix=f"q{i}-")[0] for i, p in enumerate(prompts[:3])]
    assert torch.equal(torch.tensor(alone), ours[:3])
