"""Embed a corpus with all-MiniLM-L6-v2 side by side: lockstep's serving path (the scheduler and
model runner in this process, as tests/model/test_bert.py drives them: no HTTP) against
sentence-transformers, on the same torch threads, rounds interleaved (the machine is shared).
With `--llama-server URL`, llama.cpp's `llama-server --embedding` on the same model as a GGUF
(its own converter) is a third system, over HTTP (its /v1/embeddings, `--llama-batch` texts a call).
Prints one JSON line per (system, round) and a summary: sentences/s, tokens/s, the latency of one
short query, and each system's agreement with sentence-transformers (min cosine, max difference).

    python benchmarks/embed_side_by_side.py --sentences 2000 --threads 2 --rounds 1
        [--llama-server http://127.0.0.1:PORT] [--quantization q8_0] [--st-bfloat16]

Figures: docs/benchmarks.md, "Embeddings: all-MiniLM-L6-v2 against sentence-transformers and llama-server (2026-12-05)"."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F

from lockstep.model_loader import resolve_model
from lockstep.testing.corpus import random_prompt
from lockstep.testing.embedding_oracle import embed_in_process
from lockstep.testing.inproc import make_scheduler, packaged_tokenizer

MODEL = "all-minilm-l6-v2"
QUERY = "which animal eats bamboo in the mountains of China?"


def corpus(tok, n: int, lo: int, hi: int, seed: int) -> tuple[list[str], list[list[int]]]:  # noqa: ANN001
    """`n` runs of corpus words whose token counts (with [CLS] and [SEP]) are in [lo, hi]."""
    rng = random.Random(seed)
    texts: list[str] = []
    ids: list[list[int]] = []
    while len(texts) < n:
        text = random_prompt(rng, rng.randint(lo * 2 // 3, hi * 3 // 4))
        got = tok(text).input_ids
        if lo <= len(got) <= hi:
            texts.append(text)
            ids.append(got)
    return texts, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch")
    ap.add_argument("--max-running-requests", type=int, default=64, help="lockstep's batch")
    ap.add_argument("--llama-server", default=None, help="URL of llama-server --embedding")
    ap.add_argument("--quantization", default=None, help="lockstep's --quantization (e.g. q8_0)")
    ap.add_argument("--llama-batch", type=int, default=64, help="texts per llama-server call")
    ap.add_argument("--st-bfloat16", action="store_true",
                    help="also sentence-transformers with bfloat16 weights and activations (its fast "
                         "CPU setting), to compare lockstep's --quantization at a like agreement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    tok = packaged_tokenizer(MODEL)
    texts, ids = corpus(tok, args.sentences, args.min_tokens, args.max_tokens, seed=0)
    n_tokens = sum(map(len, ids))
    st = SentenceTransformer(str(resolve_model(MODEL).model_dir), device="cpu")
    sched = make_scheduler(MODEL, max_running_requests=args.max_running_requests,
                           **({"quantization": args.quantization} if args.quantization else {}))
    query_ids = tok(QUERY).input_ids
    calls = 0

    def lockstep_run(batch: list[list[int]]) -> list[list[float]]:
        nonlocal calls
        calls += 1
        return embed_in_process(sched, batch, prefix=f"c{calls}-")

    systems = {
        "lockstep": (lambda: lockstep_run(ids), lambda: lockstep_run([query_ids])),
        "sentence-transformers": (lambda: st.encode(texts, batch_size=args.batch_size).tolist(),
                                  lambda: st.encode([QUERY]).tolist()),
    }
    if args.st_bfloat16:
        st16 = SentenceTransformer(str(resolve_model(MODEL).model_dir), device="cpu",
                                   model_kwargs={"torch_dtype": torch.bfloat16})
        systems["sentence-transformers-bf16"] = (
            lambda: st16.encode(texts, batch_size=args.batch_size, convert_to_tensor=True).float().tolist(),
            lambda: st16.encode([QUERY], convert_to_tensor=True).float().tolist())
    if args.llama_server:
        import requests

        def llama(batch: list[str]) -> list[list[float]]:
            out: list[list[float]] = []
            for i in range(0, len(batch), args.llama_batch):
                r = requests.post(args.llama_server + "/v1/embeddings", timeout=600,
                                  json={"input": batch[i:i + args.llama_batch], "model": MODEL})
                r.raise_for_status()
                out += [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
            return out

        systems["llama-server"] = (lambda: llama(texts), lambda: llama([QUERY]))
    for _, (_, one) in systems.items():  # warm them up
        one()
    rows: dict[str, list[dict]] = {name: [] for name in systems}
    vectors: dict[str, torch.Tensor] = {}
    for r in range(args.rounds):
        for name, (embed_all, one) in systems.items():
            t0 = time.perf_counter()
            vectors[name] = torch.tensor(embed_all())
            dt = time.perf_counter() - t0
            lat = []
            for _ in range(10):
                t1 = time.perf_counter()
                one()
                lat.append(time.perf_counter() - t1)
            row = {"system": name, "round": r, "sentences": len(texts), "tokens": n_tokens,
                   "threads": args.threads, "seconds": round(dt, 2),
                   "sentences_per_s": round(len(texts) / dt, 1),
                   "tokens_per_s": round(n_tokens / dt, 0),
                   "one_query_ms_median": round(statistics.median(lat) * 1e3, 1)}
            rows[name].append(row)
            print(json.dumps(row), flush=True)
    ref = vectors["sentence-transformers"]
    best = {name: max(x["sentences_per_s"] for x in rs) for name, rs in rows.items()}
    print(json.dumps({"summary": best,
                      "lockstep_over": {n: round(best["lockstep"] / v, 2) for n, v in best.items()
                                        if n != "lockstep"},
                      "agreement_with_st": {n: {"min_cosine": F.cosine_similarity(v, ref).min().item(),
                                                "max_abs_diff": (v - ref).abs().max().item()}
                                            for n, v in vectors.items() if n != "sentence-transformers"}}))


if __name__ == "__main__":
    main()
