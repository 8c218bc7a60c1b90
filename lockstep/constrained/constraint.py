"""A request's output constraint, and its check before any token is generated. The check needs no
model tokenizer (it validates the grammar and runs its first bytes over a byte vocabulary), so
the front runs it before dispatch: a bad, unbounded or unsatisfiable constraint is a 400 naming
the problem. The scheduler compiles the same text against the vocabulary, under the same limits."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

import llguidance
import orjson
from pydantic import AfterValidator

ConstraintKind = Literal["regex", "json_schema", "ebnf"]
# SGLang's sampling_params names, in the order its error message lists them.
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = get_args(ConstraintKind)

# JSON is generated as json.dumps writes it by default: one space after ',' and ':', no other
# whitespace. Flexible whitespace lets a small model pad forever with newlines before a value.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}


# Limits every constraint is held to, the same in the front's check and the scheduler's compile.
# Longer texts are refused before they are parsed.
MAX_CONSTRAINT_CHARS = 256 * 1024
# Nesting of a JSON schema (json_schema, response_format, tool parameters), checked without
# recursion before anything walks it: Python's json module raises RecursionError near 1,000
# levels, and llguidance refuses past 128.
MAX_SCHEMA_DEPTH = 64
# llguidance's resource limits. Its default lexer fuel let `a{100000}` take 0.4 s per mask and
# `a{1000000}` fail only at its first token, each stalling every request on the rank; at 100k a
# large realistic schema still compiles (30 properties with patterns, a 300-value enum).
# verbose_errors off: an error names the limit, never the engine's internal state.
GRAMMAR_LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=100_000, verbose_errors=False)
# Bytes of output the front's check generates before it calls a grammar sound (see _probe).
PROBE_STEPS = 8


class ConstraintError(ValueError):
    """The constraint's text is not a valid regex, JSON schema or grammar."""


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    text: str  # the regex, the JSON schema as a JSON string, or the GBNF/Lark grammar

    def grammar(self) -> str:
        """The llguidance grammar for this constraint; ConstraintError when it cannot be built."""
        try:
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.text)
            if self.kind == "json_schema":
                schema = orjson.loads(self.text)  # its depth limit is checked without recursion
                if not isinstance(schema, (dict, bool)):
                    raise ConstraintError("json_schema must be a JSON object (a JSON Schema)")
                check_schema_depth(schema, "json_schema")  # before strict_schema walks it
                return llguidance.LLMatcher.grammar_from_json_schema(strict_schema(schema),
                                                                     defaults=JSON_OPTIONS)
            return llguidance.grammar_from("gbnf", self.text)
        except ConstraintError:
            raise
        except orjson.JSONDecodeError as e:
            raise ConstraintError(f"json_schema is not valid JSON: {e}") from None
        except ValueError as e:
            raise ConstraintError(f"invalid {self.kind}: {_one_line(str(e))}") from None


# Keys that do not change what a schema admits (xgrammar skips the same ones when it decides
# whether a schema is the bare {"type": "object"}).
_ANNOTATIONS = frozenset({"title", "default", "description", "examples", "deprecated",
                          "readOnly", "writeOnly", "$comment", "$schema"})
# Where subschemas sit that stand for values of their own. Not `not`, `if`, `allOf` or
# `contains`: closing an object there would change what the whole schema admits.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("additionalProperties", "items", "then", "else")


def strict_schema(schema: Any) -> Any:
    """`schema` as SGLang's default backend (xgrammar, strict_mode=True) reads it: an object
    schema silent on additionalProperties admits only its declared keys, a prefixItems tuple
    without `items` no more items (else a small model invents keys until max_tokens:
    instructor's IncompleteOutputException); the bare {"type": "object"} stays any object.
    llguidance has no such option, nor unevaluatedProperties/-Items, read here as
    additionalProperties/items where those are absent. The input is not modified."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for uneval, plain in (("unevaluatedProperties", "additionalProperties"),
                          ("unevaluatedItems", "items")):
        if uneval in out and plain not in out:
            out[plain] = out.pop(uneval)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = strict_schema(out[key])
    types = out.get("type")
    is_object = ("object" in types if isinstance(types, list) else types == "object") or (
        types is None and "properties" in out)
    if (is_object and "additionalProperties" not in out
            and set(out) - _ANNOTATIONS != {"type"}):
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out:
        out["items"] = False
    return out


def validate_constraint(c: Constraint) -> None:
    """Raise ConstraintError naming the problem when `c` cannot be compiled, exceeds a limit,
    or fails within its first bytes of output."""
    if len(c.text) > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(f"{c.kind} has {len(c.text)} characters; the limit is "
                              f"{MAX_CONSTRAINT_CHARS}")
    if error := _grammar_error(c):
        raise ConstraintError(error)


@functools.lru_cache(maxsize=256)
def _grammar_error(c: Constraint) -> str | None:
    grammar = c.grammar()
    if error := llguidance.LLMatcher.validate_grammar(grammar, limits=GRAMMAR_LIMITS):
        return f"invalid {c.kind}: {_one_line(error)}"
    return _probe(c.kind, grammar)


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    """One token per byte and an end token: the front has no llguidance tokenizer (one over a
    262k vocabulary takes seconds to build) and needs none to run a grammar."""
    vocab = type("Bytes", (), {"eos_token_id": 256, "bos_token_id": None,
                               "special_token_ids": [256], "__call__": lambda _, text: list(text),
                               "tokens": [bytes([i]) for i in range(256)] + [b"<end>"]})
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab()))


def _probe(kind: str, grammar: str) -> str | None:
    """Generate up to PROBE_STEPS bytes under the grammar, taking the lowest byte allowed each
    time. llguidance reports some failures only there: a grammar with no finite output
    (`{"$ref": "#"}`, `x ::= "a" x`) or one past its lexer limits (`a{1000000}`) validates, then
    fails at the first or second token, where it once gave a 500 or an empty 200."""
    m = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=GRAMMAR_LIMITS)
    step = 0
    while step < PROBE_STEPS and not m.is_error() and not m.is_accepting():
        mask = m.compute_bitmask()
        byte = next((i for i in range(256) if mask[i >> 3] >> (i & 7) & 1), None)
        if m.is_error() or byte is None:
            break
        m.consume_token(byte)
        step += 1
    if not m.is_error() and (m.is_accepting() or step == PROBE_STEPS):
        return None
    why = clean_grammar_error(m.get_error()) or "nothing can follow"
    if step == 0:
        return f"invalid {kind}: no output can satisfy it ({why})"
    return f"invalid {kind}: it exceeds the grammar engine's limits ({why})"


def clean_grammar_error(error: str) -> str:
    return _one_line(error.replace("<non-verbose/>", ""))


def check_schema_depth(value: Any, where: str) -> Any:
    """Raise ConstraintError when `value` nests deeper than MAX_SCHEMA_DEPTH (no recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ConstraintError(f"{where} is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        children = item.values() if isinstance(item, dict) else item
        stack += [(c, depth + 1) for c in children if isinstance(c, (dict, list))]
    return value


# A JSON schema in a request body (response_format, tool parameters): depth checked at parse.
SchemaObject = Annotated[dict[str, Any],
                         AfterValidator(lambda v: check_schema_depth(v, "the schema"))]


def json_schema_constraint(schema: dict[str, Any] | bool) -> Constraint:
    """Output that is one JSON value matching `schema` (for response_format and tool calls)."""
    return Constraint("json_schema", json.dumps(schema))


def _one_line(msg: str) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= 500 else msg[:500] + "..."


def constraint_from_fields(regex: str | None, json_schema: str | None,
                           ebnf: str | None) -> Constraint | None:
    """The constraint named by SGLang's sampling_params fields (not validated: see
    validate_constraint); at most one may be set."""
    given = [(k, v) for k, v in zip(CONSTRAINT_KINDS, (regex, json_schema, ebnf)) if v is not None]
    if len(given) > 1:
        raise ConstraintError("Only one of regex, json_schema, or ebnf can be set.")
    return Constraint(*given[0]) if given else None
