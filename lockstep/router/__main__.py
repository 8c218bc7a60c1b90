"""`python -m lockstep.router [args]`: the same as `lockstep router`."""

from __future__ import annotations

import sys

from lockstep.router.server import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m lockstep.router"))
