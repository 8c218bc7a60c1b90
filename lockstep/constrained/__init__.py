"""Constrained decoding: regex, JSON schema and EBNF constraints on the sampled tokens.

llguidance does the grammar work (chosen by measurement: docs/benchmarks.md, "Grammar backend").
`constraint.py` names and checks a request's constraint (front process: no tokenizer needed);
`backend.py` turns it into a per-request matcher over the model's vocabulary (scheduler ranks).
Names are imported from those two modules, the one place each is defined."""
