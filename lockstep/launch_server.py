"""`python -m lockstep.launch_server [server args]`: the same as `lockstep serve`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from lockstep.cli import run_serve

    run_serve(sys.argv[1:] if argv is None else argv, prog="python -m lockstep.launch_server")


if __name__ == "__main__":
    main()
