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
    from tokenizers import Tokenizer

    ids = set(eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tok_file = Path(model_dir) / "tokenizer.json"
    if tok_file.exists():
        tok = Tokenizer.from_file(str(tok_file))
        ids |= {i for t in END_OF_TURN_TOKENS if (i := tok.token_to_id(t)) is not None}
    return sorted(ids)
