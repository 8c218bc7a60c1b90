"""Stop strings and stop regexes, checked in the scheduler where tokens are produced (SGLang's
`Req.check_finished`), on every rank alike. A request with stops decodes its output as the
detokenizer does and searches only the new text plus the overlap a match can span. Regexes run on
RE2: linear in the text and the program (capped at admission), never exponential as `(a|aa)+b`
is when backtracking (docs/reliability.md). `limit` (ReqOutput.text_limit) leaves out the longest
suffix that could still grow into a stop (for a regex, by RE2 on its prefix closure), so the
detokenizer never streams part of one, and is the cut once a stop matched."""

from __future__ import annotations

import re._constants as sre
import re._parser as sre_parse
import warnings
from dataclasses import dataclass
from typing import Any

import re2

from lockstep.detokenizer.incremental_detokenizer import IncrementalDetokenizer
from lockstep.sampling_params import SamplingParams

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
            viable = re2.compile(f"(?{_flags(tree.state.flags)}:{_seq(list(tree), True)})\\z", _OPTIONS)
            span = tree.getwidth()[1]
        except (Warning, sre.error, re2.error, ValueError, TypeError, KeyError, OverflowError,
                RecursionError):
            viable, span = None, STOP_REGEX_LOOKBACK
        if viable is not None and viable.programsize > 4 * STOP_REGEX_MAX_PROGRAM:
            viable = None
        return cls(pattern, search, viable, max(1, min(span, STOP_REGEX_LOOKBACK)))

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
    if (m := rx.search(window, len(text[lo:start].encode()))) is None:
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
        # Each stop's first match in the new text, as (start, end, stop); the earliest wins.
        found = [(pos, pos + len(stop), stop) for stop in self.stops
                 if (pos := text.find(stop, max(0, self.checked - len(stop) + 1))) != -1]
        found += [(*m, rx.pattern) for rx in self.regexes
                  if (m := _search(rx.search, text, max(0, self.checked - rx.span + 1)))]
        best = min(found, key=lambda f: f[0], default=None)
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


_CLASSES = {sre.CATEGORY_DIGIT: r"\d", sre.CATEGORY_NOT_DIGIT: r"\D", sre.CATEGORY_SPACE: r"\s",
            sre.CATEGORY_NOT_SPACE: r"\S", sre.CATEGORY_WORD: r"\w", sre.CATEGORY_NOT_WORD: r"\W"}
_ANCHORS = {sre.AT_BEGINNING: "^", sre.AT_BEGINNING_STRING: r"\A", sre.AT_END: "$",
            sre.AT_END_STRING: r"\z", sre.AT_BOUNDARY: r"\b", sre.AT_NON_BOUNDARY: r"\B"}


def _flags(flags: int) -> str:
    return "".join(c for f, c in ((sre.SRE_FLAG_IGNORECASE, "i"), (sre.SRE_FLAG_MULTILINE, "m"),
                                  (sre.SRE_FLAG_DOTALL, "s")) if flags & f)


def _char(c: int) -> str:
    return chr(c) if chr(c).isascii() and chr(c).isalnum() else f"\\x{{{c:x}}}"


def _seq(items: list, closure: bool) -> str:
    """A parsed sequence written back in RE2 syntax; with `closure`, a regex for every prefix of
    what it matches: prefixes(x rest) = prefixes(x) | x prefixes(rest)."""
    if not closure or not items:
        return "".join(_one(i, False) for i in items)
    head = _one(items[0], True)
    return head if len(items) == 1 else f"(?:{head}|{_one(items[0], False)}{_seq(items[1:], True)})"


def _one(item: tuple, closure: bool) -> str:
    op, av = item
    if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN):  # one character
        atom = ("." if op is sre.ANY else _char(av) if op is sre.LITERAL else
                f"[^{_char(av)}]" if op is sre.NOT_LITERAL else "[" + "".join(
                    "^" if k is sre.NEGATE else _char(v) if k is sre.LITERAL else
                    f"{_char(v[0])}-{_char(v[1])}" if k is sre.RANGE else _CLASSES[v]
                    for k, v in av) + "]")
        return f"(?:{atom})?" if closure else atom
    if op is sre.AT:  # zero width: a prefix may end before it
        return "" if closure else _ANCHORS[av]
    if op is sre.BRANCH:
        return "(?:" + "|".join(_seq(list(alt), closure) for alt in av[1]) + ")"
    if op is sre.SUBPATTERN:
        on, off = _flags(av[1]), _flags(av[2])
        return f"(?{on}{'-' + off if off else ''}:{_seq(list(av[3]), closure)})"
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
        lo, hi, sub = av
        body, most = _seq(list(sub), False), "" if hi == sre.MAXREPEAT else hi
        if not closure:
            return f"(?:{body}){{{lo},{most}}}"  # (laziness does not change what matches)
        return "" if hi == 0 else f"(?:{body}){{0,{'' if most == '' else hi - 1}}}{_seq(list(sub), True)}"
    raise ValueError(f"no RE2 form for {op}")
