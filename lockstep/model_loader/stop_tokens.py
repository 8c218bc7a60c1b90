"""Which tokens end a generation besides EOS: the end-of-turn tokens of the chat formats we know
(matched by their text, as llama.cpp does), so that a chat reply ends at its turn's end."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>",
                      "<|end_of_text|>", "<|endoftext|>", "<|end|>")


def stop_token_ids(model_dir: str | Path, eos_token_ids: Iterable[int]) -> list[int]:
    """EOS ids of the config and generation_config.json, and the end-of-turn tokens the
    tokenizer has."""
    ids = set(eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tok_file = Path(model_dir) / "tokenizer.json"
    if tok_file.exists():
        ids |= set(_token_ids(tok_file, END_OF_TURN_TOKENS).values())
    return sorted(ids)


def _token_ids(tok_file: Path, tokens: Iterable[str]) -> dict[str, int]:
    """{token: id} for those of `tokens` the tokenizer has, looked up as `token_to_id` does
    (added tokens, then the model's vocabulary) in tokenizer.json itself: building the tokenizer
    would keep ~250 MB resident in every scheduler for a 262k vocabulary."""
    data = json.loads(tok_file.read_text(encoding="utf-8"))
    vocab = data.get("model", {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the index
        vocab = {piece[0]: i for i, piece in enumerate(vocab)}
    added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    found = {token: added.get(token, vocab.get(token)) for token in tokens}
    return {token: int(token_id) for token, token_id in found.items() if token_id is not None}
