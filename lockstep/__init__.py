"""lockstep: an SGLang-compatible LLM serving runtime in Python and PyTorch.

`lockstep.Engine(**server_args)` is the offline API; `lockstep serve` the HTTP server. The Engine
is imported on first use, so `import lockstep` (and `lockstep --help`) stays fast."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    __version__ = _version("lockstep")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0"

if TYPE_CHECKING:
    from lockstep.entrypoints.engine import Engine
    from lockstep.server_args import ServerArgs

__all__ = ["Engine", "ServerArgs", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from lockstep.entrypoints.engine import Engine

        return Engine
    if name == "ServerArgs":
        from lockstep.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
