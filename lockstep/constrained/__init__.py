"""Constrained decoding: regex, JSON schema and EBNF constraints on the sampled tokens.

llguidance does the grammar work (chosen by measurement: docs/benchmarks.md, "Grammar backend").
`constraint.py` names and checks a request's constraint (front process: no tokenizer needed);
`backend.py` turns it into a per-request matcher over the model's vocabulary (scheduler ranks).
"""

from lockstep.constrained.backend import (
    GrammarBackend,
    GrammarMatcher,
    grammar_backend_for,
    request_matcher,
)
from lockstep.constrained.constraint import (
    CONSTRAINT_KINDS,
    Constraint,
    ConstraintError,
    json_object_constraint,
    json_schema_constraint,
    validate_constraint,
)

__all__ = [
    "CONSTRAINT_KINDS",
    "Constraint",
    "ConstraintError",
    "GrammarBackend",
    "GrammarMatcher",
    "grammar_backend_for",
    "request_matcher",
    "json_object_constraint",
    "json_schema_constraint",
    "validate_constraint",
]
