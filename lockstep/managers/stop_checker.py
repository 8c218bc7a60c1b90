"""Stop strings and stop regexes, checked in the scheduler where tokens are produced (SGLang's
`Req.check_finished`), on every rank alike: same tokens, same tokenizer, same decision.

A request with stops decodes its output as the detokenizer does (the same IncrementalDetokenizer)
and checks only the new text plus the overlap a match can span: a stop string's length less one,
a regex's longest match less one, at most STOP_REGEX_LOOKBACK characters (a pattern without a
bound, such as `a.*b`, is found when its match spans no more than that). Regexes run on RE2, whose
time is linear in the text it reads and in the pattern's program, never exponential: `(a|aa)+b`,
which makes a backtracking engine take seconds on 40 characters, costs what any pattern costs.
The program size is capped at admission (STOP_REGEX_MAX_PROGRAM), so one request's checking per
token is bounded (docs/reliability.md has the measured bound).

The detokenizer must never stream part of a stop: each output carries `limit`, how much of the
text is final, which leaves out the longest suffix that could still grow into a stop (for a regex,
a suffix that is a prefix of some match: an RE2 search for the pattern's prefix closure anchored at
the end). On a match, `limit` is where the text is cut (after the stop with no_stop_trim).
"""

from __future__ import annotations

import re._constants as sre
import re._parser as sre_parse
import warnings
from dataclasses import dataclass
from typing import Any

import re2

from lockstep.core import SamplingParams
from lockstep.detokenizer.incremental_detokenizer import IncrementalDetokenizer

STOP_REGEX_LOOKBACK = 512  # characters a stop_regex match may span
STOP_REGEX_MAX_PROGRAM = 500  # RE2 program size (automaton instructions) of one stop_regex
_OPTIONS = re2.Options()
_OPTIONS.never_capture = True  # spans only: captures would make RE2 leave its DFA for an NFA
_OPTIONS.log_errors = False


@dataclass(frozen=True)
class StopRegex:
    pattern: str
    search: Any  # re2 regexp of the pattern
    viable: Any | None  # its prefix closure anchored at the end; None: hold back `span - 1` chars
    span: int  # the longest match, at most STOP_REGEX_LOOKBACK

    @classmethod
    def compile(cls, pattern: str) -> StopRegex:
        """ValueError naming stop_regex when RE2 cannot take the pattern."""
        try:
            search = re2.compile(pattern, _OPTIONS)
        except re2.error as e:
            why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else e
            raise ValueError(f"stop_regex {pattern!r} is not a regular expression RE2 accepts "
                             f"(no backreferences or lookarounds): {why}") from None
        if search.programsize > STOP_REGEX_MAX_PROGRAM:
            raise ValueError(f"stop_regex {pattern!r} is too large: its RE2 program has "
                             f"{search.programsize} instructions, more than {STOP_REGEX_MAX_PROGRAM}")
        try:  # Python's parser reads RE2's syntax but for a few classes (\pL, [[:alpha:]]: warns)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                tree = sre_parse.parse(pattern)
            viable = re2.compile(f"{_flags(tree.state.flags)}(?:{_prefixes(list(tree))})\\z", _OPTIONS)
            span = tree.getwidth()[1]
        except (Warning, sre.error, re2.error, ValueError, TypeError, KeyError, OverflowError,
                RecursionError):
            viable, span = None, STOP_REGEX_LOOKBACK
        if viable is not None and viable.programsize > 4 * STOP_REGEX_MAX_PROGRAM:
            viable = None
        return cls(pattern, search, viable, max(1, min(span, STOP_REGEX_LOOKBACK)))

    def find(self, text: str, start: int) -> tuple[int, int] | None:
        """The leftmost match that starts at `start` or later: (start, end) in characters."""
        m = _search(self.search, text, start)
        return m and (m[0], m[1])

    def viable_from(self, text: str) -> int:
        """Where the earliest suffix of `text` that could still become a match begins."""
        start = max(0, len(text) - self.span + 1)
        if self.viable is None:
            return start
        m = _search(self.viable, text, start)
        return len(text) if m is None else m[0]


def _search(rx: Any, text: str, start: int) -> tuple[int, int] | None:
    # RE2 reads a str's whole UTF-8 encoding each call: search the window's bytes, with one
    # character before it as context for ^, \b and (?m)$.
    lo = max(0, start - 1)
    window = text[lo:].encode()
    m = rx.search(window, len(text[lo:start].encode()))
    if m is None:
        return None
    s, e = m.span()
    return lo + len(window[:s].decode()), lo + len(window[:e].decode())


def stop_checker(tokenizer: Any, p: SamplingParams) -> tuple[StopChecker | None, str | None]:
    """(checker or None when the request has no stops, None) or (None, why it is refused)."""
    if not (p.stop or p.stop_regex):
        return None, None
    if tokenizer is None:
        return None, "stop and stop_regex need a tokenizer, and this model has none"
    try:
        return StopChecker(tokenizer, p), None
    except ValueError as e:
        return None, str(e)


class StopChecker:
    """One request's stop strings and regexes over the text of its output."""

    def __init__(self, tokenizer: Any, p: SamplingParams) -> None:
        self.decoder = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens)
        self.stops = tuple(dict.fromkeys(s for s in p.stop if s))
        self.regexes = tuple(StopRegex.compile(r) for r in dict.fromkeys(p.stop_regex))
        self.no_stop_trim = p.no_stop_trim
        self.checked = 0  # characters of the text already searched for a match
        self.limit = 0  # characters of the text that are final (the cut, once matched)
        self.matched: str | None = None

    def push(self, token: int) -> str | None:
        """Take a sampled token; the stop (string or pattern) it completes, if any."""
        text = self.decoder.push([token])
        if len(text) == self.checked:
            return None
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            pos = text.find(stop, max(0, self.checked - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, pos + len(stop), stop)
        for rx in self.regexes:
            m = rx.find(text, max(0, self.checked - rx.span + 1))
            if m is not None and (best is None or m[0] < best[0]):
                best = (*m, rx.pattern)
        self.checked = len(text)
        if best is not None:
            self.matched = best[2]
            self.limit = best[1] if self.no_stop_trim else best[0]
            return self.matched
        self.limit = max(self.limit, self._viable_from(text))
        return None

    def text_limit(self, finished: bool) -> int | None:
        """What an output tells the detokenizer: the characters that are final, or None (all of
        them) once the request ended other than by a stop."""
        return self.limit if self.matched is not None or not finished else None

    def _viable_from(self, text: str) -> int:
        """Where the earliest suffix that could still grow into a stop begins."""
        n = len(text)
        held = min((rx.viable_from(text) for rx in self.regexes), default=n)
        for stop in self.stops:
            i = max(0, n - len(stop) + 1)
            while i < held:  # the longest suffix that is a prefix of the stop string
                i = text.find(stop[0], i, held)
                if i == -1:
                    break
                if stop.startswith(text[i:]):
                    held = i
                    break
                i += 1
        return held


def _flags(flags: int) -> str:
    on = "".join(c for f, c in ((sre.SRE_FLAG_IGNORECASE, "i"), (sre.SRE_FLAG_MULTILINE, "m"),
                                (sre.SRE_FLAG_DOTALL, "s")) if flags & f)
    return f"(?{on})" if on else ""


def _prefixes(items: list) -> str:
    """A regex matching every prefix of what the sequence `items` matches (RE2 syntax).
    prefixes(x rest) = prefixes(x) | x prefixes(rest)."""
    if not items:
        return ""
    head, rest = items[0], items[1:]
    if not rest:
        return _prefixes1(head)
    return f"(?:{_prefixes1(head)}|{_regex1(head)}{_prefixes(rest)})"


def _prefixes1(item: tuple) -> str:
    op, av = item
    if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN):
        return f"(?:{_regex1(item)})?"
    if op is sre.BRANCH:
        return "(?:" + "|".join(_prefixes(list(alt)) for alt in av[1]) + ")"
    if op is sre.SUBPATTERN:
        return f"(?{_group_flags(av)}:{_prefixes(list(av[3]))})"
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
        lo, hi, sub = av
        if hi == 0:
            return ""
        reps = "*" if hi == sre.MAXREPEAT else f"{{0,{hi - 1}}}"
        return f"(?:{_regex(list(sub))}){reps}{_prefixes(list(sub))}"
    if op is sre.AT:
        return ""
    raise ValueError(f"no prefix closure for {op}")


def _regex(items: list) -> str:
    return "".join(_regex1(i) for i in items)


def _char(c: int) -> str:
    return chr(c) if chr(c).isascii() and chr(c).isalnum() else f"\\x{{{c:x}}}"


_CATEGORIES = {sre.CATEGORY_DIGIT: r"\d", sre.CATEGORY_NOT_DIGIT: r"\D",
               sre.CATEGORY_SPACE: r"\s", sre.CATEGORY_NOT_SPACE: r"\S",
               sre.CATEGORY_WORD: r"\w", sre.CATEGORY_NOT_WORD: r"\W"}
_ANCHORS = {sre.AT_BEGINNING: "^", sre.AT_BEGINNING_STRING: r"\A", sre.AT_END: "$",
            sre.AT_END_STRING: r"\z", sre.AT_BOUNDARY: r"\b", sre.AT_NON_BOUNDARY: r"\B"}


def _regex1(item: tuple) -> str:
    op, av = item
    if op is sre.LITERAL:
        return _char(av)
    if op is sre.NOT_LITERAL:
        return f"[^{_char(av)}]"
    if op is sre.ANY:
        return "."
    if op is sre.IN:
        parts = []
        for kind, v in av:
            if kind is sre.NEGATE:
                parts.append("^")
            elif kind is sre.LITERAL:
                parts.append(_char(v))
            elif kind is sre.RANGE:
                parts.append(f"{_char(v[0])}-{_char(v[1])}")
            else:
                parts.append(_CATEGORIES[v])
        return "[" + "".join(parts) + "]"
    if op is sre.BRANCH:
        return "(?:" + "|".join(_regex(list(alt)) for alt in av[1]) + ")"
    if op is sre.SUBPATTERN:
        return f"(?{_group_flags(av)}:{_regex(list(av[3]))})"
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
        lo, hi, sub = av
        return f"(?:{_regex(list(sub))}){{{lo},{'' if hi == sre.MAXREPEAT else hi}}}"
    if op is sre.AT:
        return _ANCHORS[av]
    raise ValueError(f"cannot write {op} for RE2")


def _group_flags(av: tuple) -> str:
    on, off = _flags(av[1])[2:-1], _flags(av[2])[2:-1]
    return on + (f"-{off}" if off else "")
