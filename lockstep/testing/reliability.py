"""What the reliability suites share (tests/reliability/test_reliability.py, tests/reliability/test_hostile_inputs.py):
each test's short form (the default run) and long form (`soak`), the servers' flags and key, a
greedy /generate and the printed figures docs/reliability.md records."""

from __future__ import annotations

from typing import Any

import pytest
import requests

SHORT, LONG = "short", "long"
FORMS = [SHORT, pytest.param(LONG, marks=pytest.mark.soak)]
API_KEY = "sk-reliability"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# float32: greedy outputs are exact, so a request's output can be compared with itself alone
MODEL_ARGS = ("--dtype", "float32")


def report(name: str, **figures: Any) -> None:
    """Print the figures a test measured (shown with -s; docs/reliability.md records them)."""
    shown = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in figures.items())
    print(f"\n[reliability] {name}: {shown}", flush=True)


def generate(url: str, text: str = "hello there", max_new: int = 8, **extra: Any) -> dict:
    """A greedy /generate of exactly `max_new` tokens behind API_KEY; it must answer 200."""
    r = requests.post(url + "/generate", headers=AUTH, timeout=120, json={
        "text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                          "ignore_eos": True}, **extra})
    assert r.status_code == 200, r.text
    return r.json()
