"""SGLang's own frontend language, unchanged, against a live lockstep server on the real default
model: `gen(stop=...)`, `gen(regex=...)`, `gen(dtype=int)` and `select`.

sglang==0.5.23 is installed with --no-deps into a venv of its own (lockstep.testing.client_venv:
under pytest's temporary root, reused by later runs), with the few packages its import needs;
that venv also sees this interpreter's site-packages for numpy, torch and requests, so nothing
is installed into the project's environment and no CUDA torch is pulled. The test skips, saying why, only
when pip cannot reach the package index."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import requests

from lockstep.testing.client_venv import PackageIndexUnreachable, client_venv, run_client

pytestmark = pytest.mark.real_model

SGLANG = "sglang==0.5.23"
# What `import sglang` needs beyond this environment's packages (found by importing it).
RUNTIME_NEEDS = ["pybase64", "pillow", "msgspec", "ipython", "traitlets", "triton"]

PROGRAM = r'''
import json, sys
import sglang as sgl

@sgl.function
def quiz(s):
    s += "Q: What is the capital of France?\nA:"
    s += sgl.gen("answer", max_tokens=24, stop="\n", temperature=0)
    s += "\nThe treaty was signed on "
    s += sgl.gen("date", regex=r"\d{4}-\d{2}-\d{2}", max_tokens=16, temperature=0)
    s += "\nIs Paris in France? Answer: "
    s += sgl.select("yes_no", choices=["yes", "no"])
    s += "\nHow many legs does a spider have? "
    s += sgl.gen("legs", dtype=int, max_tokens=6, temperature=0)

sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
state = quiz.run()
print(json.dumps({k: state[k] for k in ("answer", "date", "yes_no", "legs")}))
'''


@pytest.fixture(scope="module")
def sglang_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.getbasetemp().parent
    try:
        python = client_venv(root, [SGLANG, *RUNTIME_NEEDS], no_deps=True, share_site=True)
    except PackageIndexUnreachable as e:
        pytest.skip(str(e))
    check = subprocess.run([python, "-c", "import sglang, torch; print(torch.__version__)"],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert "+cpu" in check.stdout or "cuda" not in check.stdout, check.stdout
    return python


def test_sglang_program_runs_unchanged(real_server, sglang_python, tmp_path):
    state = run_client(sglang_python, PROGRAM, real_server.url, tmp_path)

    # gen(stop="\n") is the native API's greedy text cut at the stop string.
    plain = requests.post(real_server.url + "/generate", json={
        "text": "Q: What is the capital of France?\nA:",
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "stop": "\n"}},
        timeout=300).json()
    assert state["answer"] == plain["text"] and "\n" not in state["answer"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", state["date"]), state
    assert state["yes_no"] in ("yes", "no")
    assert re.fullmatch(r"-?\d+", state["legs"].strip()), state


def test_sglang_runs_on_this_interpreter_torch(sglang_python):
    """The frontend's venv uses this environment's CPU torch, not one of its own."""
    out = subprocess.run([sglang_python, "-c", "import torch; print(torch.__file__)"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith(sysconfig.get_paths()["purelib"]), out
    assert sys.version_info[:2] == tuple(map(int, subprocess.check_output(
        [sglang_python, "-c", "import sys; print(*sys.version_info[:2])"], text=True).split()))
