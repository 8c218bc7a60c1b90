"""Benchmark datasets from the built-in corpus: deterministic, no downloads.

Prompts are runs of the corpus (``lockstep.testing.corpus``) cut to an exact token count with the
server's own tokenizer. Lengths count every token the server sees, the <bos> its tokenizer adds
included, so ``--random-input-len 256`` means 256 prompt tokens in the server's usage report.

Two datasets with SGLang ``bench_serving``'s names and semantics, and two of lockstep's own:

* ``random``: per request an input length drawn uniformly from
  ``[max(1, int(input_len * range_ratio)), input_len]`` and likewise an output length; SGLang's
  default ratio 0.0 gives lengths from 1 up; ``--random-range-ratio 1`` gives exact lengths.
* ``generated-shared-prefix``: ``num_groups`` system prompts of ``system_prompt_len`` tokens,
  each followed by ``prompts_per_group`` different questions of ``question_len`` tokens;
  requests are shuffled with the seed.
* ``edit`` (issue 22's W-edit): a corpus passage of ``edit_passage_len`` tokens after an
  instruction to repeat it or lightly edit it, rendered with the model's chat template, so most of
  the answer repeats the prompt: the workload where n-gram speculation pays (code edits, RAG
  answers with quotes).
* ``chat`` (issue 36's W-chat): ordinary questions (``CHAT_QUESTIONS``), one user turn each in the
  model's template; answers end at the model's end of turn or ``chat_output_len``.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from lockstep.testing.corpus import corpus_text


@dataclass
class DatasetRow:
    prompt: str
    prompt_len: int  # tokens the server sees, special tokens included
    output_len: int
    input_ids: list[int] | None = None  # the prompt's token ids (special tokens included)
    group: int | None = None  # shared-prefix group, if any


def load_tokenizer(path: str | None = None) -> Any:
    """The server's tokenizer: an HF dir / tokenizer name, or a GGUF / a packaged model's short
    name / None (the default model), which go through lockstep's loader and its conversion cache."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from lockstep.model_loader.packaged import PACKAGED_MODELS

    p = Path(path).expanduser() if path and path not in PACKAGED_MODELS else None
    if p is not None and p.is_dir() and ((p / "tokenizer.json").exists()
                                         or (p / "tokenizer_config.json").exists()):
        return AutoTokenizer.from_pretrained(str(p))
    if p is not None and not p.exists():
        return AutoTokenizer.from_pretrained(path)  # a hub name; only if cached locally
    from lockstep.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(path).model_dir))


def _n_special(tokenizer: Any) -> int:
    """Tokens the tokenizer adds around a text (a <bos> for Gemma and Llama)."""
    return len(tokenizer("a").input_ids) - len(tokenizer("a", add_special_tokens=False).input_ids)


@functools.lru_cache(maxsize=8)
def _corpus_ids(tokenizer: Any) -> tuple[int, ...]:
    # Lines joined by spaces: every line boundary is a plain word boundary.
    text = " ".join(line.strip() for line in corpus_text().splitlines() if line.strip())
    return tuple(tokenizer(text, add_special_tokens=False).input_ids)


def _encode_len(tokenizer: Any, text: str, special: bool) -> int:
    return len(tokenizer(text, add_special_tokens=special).input_ids)


def corpus_text_of_len(tokenizer: Any, rng: random.Random, n_tokens: int,
                       special: bool = True) -> tuple[str, int]:
    """A corpus run whose encoding is ``n_tokens`` long (special tokens counted when `special`).

    Slices the tokenized corpus (wrapping around) at a random offset and decodes it; decoding and
    re-encoding can merge or split a token at the edges, so the slice is adjusted until the
    re-encoded length is exact (or as close as a few tries get, which is returned too).
    Exactly one draw from `rng`.
    """
    ids = _corpus_ids(tokenizer)
    start = rng.randrange(len(ids))
    extra = _n_special(tokenizer) if special else 0
    want = max(0, n_tokens - extra)
    if want == 0:
        return "", extra

    def text_of(k: int) -> str:
        reps = (start + k) // len(ids) + 1
        stream = ids * reps if reps > 1 else ids
        return tokenizer.decode(list(stream[start:start + k]), skip_special_tokens=True).strip()

    k, best = want, None
    for _ in range(8):
        text = text_of(k)
        got = _encode_len(tokenizer, text, special)
        if best is None or abs(got - n_tokens) < abs(best[1] - n_tokens):
            best = (text, got)
        if got == n_tokens:
            break
        k = max(1, k + (n_tokens - got))
    if best[1] != n_tokens:  # trim or pad word by word to land exactly
        text, got = best
        words = text.split(" ")
        pad_rng = random.Random(start)
        for _ in range(64):
            if got == n_tokens:
                break
            if got > n_tokens and len(words) > 1:
                words.pop()
            else:
                words.append(pad_rng.choice(("the", "a", "and", "of", "to", "in")))
            text = " ".join(words)
            got = _encode_len(tokenizer, text, special)
        if abs(got - n_tokens) < abs(best[1] - n_tokens):
            best = (text, got)
    return best


def sample_random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float = 0.0, seed: int = 1) -> list[DatasetRow]:
    rng = random.Random(seed)
    in_lo = max(int(input_len * range_ratio), 1)
    out_lo = max(int(output_len * range_ratio), 1)
    rows = []
    for _ in range(num_prompts):
        n_in = rng.randint(min(in_lo, input_len), input_len)
        n_out = rng.randint(min(out_lo, output_len), output_len)
        text, got = corpus_text_of_len(tokenizer, rng, n_in)
        rows.append(DatasetRow(text, got, n_out, tokenizer(text).input_ids))
    return rows


GSP_SEPARATOR = "\n\n"


def sample_generated_shared_prefix_requests(
        tokenizer: Any, num_groups: int, prompts_per_group: int, system_prompt_len: int,
        question_len: int, output_len: int, seed: int = 1) -> list[DatasetRow]:
    """Groups sharing a system prompt; the system prompt's tokens (<bos> included) form a prefix
    that every prompt of the group shares token for token."""
    rng = random.Random(seed)
    # The separator's tokens count towards the question, so prompts are system + question long.
    n_sep = len(tokenizer(GSP_SEPARATOR, add_special_tokens=False).input_ids)
    rows = []
    for g in range(num_groups):
        system, _ = corpus_text_of_len(tokenizer, rng, system_prompt_len)
        for _ in range(prompts_per_group):
            question, _ = corpus_text_of_len(tokenizer, rng, max(1, question_len - n_sep),
                                             special=False)
            text = system + GSP_SEPARATOR + question
            ids = tokenizer(text).input_ids
            rows.append(DatasetRow(text, len(ids), output_len, ids, group=g))
    rng.shuffle(rows)
    return rows


# Repeat or lightly edit: the answer copies the passage, with small changes in the last two.
EDIT_INSTRUCTIONS = (
    "Repeat the following passage word for word, and nothing else.",
    "Copy the passage below exactly as it is written.",
    "Rewrite the passage below with the same words, correcting any typos you find.",
    "Repeat the passage below, but write every number in words.",
)


def _render_user_turn(tokenizer: Any, user: str) -> str:
    """`user` as one chat turn in the model's template, without the <bos> the server adds (both
    servers get the same text, so the prompts match token for token); plain text if none."""
    import json
    from pathlib import Path

    from lockstep.entrypoints.openai.chat_templates import render_chat, resolve_chat_template

    config_path = Path(tokenizer.name_or_path) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    template = resolve_chat_template(None, tokenizer.chat_template, config.get("model_type", ""),
                                     config.get("architectures") or [])
    if template is None:
        return user + "\n\n"
    text = render_chat(tokenizer, template, [{"role": "user", "content": user}])
    bos = tokenizer.bos_token or ""
    return text[len(bos):] if bos and text.startswith(bos) else text


def sample_edit_requests(tokenizer: Any, num_prompts: int, passage_len: int, output_len: int,
                         seed: int = 1) -> list[DatasetRow]:
    rng = random.Random(seed)
    rows = []
    for i in range(num_prompts):
        passage, _ = corpus_text_of_len(tokenizer, rng, passage_len, special=False)
        text = _render_user_turn(tokenizer, f"{EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)]}"
                                            f"\n\n{passage}")
        ids = tokenizer(text).input_ids
        rows.append(DatasetRow(text, len(ids), output_len, ids))
    return rows


# W-chat (issue 36): what a user of a chat model asks. Ordinary questions, not corpus text: random-token
# prompts make a small model loop, which flatters any n-gram drafter.
CHAT_QUESTIONS = (
    "What is the capital of France? Answer in one sentence.",
    "What is 2+2?",
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Write a short poem about autumn leaves.",
    "How do I boil an egg?",
    "What are the main causes of climate change?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "What is photosynthesis?",
    "Suggest a name for a small bakery and say why.",
    "How does a bicycle stay upright when it moves?",
    "What should I pack for a weekend hiking trip?",
    "Why do cats purr?",
    "Explain what a computer program is to a child.",
    "What is the tallest mountain in the world, and how tall is it?",
)


def sample_chat_requests(tokenizer: Any, num_prompts: int, output_len: int) -> list[DatasetRow]:
    """The first `num_prompts` of CHAT_QUESTIONS, each one user turn in the model's template."""
    if not 0 < num_prompts <= len(CHAT_QUESTIONS):
        raise ValueError(f"the chat dataset has {len(CHAT_QUESTIONS)} questions; asked for {num_prompts}")
    rows = []
    for question in CHAT_QUESTIONS[:num_prompts]:
        text = _render_user_turn(tokenizer, question)
        ids = tokenizer(text).input_ids
        rows.append(DatasetRow(text, len(ids), output_len, ids))
    return rows


# Each dataset's name, and the prefix of its own flags (recorded with each result): the one list
# of datasets, so that a new one cannot be offered without its flags being recorded.
DATASET_ARG_PREFIXES = {"random": "random_", "generated-shared-prefix": "gsp_", "edit": "edit_",
                        "chat": "chat_"}


def get_dataset(args: Any, tokenizer: Any) -> list[DatasetRow]:
    """Rows for parsed bench_serving-style args (see `add_dataset_args`)."""
    if args.dataset_name == "random":
        return sample_random_requests(tokenizer, args.num_prompts, args.random_input_len,
                                      args.random_output_len, args.random_range_ratio, args.seed)
    if args.dataset_name == "generated-shared-prefix":
        return sample_generated_shared_prefix_requests(
            tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
            args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len, args.seed)
    if args.dataset_name == "edit":
        return sample_edit_requests(tokenizer, args.num_prompts, args.edit_passage_len,
                                    args.edit_output_len, args.seed)
    if args.dataset_name == "chat":
        return sample_chat_requests(tokenizer, args.num_prompts, args.chat_output_len)
    raise ValueError(f"unknown dataset {args.dataset_name!r}")


def add_dataset_args(parser: Any) -> None:
    parser.add_argument("--dataset-name", default="random",
                        choices=list(DATASET_ARG_PREFIXES),
                        help="Built-in deterministic datasets (no downloads).")
    parser.add_argument("--num-prompts", type=int, default=1000,
                        help="Requests in the random dataset (default: 1000).")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=1024)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="Lengths are drawn from [len * ratio, len]; 1.0 = exact lengths.")
    parser.add_argument("--gsp-num-groups", type=int, default=64)
    parser.add_argument("--gsp-prompts-per-group", type=int, default=16)
    parser.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    parser.add_argument("--gsp-question-len", type=int, default=128)
    parser.add_argument("--gsp-output-len", type=int, default=256)
    parser.add_argument("--edit-passage-len", type=int, default=300,
                        help="Tokens of the passage the edit dataset asks to repeat or edit.")
    parser.add_argument("--edit-output-len", type=int, default=256)
    parser.add_argument("--chat-output-len", type=int, default=160,
                        help="Most tokens of a chat dataset answer (answers end at the end of turn).")
    parser.add_argument("--tokenizer", default=None,
                        help="Tokenizer for exact prompt lengths: HF dir, GGUF file, or unset for "
                             "the default model's.")
    parser.add_argument("--seed", type=int, default=1)
