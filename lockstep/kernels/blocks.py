"""GGML block formats and their plain-torch reference (de)quantization.

Blocks are uint8 tensors [N, row_bytes]: each row is whole blocks along the input dimension, exactly the
GGUF's little-endian bytes. Every arithmetic step here follows gguf.quants in the same order, so the
float32 values are bitwise the ones gguf.quants gives (and the ones the compiled kernels form in registers).
"""

from __future__ import annotations

from enum import StrEnum

import torch

from lockstep.kernels.block_fields import dequantize_fields, fields


class BlockType(StrEnum):
    """A GGML block type the kernels read. Its value is GGML's name (so it compares equal to the
    string), `code` GGML's type id: what the compiled kernels switch on (csrc/blocks.h), so a call
    passes an int, not a name to compare. Q5_0_U8, Q4_K_S8 and Q6_K_U8 are ours, in no GGUF: layouts
    of Q5_0, Q4_K and Q6_K that the int8 path unpacks at load (`unpack_for_int8`), the same values."""

    F32 = ("F32", 0, 1, 4)
    F16 = ("F16", 1, 1, 2)
    BF16 = ("BF16", 30, 1, 2)
    Q4_0 = ("Q4_0", 2, 32, 18)
    Q4_1 = ("Q4_1", 3, 32, 20)
    Q5_0 = ("Q5_0", 6, 32, 22)
    Q5_1 = ("Q5_1", 7, 32, 24)
    Q8_0 = ("Q8_0", 8, 32, 34)
    Q2_K = ("Q2_K", 10, 256, 84)
    Q3_K = ("Q3_K", 11, 256, 110)
    Q4_K = ("Q4_K", 12, 256, 144)
    Q5_K = ("Q5_K", 13, 256, 176)
    Q6_K = ("Q6_K", 14, 256, 210)
    IQ4_NL = ("IQ4_NL", 20, 32, 18)
    IQ4_XS = ("IQ4_XS", 23, 256, 136)
    Q5_0_U8 = ("Q5_0_U8", 106, 32, 34)  # half d, one byte per 5-bit quant: the same values as Q5_0
    Q4_K_S8 = ("Q4_K_S8", 112, 256, 152)  # float d, dmin, a byte per 6-bit scale and min, Q4_K's nibbles
    Q6_K_U8 = ("Q6_K_U8", 114, 256, 276)  # float d, Q6_K's 16 int8 scales, one byte per 6-bit quant

    def __new__(cls, name: str, code: int, per_block: int, nbytes: int) -> BlockType:
        member = str.__new__(cls, name)
        member._value_ = name
        member.code, member.per_block, member.nbytes = code, per_block, nbytes
        return member


# qtype -> (elements per block, bytes per block)
GGML_BLOCKS: dict[str, tuple[int, int]] = {t.value: (t.per_block, t.nbytes) for t in BlockType}


def block_type(qtype: str) -> BlockType:
    """The BlockType of a GGML type name (a BlockType is returned as it is)."""
    if type(qtype) is BlockType:
        return qtype
    try:
        return BlockType(qtype)
    except ValueError:
        raise ValueError(f"unsupported GGML block type {qtype!r}; known: {sorted(GGML_BLOCKS)}") from None


def row_bytes(qtype: str, n_cols: int) -> int:
    """Bytes of one row of `n_cols` elements; ValueError unless `n_cols` is whole blocks."""
    kind = block_type(qtype)
    if n_cols <= 0 or n_cols % kind.per_block:
        raise ValueError(f"{qtype} rows must be a positive multiple of {kind.per_block} elements, "
                         f"got {n_cols}")
    return n_cols // kind.per_block * kind.nbytes


def check_blocks(qtype: str, blocks: torch.Tensor, n_cols: int) -> None:
    """ValueError unless `blocks` is uint8 [N, row_bytes(qtype, n_cols)]."""
    expect = row_bytes(qtype, n_cols)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != expect:
        raise ValueError(f"{qtype} blocks for {n_cols} columns must be uint8 [N, {expect}], "
                         f"got {blocks.dtype} {list(blocks.shape)}")


def _dequant_blocks(qtype: str, b: torch.Tensor) -> torch.Tensor:
    """uint8 [B, bytes per block] -> float32 [B, elements per block]."""
    return dequantize_fields(fields(qtype, b))


def dequantize(qtype: str, blocks: torch.Tensor, n_cols: int) -> torch.Tensor:
    """uint8 [N, row_bytes] -> float32 [N, n_cols], the values gguf.quants.dequantize gives."""
    check_blocks(qtype, blocks, n_cols)
    n = blocks.shape[0]
    raw = blocks.contiguous()
    if qtype == "F32":
        return raw.view(torch.float32).clone()
    if qtype == "F16":
        return raw.view(torch.float16).float()
    if qtype == "BF16":
        return raw.view(torch.bfloat16).float()
    return _dequant_blocks(qtype, raw.reshape(-1, GGML_BLOCKS[qtype][1])).reshape(n, n_cols)


# What the int8 path reads in place of a GGUF type: the same values in a layout its kernels decode with
# fewer instructions (csrc/blocks.h, measured there), unpacked once at load.
INT8_UNPACKED = {"Q5_0": "Q5_0_U8", "Q4_K": "Q4_K_S8", "Q6_K": "Q6_K_U8"}


def unpack_for_int8(qtype: str, blocks: torch.Tensor, n_cols: int) -> tuple[BlockType, torch.Tensor]:
    """(type, blocks) as the int8 path serves a weight: Q5_0 -> Q5_0_U8 (each 5-bit quant in a byte of
    its own: one load where Q5_0 spreads its fifth bits; 34 bytes per 32 elements instead of 22),
    Q4_K -> Q4_K_S8 (float32 d and dmin, each 6-bit scale and min in a byte: no unpacking per block;
    152 bytes per 256 instead of 144), Q6_K -> Q6_K_U8 (float32 d, its scales, a byte per 6-bit quant:
    one load where Q6_K joins two bit fields; 276 bytes per 256 instead of 210); other types as they
    are. Every value stays the same."""
    kind = block_type(qtype)
    if kind not in INT8_UNPACKED:
        return kind, blocks
    check_blocks(kind, blocks, n_cols)
    b = blocks.contiguous().reshape(-1, kind.nbytes)
    f = fields(kind, b)
    if kind == "Q5_0":
        parts = [b[:, 0:2], (f.q + 16).to(torch.uint8)]
    elif kind == "Q4_K":
        parts = [f.d.reshape(-1, 1).view(torch.uint8), f.dmin.reshape(-1, 1).view(torch.uint8),
                 f.sc.to(torch.uint8), f.mn.to(torch.uint8), b[:, 16:]]
    else:
        parts = [f.d.reshape(-1, 1).view(torch.uint8), f.sc.to(torch.int8).view(torch.uint8),
                 (f.q + 32).to(torch.uint8)]
    return BlockType(INT8_UNPACKED[kind]), torch.cat(parts, dim=1).reshape(blocks.shape[0], -1)


def _round_away(v: torch.Tensor) -> torch.Tensor:
    """roundf: halves away from zero (what ggml's reference quantizer uses)."""
    a = v.abs()
    f = a.floor()
    return v.sign() * (f + (2 * (a - f)).floor())


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """[B, 32] -> [B, 1]: the element of largest magnitude, sign kept (first one on ties)."""
    return torch.gather(x, 1, x.abs().argmax(dim=1, keepdim=True))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _half_bytes(d: torch.Tensor) -> torch.Tensor:
    return d.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _quant_blocks(qtype: str, x: torch.Tensor) -> torch.Tensor:
    """float32 [B, 32] -> uint8 [B, bytes per block], the bytes gguf.quants.quantize gives."""
    if qtype == "Q8_0":
        d = x.abs().amax(dim=1, keepdim=True) / 127
        q = _round_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_half_bytes(d), q], dim=1)
    if qtype == "Q4_0":
        d = _signed_absmax(x) / -8
        q = torch.trunc(x * _inverse(d) + 8.5).to(torch.uint8).clamp(0, 15)
        return torch.cat([_half_bytes(d), q[:, :16] | (q[:, 16:] << 4)], dim=1)
    if qtype == "Q5_0":
        d = _signed_absmax(x) / -16
        q = torch.trunc(x * _inverse(d) + 16.5).to(torch.uint8).clamp(0, 31)
        qs = (q[:, :16] & 0x0F) | (q[:, 16:] << 4)
        bits = (q >> 4).to(torch.int64) << torch.arange(32, dtype=torch.int64)
        qh = bits.sum(dim=1, keepdim=True).to(torch.int32).view(torch.uint8)
        return torch.cat([_half_bytes(d), qh, qs], dim=1)
    raise ValueError(f"no quantizer for {qtype}; quantize supports {sorted(QUANTIZABLE)}")


QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q5_0", "Q8_0")


def quantize(qtype: str, weight: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> uint8 [N, row_bytes(qtype, K)], the bytes gguf.quants.quantize gives."""
    if weight.dim() != 2:
        raise ValueError(f"quantize takes a 2-D weight, got shape {list(weight.shape)}")
    if qtype not in QUANTIZABLE:
        raise ValueError(f"no quantizer for {qtype}; quantize supports {list(QUANTIZABLE)}")
    n, k = weight.shape
    nbytes = row_bytes(qtype, k)
    w = weight.detach().float().contiguous()
    if qtype == "F32":
        return w.view(torch.uint8).reshape(n, nbytes).clone()
    if qtype in ("F16", "BF16"):
        dtype = torch.float16 if qtype == "F16" else torch.bfloat16
        return w.to(dtype).view(torch.uint8).reshape(n, nbytes)
    return _quant_blocks(qtype, w.reshape(-1, 32)).reshape(n, nbytes)


# ---------------------------------------------------------------- int8 activations (opt-in)
# The arithmetic of the compiled int8 path (csrc/int8.h), step for step, so the two give the same bits.
INT8_QTYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_0_U8", "Q2_K", "Q3_K", "Q4_K", "Q4_K_S8", "Q5_K",
               "Q6_K", "Q6_K_U8", "IQ4_NL", "IQ4_XS")


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [M, K] -> (int8 q [M, K], float32 d [M, K/32]): per block of 32, d = max|x| / 127 and
    q = round-half-even(x * (1 / d)); a block whose d is below the smallest normal float is zeros."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % 32:
        raise ValueError(f"quantize_int8 takes float32 [M, K], K a multiple of 32, got {x.dtype} {list(x.shape)}")
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    d = xb.abs().amax(dim=-1) / 127
    ok = d >= torch.finfo(torch.float32).tiny
    inv = torch.where(ok, 1.0 / d, torch.zeros_like(d))
    d = torch.where(ok, d, torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8)
    return q.reshape(m, k), d


def _int_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact integer a [M, L] . b [N, L]^T (float64 holds these sums exactly) -> int64 [M, N]."""
    return (a.double() @ b.double().T).to(torch.int64)


def linear_int8_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """float32 x [M, K] times the blocks with int8 activations: the numbers the compiled path gives
    (csrc/int8.cpp), float32 [M, N]. Per block of 32 and output element, with Fields' integers
    (one or two integer scales `sc` per 32, i.e. sub-blocks of 32 or 16):
      isum = sum over the sub-blocks s of sc_s * (x_s . q_s)    (x_s . q_s alone where there is no sc)
      v = float(isum) * (dx * d)
        + float(sum x) * (dx * m)                           Q4_1, Q5_1
        - float(sum over s of mn_s * sum x_s) * (dx * dmin)   K-quants with mins
      acc += v"""
    kind = block_type(qtype)
    if kind not in INT8_QTYPES:
        raise ValueError(f"no int8 path for {qtype}; it serves {list(INT8_QTYPES)}")
    check_blocks(kind, blocks, n_cols)
    q, dx = quantize_int8(x)
    n, groups = blocks.shape[0], n_cols // 32
    f = fields(kind, blocks.contiguous().reshape(-1, kind.nbytes))
    per_group = lambda t: t.reshape(n, -1).repeat_interleave(kind.per_block // 32, dim=1)  # noqa: E731
    d = per_group(f.d)  # [N, groups]
    subs = max(1, 32 // f.sub)  # integer scales per block of 32
    wq = f.q.reshape(n, groups, subs, 32 // subs)
    sc = None if f.sc is None else f.sc.reshape(n, groups, subs)
    mn = None if f.mn is None else f.mn.reshape(n, groups, subs)
    acc = torch.zeros(x.shape[0], n)
    for blk in range(groups):
        xq = q[:, 32 * blk : 32 * blk + 32].reshape(-1, subs, 32 // subs)
        isum = torch.zeros(x.shape[0], n, dtype=torch.int64)
        for s in range(subs):
            dot = _int_dot(xq[:, s], wq[:, blk, s])
            isum = isum + (dot if sc is None else dot * sc[:, blk, s])
        dxb = dx[:, blk : blk + 1]
        v = isum.float() * (dxb * d[:, blk])
        xsum = xq.to(torch.int64).sum(dim=-1)  # [M, subs]
        if f.m is not None:
            v = v + xsum.sum(dim=1, keepdim=True).float() * (dxb * per_group(f.m)[:, blk])
        if mn is not None:
            msum = sum(xsum[:, s : s + 1] * mn[:, blk, s] for s in range(subs))
            v = v - msum.float() * (dxb * per_group(f.dmin)[:, blk])
        acc = acc + v
    return acc
