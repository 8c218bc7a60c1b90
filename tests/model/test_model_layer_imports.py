"""The model layer (lockstep.layers, lockstep.models, lockstep.model_executor) imports no pydantic,
directly or through another lockstep module: the wire-facing shapes (SamplingParams, the HTTP
models) stay above it, and what it needs of a request reaches it as a ForwardBatch and tensors."""

from __future__ import annotations

import ast
from pathlib import Path

import lockstep

ROOT = Path(lockstep.__file__).parent
MODEL_LAYER = ("lockstep.layers", "lockstep.models", "lockstep.model_executor")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("lockstep", *path.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every module name an import in `path` names (at module level or inside a function)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_model_layer_reaches_no_pydantic() -> None:
    modules = _modules()
    imports = {name: _imports(path) for name, path in modules.items()}
    start = [m for m in modules if m.startswith(MODEL_LAYER)]
    assert start, "the model layer's modules were not found"
    via: dict[str, str | None] = {m: None for m in start}
    todo = list(start)
    while todo:
        mod = todo.pop()
        for name in imports[mod]:
            if name.split(".")[0] in ("pydantic", "pydantic_core"):
                chain = [mod]
                while via[chain[-1]] is not None:
                    chain.append(via[chain[-1]])
                raise AssertionError(f"{' <- '.join(chain)} imports {name}")
            # The package root imports its public names lazily (on attribute access), so
            # `from lockstep import kernels` loads only lockstep.kernels.
            if name in modules and name not in via and name != "lockstep":
                via[name] = mod
                todo.append(name)
