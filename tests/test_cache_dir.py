"""Where lockstep caches converted models, compiled kernels and test models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lockstep.utils.cache import cache_dir


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux layout")
def test_the_cache_stays_in_dot_cache_lockstep_on_linux(monkeypatch, tmp_path):
    monkeypatch.delenv("LOCKSTEP_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir("kernels") == tmp_path / ".cache" / "lockstep" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "lockstep"


def test_lockstep_cache_dir_overrides_the_platforms_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir("tiny") == Path(tmp_path / "mine" / "tiny")
