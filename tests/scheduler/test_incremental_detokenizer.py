from __future__ import annotations

import random

import pytest

from lockstep.detokenizer.incremental_detokenizer import IncrementalDetokenizer

# ---------------------------------------------------------------------------------------------
# A byte-level toy tokenizer: one token may carry part of a UTF-8 character, like byte-level BPE.


class ByteTokenizer:
    def __init__(self, pieces: list[bytes], *, strip_leading_space: bool = False) -> None:
        self.pieces = pieces
        self.strip_leading_space = strip_leading_space

    def encode(self, chunks: list[bytes]) -> list[int]:
        return [self.pieces.index(c) for c in chunks]

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True) -> str:
        text = b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")
        # Mimics SentencePiece decoders (Llama 2, Mistral) that drop the sequence's first space.
        if self.strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text


def _stream(tokenizer, ids, chunk=1, **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = []
    for i in range(0, len(ids), chunk):
        detok.push(ids[i : i + chunk])
        deltas.append(detok.release())
    return detok, deltas


def _toy(texts: list[str]) -> tuple[ByteTokenizer, list[int]]:
    pieces = [t.encode() for t in texts]
    return ByteTokenizer(pieces), list(range(len(pieces)))


def test_plain_stream_concatenates_to_text():
    tok, ids = _toy(["Hello", ",", " world", "!"])
    detok, deltas = _stream(tok, ids)
    assert deltas == ["Hello", ",", " world", "!"]
    assert detok.text == "Hello, world!"


def test_multibyte_char_split_over_tokens_is_never_emitted_broken():
    raw = "a€b😀".encode()
    tok = ByteTokenizer([bytes([b]) for b in raw])
    detok, deltas = _stream(tok, list(range(len(raw))))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == "a€b😀"


def test_release_holds_back_what_the_limit_leaves_out():
    tok, ids = _toy(["abc E", "N", "x"])
    detok = IncrementalDetokenizer(tok)
    detok.push([ids[0]])
    assert detok.release(4) == "abc "
    detok.push([ids[1]])
    assert detok.release(4) == ""
    detok.push([ids[2]])
    assert detok.release() == "ENx"
    assert detok.release(2) == ""  # a limit below what is out never takes text back


def test_an_incomplete_trailing_char_is_never_released():
    tok = ByteTokenizer([b"ok E", "\u00e9".encode()[:1]])
    detok = IncrementalDetokenizer(tok)
    detok.push([0, 1])
    assert detok.release() == "ok E" and detok.text == "ok E"


# ---------------------------------------------------------------------------------------------
# The real Gemma 3 tokenizer (SentencePiece with byte fallback).


@pytest.fixture(scope="module")
def gemma_tokenizer():
    """Gemma 3 270M's tokenizer as lockstep converts it (test_loader holds it equal to
    transformers' own reading of the GGUF, which takes ~40 s to build)."""
    from lockstep.testing.inproc import packaged_tokenizer
    from lockstep.testing.live_server import GEMMA

    return packaged_tokenizer(GEMMA)


def _random_ids(rng: random.Random, tokenizer, n: int) -> list[int]:
    # Sequences that decode to U+FFFD hold invalid UTF-8 (stray byte tokens); a model does not
    # produce those, and a trailing one is never released by design.
    vocab = len(tokenizer)
    while True:
        ids = [rng.randrange(vocab) for _ in range(n)]
        if "\ufffd" not in tokenizer.decode(ids, skip_special_tokens=False):
            return ids


@pytest.mark.real_model
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_equals_full_decode_on_random_sequences(gemma_tokenizer, skip_special_tokens):
    rng = random.Random(1234 + skip_special_tokens)
    for _ in range(150):
        ids = _random_ids(rng, gemma_tokenizer, rng.randint(1, 40))
        detok, deltas = _stream(
            gemma_tokenizer,
            ids,
            chunk=rng.randint(1, 3),
            skip_special_tokens=skip_special_tokens,
        )
        expected = gemma_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detok.text == expected, ids


@pytest.mark.real_model
def test_stream_with_common_words_and_special_tokens(gemma_tokenizer):
    text = "<start_of_turn>user\n Hello,   world!\n\n  indented\tand tabs<end_of_turn>\n"
    ids = gemma_tokenizer.encode(text, add_special_tokens=True)
    for skip in (True, False):
        detok, deltas = _stream(gemma_tokenizer, ids, skip_special_tokens=skip)
        assert "".join(deltas) == gemma_tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.text == "<bos>" + text


@pytest.mark.real_model
@pytest.mark.parametrize(
    "text",
    [
        "你好，世界！こんにちは、世界。안녕하세요",
        "emoji 🎉👍🏽👨‍👩‍👧 mixed 中文 text 🦙",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ ᚠᛇᚻ",
    ],
)
def test_cjk_and_emoji_stream_token_by_token(gemma_tokenizer, text):
    ids = gemma_tokenizer.encode(text, add_special_tokens=False)
    detok, deltas = _stream(gemma_tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == text


@pytest.mark.real_model
def test_characters_spelled_out_in_byte_fallback_tokens(gemma_tokenizer):
    text = "x你🎉y"
    byte_ids = gemma_tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in text.encode()])
    detok, deltas = _stream(gemma_tokenizer, byte_ids)
    assert all("\ufffd" not in d for d in deltas)
    assert [d for d in deltas if d] == ["x", "你", "🎉", "y"]
    assert detok.text == text
    # A character cut off by the end of generation is dropped, not emitted as U+FFFD.
    detok, deltas = _stream(gemma_tokenizer, byte_ids[:3])
    assert "".join(deltas) == "x"
