"""How fast float32 can go: sentence-transformers' all-MiniLM-L6-v2 throughput on this machine as a
share of torch's own float32 matrix-multiply rate, and the agreement a narrower product would keep.
The encoder's linears are nearly all of its arithmetic (6 layers x (4 x 384^2 + 2 x 384 x 1536)
multiply-adds a token), so sentence-transformers' sentences/s turned into the linears' GFLOP/s,
over the GFLOP/s of one float32 matmul of the encoder's MLP shape (2,048 tokens), bounds what any
float32 encoder can gain on these threads: not a kernel of ours, the machine's float32 arithmetic.
Then the same corpus with every linear's input and weight rounded to bfloat16 (float32 products and
sums: what AVX512-BF16's dot products compute) against float32: its min cosine and max difference.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/embed_ceiling.py --sentences 1000 --threads 2

Figures: docs/benchmarks.md, "Embeddings: the float32 ceiling"."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.embed_side_by_side import MODEL, corpus
from lockstep.model_loader import resolve_model
from lockstep.testing.inproc import packaged_tokenizer

MACS_PER_TOKEN = 6 * (4 * 384 * 384 + 2 * 384 * 1536)  # all-MiniLM-L6-v2's linears


def matmul_gflops(rounds: int = 50) -> float:
    a, b = torch.randn(2048, 384), torch.randn(384, 1536)
    for _ in range(5):
        a @ b
    t = time.perf_counter()
    for _ in range(rounds):
        a @ b
    return 2 * 2048 * 384 * 1536 * rounds / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    texts, ids = corpus(packaged_tokenizer(MODEL), args.sentences, 16, 128, seed=0)
    st = SentenceTransformer(str(resolve_model(MODEL).model_dir), device="cpu")
    st.encode(texts[:64], batch_size=args.batch_size)
    peak = matmul_gflops()
    t = time.perf_counter()
    ref = st.encode(texts, batch_size=args.batch_size, convert_to_tensor=True)
    took = time.perf_counter() - t
    linears = 2 * MACS_PER_TOKEN * sum(map(len, ids)) / took / 1e9
    print(f"sentence-transformers: {len(texts) / took:.1f} sentences/s; its linears alone at {linears:.1f} GFLOP/s "
          f"(counting all of its time); torch float32 matmul {peak:.1f} GFLOP/s: "
          f"at most {peak / linears:.2f}x faster in float32")
    linear = F.linear

    def bf16_products(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x.bfloat16().float(), w.bfloat16().float(), bias)

    torch.nn.modules.linear.F.linear = bf16_products  # what nn.Linear.forward calls
    try:
        got = st.encode(texts, batch_size=args.batch_size, convert_to_tensor=True)
    finally:
        torch.nn.modules.linear.F.linear = linear
    cos = F.cosine_similarity(got, ref)
    print(f"bfloat16 products, float32 sums: min cosine {cos.min().item():.7f}, "
          f"max difference {(got - ref).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
