"""Benchmarks: datasets, metrics, one_batch on a tiny model, the serving client against a server.

Nothing here times anything: the assertions are about counts and arithmetic, never speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep.bench.datasets import (
    CHAT_QUESTIONS,
    EDIT_INSTRUCTIONS,
    load_tokenizer,
    sample_chat_requests,
    sample_edit_requests,
    sample_generated_shared_prefix_requests,
    sample_random_requests,
)
from lockstep.bench.serving import RequestOutput, calculate_metrics, request_intervals
from lockstep.testing.live_server import API_KEY, LiveServer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return load_tokenizer(str(model_dir))


# ---- datasets --------------------------------------------------------------------------------


def test_random_dataset_is_deterministic_and_exact(tokenizer) -> None:
    a = sample_random_requests(tokenizer, 12, 64, 16, range_ratio=1.0, seed=7)
    b = sample_random_requests(tokenizer, 12, 64, 16, range_ratio=1.0, seed=7)
    c = sample_random_requests(tokenizer, 12, 64, 16, range_ratio=1.0, seed=8)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert len({r.prompt for r in a}) == 12
    for r in a:
        assert r.output_len == 16
        assert r.prompt_len == 64
        assert len(tokenizer(r.prompt).input_ids) == 64  # what the server will count


def test_random_dataset_range_ratio(tokenizer) -> None:
    rows = sample_random_requests(tokenizer, 40, 50, 20, range_ratio=0.5, seed=1)
    assert all(25 <= r.prompt_len <= 50 and 10 <= r.output_len <= 20 for r in rows)
    assert len({r.prompt_len for r in rows}) > 5
    for r in rows:
        assert len(tokenizer(r.prompt).input_ids) == r.prompt_len


def test_shared_prefix_dataset(tokenizer) -> None:
    rows = sample_generated_shared_prefix_requests(tokenizer, 3, 4, 96, 12, 8, seed=2)
    again = sample_generated_shared_prefix_requests(tokenizer, 3, 4, 96, 12, 8, seed=2)
    assert [r.prompt for r in rows] == [r.prompt for r in again]
    assert len(rows) == 12 and len({r.prompt for r in rows}) == 12
    assert sorted(r.group for r in rows) == sorted([0, 1, 2] * 4)
    assert [r.group for r in rows] != sorted(r.group for r in rows)  # shuffled
    for g in range(3):
        ids = [r.input_ids for r in rows if r.group == g]
        prefix = ids[0][:96]
        assert all(x[:96] == prefix for x in ids)  # the system prompt is a shared token prefix
    others = [r.input_ids[:96] for r in rows if r.group != rows[0].group]
    assert all(o != rows[0].input_ids[:96] for o in others)
    for r in rows:
        assert r.output_len == 8
        assert abs(r.prompt_len - (96 + 12)) <= 1
        assert len(tokenizer(r.prompt).input_ids) == r.prompt_len


def test_edit_dataset_asks_to_repeat_a_passage_in_the_chat_template(tokenizer) -> None:
    rows = sample_edit_requests(tokenizer, 5, 60, 32, seed=3)
    assert [r.prompt for r in rows] == [r.prompt for r in sample_edit_requests(tokenizer, 5, 60, 32, 3)]
    assert len({r.prompt for r in rows}) == 5
    for i, r in enumerate(rows):
        # One user turn in the tokenizer's template (the tiny model's is ChatML), the reply's next.
        assert r.prompt.startswith(f"<|im_start|>user\n{EDIT_INSTRUCTIONS[i % 4]}\n\n")
        assert r.prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
        # One <bos>, the one the server adds: the template's own is not sent twice.
        assert r.input_ids == tokenizer(r.prompt).input_ids and r.prompt_len == len(r.input_ids)
        assert r.input_ids.count(tokenizer.bos_token_id) == 1
        assert r.output_len == 32 and 60 < r.prompt_len < 60 + 60


def test_chat_dataset_asks_each_question_once_in_the_chat_template(tokenizer) -> None:
    rows = sample_chat_requests(tokenizer, 12, 160)
    assert len(rows) == 12 and len({r.prompt for r in rows}) == 12
    for question, r in zip(CHAT_QUESTIONS, rows):
        assert r.prompt == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        assert r.input_ids == tokenizer(r.prompt).input_ids and r.output_len == 160
    with pytest.raises(ValueError, match="16 questions"):
        sample_chat_requests(tokenizer, len(CHAT_QUESTIONS) + 1, 8)


# ---- metrics ---------------------------------------------------------------------------------


def test_metrics_hand_computed() -> None:
    outs = [
        RequestOutput(success=True, prompt_len=10, output_len=5, ttft=0.1, latency=0.5,
                      itl=[0.1, 0.1, 0.1, 0.1]),
        RequestOutput(success=True, prompt_len=20, output_len=3, ttft=0.2, latency=0.6,
                      itl=[0.2, 0.2]),
        RequestOutput(success=False, prompt_len=30, error="boom"),
    ]
    m = calculate_metrics(outs, duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input, m.total_output) == (30, 8)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.input_throughput == pytest.approx(15.0)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_throughput == pytest.approx(19.0)
    assert m.concurrency == pytest.approx(0.55)  # (0.5 + 0.6) / 2
    assert m.mean_ttft_ms == pytest.approx(150.0)
    assert m.median_ttft_ms == pytest.approx(150.0)
    assert m.p99_ttft_ms == pytest.approx(199.0)  # linear interpolation between 100 and 200
    # TPOT: (0.5 - 0.1) / 4 = 100 ms and (0.6 - 0.2) / 2 = 200 ms
    assert m.mean_tpot_ms == pytest.approx(150.0)
    # ITL: four of 100 ms, two of 200 ms
    assert m.mean_itl_ms == pytest.approx(800 / 6)
    assert m.median_itl_ms == pytest.approx(100.0)
    assert m.max_itl_ms == pytest.approx(200.0)
    assert m.mean_e2e_latency_ms == pytest.approx(550.0)
    assert m.median_e2e_latency_ms == pytest.approx(550.0)
    assert m.prefix_cache_hit_rate is None  # no server said
    assert m.per_user_output_throughput == pytest.approx((5 / 0.5 + 3 / 0.6) / 2)
    assert m.spec_accept_length is None  # no server said


def test_spec_accept_length_is_tokens_per_verify_pass_of_requests_that_report_it() -> None:
    outs = [RequestOutput(success=True, output_len=30, latency=1.0, spec_verify_ct=10),
            RequestOutput(success=True, output_len=20, latency=1.0, spec_verify_ct=5),
            RequestOutput(success=True, output_len=500, latency=1.0)]  # not reported
    assert calculate_metrics(outs, duration_s=3.0).spec_accept_length == pytest.approx(50 / 15)


def test_prefix_cache_hit_rate_counts_only_requests_that_report_it() -> None:
    outs = [
        RequestOutput(success=True, prompt_len=100, output_len=1, cached_tokens=60),
        RequestOutput(success=True, prompt_len=50, output_len=1, cached_tokens=0),
        RequestOutput(success=True, prompt_len=1000, output_len=1),  # not reported
        RequestOutput(success=False, prompt_len=80, cached_tokens=80),  # failed
    ]
    assert calculate_metrics(outs, duration_s=1.0).prefix_cache_hit_rate == pytest.approx(60 / 150)


def test_metrics_all_failed_is_not_a_crash() -> None:
    m = calculate_metrics([RequestOutput(error="x")], duration_s=1.0)
    assert (m.completed, m.failed, m.total_output, m.mean_ttft_ms) == (0, 1, 0, 0.0)


def test_poisson_intervals() -> None:
    assert request_intervals(5, float("inf"), 0) == [0.0] * 5
    gaps = request_intervals(2000, 4.0, 0)
    assert gaps == request_intervals(2000, 4.0, 0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)


# ---- one_batch -------------------------------------------------------------------------------


def test_one_batch_on_tiny_model(model_dir: Path, tmp_path: Path, capsys) -> None:
    from lockstep.bench import one_batch

    out = tmp_path / "r.jsonl"
    rc = one_batch.main(["--model-path", str(model_dir), "--batch-size", "1", "2",
                         "--input-len", "12", "--output-len", "4", "--hf-batch-sizes", "1", "2",
                         "--dtype", "float32", "--result-file", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["engine"], r["batch_size"]) for r in rows] == [
        ("lockstep", 1), ("lockstep", 2), ("hf", 1), ("hf", 2)]
    for r in rows:
        assert (r["input_len"], r["output_len"]) == (12, 4)
        assert r["prefill_s"] > 0 and r["decode_step_s"] > 0 and r["total_s"] >= r["prefill_s"]
    text = capsys.readouterr().out
    assert "decode tok/s" in text and "lockstep/HF" in text


# ---- serving client against a live server ------------------------------------------------------


@pytest.mark.parametrize("backend", ["lockstep", "openai"])
def test_serving_client_against_live_server(llama_server: LiveServer, model_dir: Path, tmp_path: Path,
                                            backend: str) -> None:
    from lockstep.bench import serving

    out = tmp_path / "serving.jsonl"
    rc = serving.main(["--backend", backend, "--port", str(llama_server.port), "--api-key", API_KEY,
                       "--tokenizer", str(model_dir),
                       "--num-prompts", "8", "--random-input-len", "24",
                       "--random-output-len", "6", "--random-range-ratio", "1",
                       "--max-concurrency", "4", "--ignore-eos", "--disable-tqdm",
                       "--output-file", str(out)])
    record = json.loads(out.read_text().splitlines()[-1])
    assert rc == 0
    assert (record["completed"], record["failed"]) == (8, 0)
    assert record["total_output"] == 8 * 6  # ignore_eos: exactly the requested lengths
    assert record["total_input"] == 8 * 24
    assert record["mean_ttft_ms"] > 0 and record["mean_itl_ms"] > 0
    if backend == "lockstep":  # the native route reports cached prompt tokens
        assert 0 <= record["prefix_cache_hit_rate"] < 1


def test_serving_client_edit_workload(llama_server: LiveServer, model_dir: Path,
                                      tmp_path: Path) -> None:
    from lockstep.bench import serving

    out = tmp_path / "edit.jsonl"
    rc = serving.main(["--port", str(llama_server.port), "--api-key", API_KEY,
                       "--tokenizer", str(model_dir), "--dataset-name",
                       "edit", "--num-prompts", "3", "--edit-passage-len", "40", "--edit-output-len",
                       "5", "--max-concurrency", "1", "--ignore-eos", "--disable-tqdm",
                       "--output-file", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0 and (record["completed"], record["total_output"]) == (3, 15)
    assert (record["edit_passage_len"], record["edit_output_len"]) == (40, 5)
    assert "random_input_len" not in record  # only the arguments of the dataset that ran
    # One user at a time: each request's tokens over its own E2E, so at least the overall rate.
    assert record["per_user_output_throughput"] >= record["output_throughput"] > 0


def test_cli_dispatches_benchmarks(capsys) -> None:
    from lockstep import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "serving", "--help"])
    assert e.value.code == 0
    assert "--max-concurrency" in capsys.readouterr().out
    assert cli.main(["bench", "--help"]) == 0
    listing = capsys.readouterr().out
    for name in ("one_batch", "serving", "offline", "dtype_agreement"):
        assert name in listing
