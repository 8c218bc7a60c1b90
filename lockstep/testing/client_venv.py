"""A virtual environment of its own for third-party software that tests drive against a live
server (SGLang's frontend, LangChain, instructor ...), so the project's environment stays lean
and nothing such a client pins can change the packages lockstep runs on.

Made once under `root` (pytest's temporary root, which outlives a run), keyed by the
requirements and this interpreter, and reused while its ready mark is there. `share_site` lets
it see this interpreter's packages (a .pth file): for software that needs torch, which must not
be installed twice (a second, CUDA build)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import sysconfig
import venv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# pip's words when the package index cannot be reached (the caller may skip, saying so).
_NO_INDEX = ("Could not find a version", "No matching distribution", "Failed to establish",
             "Temporary failure in name resolution", "Network is unreachable", "ConnectTimeout")


class PackageIndexUnreachable(RuntimeError):
    """pip could not reach the package index for the requirements."""


def client_venv(root: Path, requirements: Sequence[str], *, no_deps: bool = False,
                share_site: bool = False, timeout: float = 1200) -> Path:
    """The venv's python, with `requirements` installed (pip's own resolution unless no_deps)."""
    key = hashlib.sha256(repr((sys.prefix, list(requirements), no_deps, share_site)).encode())
    name = re.sub(r"[^A-Za-z0-9.-]+", "-", requirements[0])
    path = root / f"venv-{name}-{key.hexdigest()[:12]}"
    python = path / "bin" / "python"
    ready = path / "lockstep-ready"
    if ready.exists():
        return python
    venv.create(path, with_pip=True, clear=True)
    if share_site:
        site = subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True).strip()
        (Path(site) / "lockstep_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([python, "-m", "pip", "install", "-q", *(["--no-deps"] * no_deps),
                           *requirements], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        if any(s in done.stderr + done.stdout for s in _NO_INDEX):
            raise PackageIndexUnreachable(
                f"pip cannot reach the package index for {requirements}: {done.stderr[-300:]}")
        raise RuntimeError(f"pip install {requirements} failed:\n{done.stderr[-3000:]}")
    ready.write_text("\n".join(requirements) + "\n")
    return python


def run_client(python: Path, program: str, url: str, cwd: Path, timeout: float = 900) -> Any:
    """Run `program` (a script that takes the server's URL) with the venv's `python`; it must
    succeed, and its last line of output is JSON: the parsed value."""
    script = cwd / "client_program.py"
    script.write_text(program)
    done = subprocess.run([python, str(script), url], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
