"""The fault-injection helper (lockstep.testing.faults) replaces methods by name: each of its
targets must exist, and installing one must say so in the log the server tests read."""

from __future__ import annotations

import importlib

import pytest

from lockstep.testing import faults


@pytest.mark.parametrize(("process", "method"), [
    ("scheduler-DP0-TP1-PP0", faults.SCHEDULER_METHOD),
    ("detokenizer", faults.DETOKENIZER_METHOD)])
def test_install_replaces_its_method_and_logs_the_marker(monkeypatch, capsys, process, method):
    module_name, class_name, name = method.rsplit(".", 2)
    cls = getattr(importlib.import_module(module_name), class_name)
    original = cls.__dict__[name]
    monkeypatch.setattr(cls, name, original)  # restored after the test
    monkeypatch.setenv(faults.PERTURB_ENV, process)
    faults.install()
    assert cls.__dict__[name] is not original
    assert faults.installed_marker(method) in capsys.readouterr().err


def test_a_missing_method_fails_loudly_by_name(monkeypatch):
    monkeypatch.setattr(faults, "SCHEDULER_METHOD", "lockstep.managers.scheduler.Scheduler.gone")
    monkeypatch.setenv(faults.PERTURB_ENV, "scheduler-DP0-TP1-PP0")
    with pytest.raises(AttributeError, match=r"Scheduler\.gone does not exist"):
        faults.install()


def test_no_fault_without_the_variable(monkeypatch, capsys):
    monkeypatch.delenv(faults.PERTURB_ENV, raising=False)
    faults.install()
    assert "[lockstep fault]" not in capsys.readouterr().err
