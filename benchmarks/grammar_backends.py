"""xgrammar vs llguidance on the default model's 262144-token vocabulary: tokenizer setup,
compile time per constraint, per-step mask time at batch 1 and 32, mask application.

    python benchmarks/grammar_backends.py [xgrammar|llguidance ...]

xgrammar is not a lockstep dependency (it pulls triton); to measure it, install it outside the
venv: `pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi` and add /tmp/xgr to
PYTHONPATH.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from lockstep.model_loader import resolve_model

VOCAB = 262144
SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"], "additionalProperties": False,
})
DATE = r"\d{4}-\d{2}-\d{2}"
EBNF = r'''root ::= "Answer: " expr "."
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
'''
# (kind, grammar, a text the grammar accepts: its tokens drive the per-step measurement)
CASES = [
    ("json_schema", SCHEMA, '{"name": "Alice Smith", "age": 42, "color": "green"}'),
    ("regex", DATE, "2024-05-17"),
    ("ebnf", EBNF, "Answer: (12+7)*3-40/5."),
]
REPEATS = 5


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f}"


class LLG:
    name = "llguidance"

    def __init__(self, hf_tok) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        self.llg, self.lt = llguidance, lt
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=VOCAB)
        self.executor = llguidance.LLExecutor()

    def grammar(self, kind: str, text: str) -> str:
        return self.llg.grammar_from({"ebnf": "gbnf"}.get(kind, kind), text)

    def compile(self, kind: str, text: str):
        m = self.llg.LLMatcher(self.tok, self.grammar(kind, text))
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled, kind: str, text: str):
        return compiled.deep_copy()

    def alloc(self, batch: int) -> torch.Tensor:
        return self.lt.allocate_token_bitmask(batch, VOCAB)

    def fill(self, matchers, mask: torch.Tensor) -> None:
        if len(matchers) == 1:
            self.lt.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(self, m, token: int) -> None:
        assert m.consume_token(token), m.get_error()


class XGR:
    name = "xgrammar"

    def __init__(self, hf_tok) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=VOCAB)

    def compile(self, kind: str, text: str):
        c = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        if kind == "json_schema":
            return c.compile_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(text)
        return c.compile_grammar(text)

    def matcher(self, compiled, kind: str, text: str):
        return self.xgr.GrammarMatcher(compiled)

    def alloc(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, VOCAB)

    def fill(self, matchers, mask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    def accept(self, m, token: int) -> None:
        assert m.accept_token(token)


def run(backend_cls, hf_tok) -> None:
    t0 = time.perf_counter()
    be = backend_cls(hf_tok)
    print(f"\n## {be.name}: tokenizer setup {time.perf_counter() - t0:.2f} s")
    print("| constraint | compile + first mask ms | mask+accept ms/step b=1 | b=32 (all 32 rows) |")
    for kind, text, sample in CASES:
        compile_t = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            compiled = be.compile(kind, text)
            # llguidance compiles lazily: the first mask finishes what xgrammar does up front.
            be.fill([be.matcher(compiled, kind, text)], be.alloc(1))
            compile_t.append(time.perf_counter() - t0)
        tokens = hf_tok.encode(sample, add_special_tokens=False)
        per_batch = {}
        for batch in (1, 32):
            ms_ = [be.matcher(compiled, kind, text) for _ in range(batch)]
            mask = be.alloc(batch)
            steps = []
            for tok in tokens:
                t0 = time.perf_counter()
                be.fill(ms_, mask)
                for m in ms_:
                    be.accept(m, tok)
                steps.append(time.perf_counter() - t0)
            per_batch[batch] = steps
        print(f"| {kind} | {ms(compile_t)} | {ms(per_batch[1])} | {ms(per_batch[32])} |")


def apply_cost() -> None:
    """lockstep's own mask application (layers/sampler.apply_vocab_mask_), either backend."""
    from lockstep.layers.sampler import apply_vocab_mask_

    for batch in (1, 32):
        mask = torch.randint(-2**31, 2**31 - 1, (batch, VOCAB // 32), dtype=torch.int32)
        logits = torch.randn(batch, VOCAB)
        rows = torch.arange(batch)
        xs = []
        for _ in range(REPEATS * 4):
            t0 = time.perf_counter()
            apply_vocab_mask_(logits, mask, rows)
            xs.append(time.perf_counter() - t0)
        print(f"apply mask, batch {batch}: {ms(xs)} ms")


def main() -> None:
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    hf_tok = AutoTokenizer.from_pretrained(str(resolve_model(None).model_dir))
    names = sys.argv[1:] or ["llguidance", "xgrammar"]
    for name in names:
        run({"llguidance": LLG, "xgrammar": XGR}[name], hf_tok)
    apply_cost()


if __name__ == "__main__":
    main()
