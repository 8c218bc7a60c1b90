"""A request's output constraint, and its check before any token is generated.

The check needs no tokenizer (llguidance validates a grammar on its own), so the front process
runs it before dispatch: a bad regex, schema or grammar is a 400 that names the problem, and a
streaming request fails before its stream starts. The scheduler compiles the same text again
against the vocabulary; that compile cannot fail where this check passed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

ConstraintKind = Literal["regex", "json_schema", "ebnf"]
# SGLang's sampling_params names, in the order its error message lists them.
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = ("regex", "json_schema", "ebnf")

# JSON is generated as json.dumps writes it by default: one space after ',' and ':', no other
# whitespace. Flexible whitespace lets a small model pad forever with newlines before a value.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}


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
                schema = json.loads(self.text)
                if not isinstance(schema, (dict, bool)):
                    raise ConstraintError("json_schema must be a JSON object (a JSON Schema)")
                return llguidance.LLMatcher.grammar_from_json_schema(strict_schema(schema),
                                                                     defaults=JSON_OPTIONS)
            return llguidance.grammar_from("gbnf", self.text)
        except ConstraintError:
            raise
        except json.JSONDecodeError as e:
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
    schema that says nothing about additionalProperties admits only its declared keys, and a
    prefixItems tuple without `items` no further items. Without this, a small model keeps
    inventing keys for a pydantic schema until max_tokens (instructor's
    IncompleteOutputException). The bare {"type": "object"} (json_object) stays any object.
    llguidance has no option for this (its JsonCompileOptions are separators, whitespace,
    coerce_one_of and lenient), nor unevaluatedProperties/-Items, read here as
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
    """Raise ConstraintError naming the problem when `c` cannot be compiled."""
    error = llguidance.LLMatcher.validate_grammar(c.grammar())
    if error:
        raise ConstraintError(f"invalid {c.kind}: {_one_line(error)}")


def json_schema_constraint(schema: dict[str, Any] | bool) -> Constraint:
    """Output that is one JSON value matching `schema` (for response_format and tool calls)."""
    return Constraint("json_schema", json.dumps(schema))


def json_object_constraint() -> Constraint:
    """Output that is any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return json_schema_constraint({"type": "object"})


def _one_line(msg: str) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= 500 else msg[:500] + "..."


def constraint_from_fields(regex: str | None, json_schema: str | None,
                           ebnf: str | None) -> Constraint | None:
    """The constraint named by SGLang's sampling_params fields, checked; at most one may be set."""
    given = [(k, v) for k, v in zip(CONSTRAINT_KINDS, (regex, json_schema, ebnf)) if v is not None]
    if len(given) > 1:
        raise ConstraintError("Only one of regex, json_schema, or ebnf can be set.")
    if not given:
        return None
    c = Constraint(*given[0])
    validate_constraint(c)
    return c


def check_stop_regex(patterns: list[str]) -> list[str]:
    """stop_regex patterns must compile (they are searched with the `regex` module)."""
    import regex

    for p in patterns:
        try:
            regex.compile(p)
        except regex.error as e:
            raise ConstraintError(f"stop_regex {p!r} is not a valid regular expression: {e}") from None
    return patterns
