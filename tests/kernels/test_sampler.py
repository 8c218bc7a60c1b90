"""Sampling: seeds repeat, top-k 1 is greedy, and draws follow the filtered distribution."""

from __future__ import annotations

import math

import torch

from lockstep.layers.sampler import SamplingBatchInfo, filter_probs, sample


def _info(b: int, vocab: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
          min_p: float = 0.0, seeds=None, steps=None) -> SamplingBatchInfo:
    return SamplingBatchInfo(
        temperatures=torch.full((b,), temperature), top_ps=torch.full((b,), top_p),
        top_ks=torch.full((b,), top_k or vocab, dtype=torch.int64), min_ps=torch.full((b,), min_p),
        seeds=torch.tensor(seeds if seeds is not None else [7] * b, dtype=torch.int64),
        steps=torch.tensor(steps if steps is not None else list(range(b)), dtype=torch.int64),
        all_greedy=temperature == 0, need_filter=top_p < 1 or bool(top_k) or min_p > 0,
    )


def test_same_seed_same_tokens_and_different_seed_differs():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    a = sample(logits, _info(8, 1000, seeds=[1] * 8)).next_token_ids
    b = sample(logits, _info(8, 1000, seeds=[1] * 8)).next_token_ids
    c = sample(logits, _info(8, 1000, seeds=[2] * 8)).next_token_ids
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_one_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(16, 5000)
    got = sample(logits, _info(16, 5000, temperature=1.3, top_k=1)).next_token_ids
    assert torch.equal(got, logits.argmax(-1))


def _chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    keep = expected > 0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


def test_temperature_top_p_follows_the_filtered_distribution():
    vocab, n = 8, 20000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    temperature, top_p = 0.8, 0.9
    rows = logits.expand(n, vocab)
    out = sample(rows, _info(n, vocab, temperature=temperature, top_p=top_p,
                             seeds=[123] * n, steps=list(range(n)))).next_token_ids
    counts = torch.bincount(out, minlength=vocab).double()
    probs = torch.softmax(logits / temperature, -1)
    filtered = filter_probs(probs[None], torch.tensor([vocab]), torch.tensor([top_p]), torch.tensor([0.0]))[0]
    expected = (filtered / filtered.sum()).double() * n
    assert counts[expected == 0].sum() == 0, "a token outside the nucleus was drawn"
    stat, dof = _chi_square(counts, expected)
    # 99.9% quantile of chi-square with dof <= 7 is below 24.4.
    assert dof >= 3 and stat < 24.4, (stat, dof)


def test_min_p_and_top_k_filters():
    probs = torch.softmax(torch.tensor([[3.0, 2.9, 1.0, 0.0, -2.0]]), -1)
    kept = filter_probs(probs, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert (kept[0, 2:] == 0).all() and (kept[0, :2] > 0).all()
    kept = filter_probs(probs, torch.tensor([5]), torch.tensor([1.0]), torch.tensor([0.2]))
    assert (kept[0] > 0).tolist() == [True, True, False, False, False]  # 0.2 * 0.47 > 0.064


def test_logprobs_are_of_raw_logits():
    logits = torch.randn(4, 100)
    out = sample(logits, _info(4, 100, temperature=0.0), top_logprobs_num=3, want_logprobs=True)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.next_token_ids[:, None]).squeeze(1))
    assert torch.allclose(out.top_logprobs, ref.topk(3, -1).values)
    assert math.isclose(float(out.top_logprobs[0, 0]), float(out.logprobs[0]), abs_tol=1e-6)


def test_logit_bias_moves_only_its_own_row():
    """A biased request beside unbiased ones: their tokens and logprobs stay bit for bit, and the
    reported logprobs stay those of the model's own distribution."""
    torch.manual_seed(2)
    logits = torch.randn(3, 4000)
    for temperature in (0.0, 0.9):
        plain = sample(logits.clone(), _info(3, 4000, temperature), top_logprobs_num=2,
                       want_logprobs=True)
        info = _info(3, 4000, temperature)
        info.logit_bias = [(1, torch.tensor([17, 99]), torch.tensor([100.0, -100.0]))]
        biased = sample(logits.clone(), info, top_logprobs_num=2, want_logprobs=True)
        keep = torch.tensor([0, 2])
        assert torch.equal(biased.next_token_ids[keep], plain.next_token_ids[keep])
        assert torch.equal(biased.logprobs[keep], plain.logprobs[keep])
        assert torch.equal(biased.top_logprobs, plain.top_logprobs)
        assert int(biased.next_token_ids[1]) == 17 != int(plain.next_token_ids[1])
        assert float(biased.logprobs[1]) == float(torch.log_softmax(logits[1], -1)[17])
