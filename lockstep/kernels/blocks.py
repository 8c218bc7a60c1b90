"""GGML block formats and their plain-torch reference (de)quantization.

Blocks are uint8 tensors [N, row_bytes]: each row is whole blocks along the input dimension, exactly the
GGUF's little-endian bytes. Every arithmetic step here follows gguf.quants in the same order, so the
float32 values are bitwise the ones gguf.quants gives (and the ones the compiled kernels form in registers).
"""

from __future__ import annotations

from enum import StrEnum

import torch


class BlockType(StrEnum):
    """A GGML block type the kernels read. Its value is GGML's name (so it compares equal to the
    string), `code` GGML's type id: what the compiled kernels switch on (csrc/blocks.h), so a call
    passes an int, not a name to compare. Q5_0_U8, Q4_K_S8 and Q6_K_U8 are ours, in no GGUF: layouts
    of Q5_0, Q4_K and Q6_K that the int8 path unpacks at load (`unpack_for_int8`), the same values."""

    F32 = ("F32", 0, 1, 4)
    F16 = ("F16", 1, 1, 2)
    BF16 = ("BF16", 30, 1, 2)
    Q4_0 = ("Q4_0", 2, 32, 18)
    Q5_0 = ("Q5_0", 6, 32, 22)
    Q8_0 = ("Q8_0", 8, 32, 34)
    Q4_K = ("Q4_K", 12, 256, 144)
    Q6_K = ("Q6_K", 14, 256, 210)
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


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian half -> float32 [...] (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _f32(b: torch.Tensor) -> torch.Tensor:
    """[..., 4] uint8 little-endian float32 -> float32 [...] (our unpacked layouts' scales)."""
    return b.contiguous().view(torch.float32).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: all low nibbles, then all high nibbles (the GGML order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes per block -> eight 6-bit scales and eight 6-bit mins (each [B, 8], int)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


# a GGUF type and the layout the int8 path unpacks it into (unpack_for_int8) share their arithmetic
_Q4_K_LAYOUTS, _Q6_K_LAYOUTS = ("Q4_K", "Q4_K_S8"), ("Q6_K", "Q6_K_U8")


def _q4_k_fields(qtype: str, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K or Q4_K_S8 super-blocks [B, bytes] -> d, dmin (float32 [B]), scales, mins (int [B, 8])."""
    if qtype == "Q4_K":
        return (_f16(b[:, 0:2]), _f16(b[:, 2:4]), *_q4_k_scale_min(b[:, 4:16]))
    return _f32(b[:, 0:4]), _f32(b[:, 4:8]), b[:, 8:16], b[:, 16:24]


def _q6_k_fields(qtype: str, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K or Q6_K_U8 super-blocks [B, bytes] -> d (float32 [B]), the 16 scales (int8 [B, 16])."""
    if qtype == "Q6_K":
        return _f16(b[:, 208:210]), b[:, 192:208].contiguous().view(torch.int8)
    return _f32(b[:, 0:4]), b[:, 4:20].contiguous().view(torch.int8)


def _int_quants(qtype: str, b: torch.Tensor) -> torch.Tensor:
    """uint8 [B, bytes per block] -> the blocks' integer quants, int32 [B, elements per block]:
    signed, offset removed, except Q4_K's (unsigned, its mins separate). Shared by dequantize and
    the int8 path, so both read the same bits."""
    if qtype == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8).to(torch.int32)
    if qtype == "Q4_0":
        return _nibbles(b[:, 2:]).to(torch.int32) - 8
    if qtype == "Q5_0":
        qh = b[:, 2:6].contiguous().view(torch.int32)  # [B, 1], bit j = high bit of element j
        hi = (qh >> torch.arange(32, dtype=torch.int32)) & 1
        return (_nibbles(b[:, 6:]).to(torch.int32) | (hi << 4)) - 16
    if qtype == "Q5_0_U8":
        return b[:, 2:].to(torch.int32) - 16
    if qtype in _Q4_K_LAYOUTS:
        # 4 chunks of 32 bytes; each gives 32 low nibbles (sub-block 2j) then 32 high (2j+1)
        return _nibbles(b[:, -128:].reshape(-1, 4, 32)).reshape(-1, 256).to(torch.int32)
    if qtype == "Q6_K":
        ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        low = _nibbles(ql)  # [B, 2, 128]: 32-groups use ql[0:32], ql[32:64] low, then the same high
        high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)  # [B, 2, 128]
        return ((low | (high << 4)).to(torch.int32) - 32).reshape(-1, 256)
    if qtype == "Q6_K_U8":
        return b[:, 20:].to(torch.int32) - 32
    raise ValueError(f"no block dequantization for {qtype}")


def _dequant_blocks(qtype: str, b: torch.Tensor) -> torch.Tensor:
    """uint8 [B, bytes per block] -> float32 [B, elements per block]."""
    q = _int_quants(qtype, b).float()  # exact: every quant is a small integer
    if qtype in _Q4_K_LAYOUTS:
        d, dmin, sc, mn = _q4_k_fields(qtype, b)
        d, dmin = d.unsqueeze(-1), dmin.unsqueeze(-1)
        scale = (d * sc.float()).unsqueeze(-1)  # [B, 8, 1]
        off = (dmin * mn.float()).unsqueeze(-1)
        return (scale * q.reshape(-1, 8, 32) - off).reshape(-1, 256)
    if qtype in _Q6_K_LAYOUTS:
        d, scales = _q6_k_fields(qtype, b)
        d, scales = d.unsqueeze(-1), scales.float()
        return ((d * scales).unsqueeze(-1) * q.reshape(-1, 16, 16)).reshape(-1, 256)
    return _f16(b[:, 0:2]).unsqueeze(-1) * q  # Q8_0, Q4_0, Q5_0, Q5_0_U8: d * q


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
    if kind == "Q5_0":
        fields = [b[:, 0:2], (_int_quants("Q5_0", b) + 16).to(torch.uint8)]
    elif kind == "Q4_K":
        d, dmin, sc, mn = _q4_k_fields("Q4_K", b)
        fields = [d.reshape(-1, 1).view(torch.uint8), dmin.reshape(-1, 1).view(torch.uint8),
                  sc.to(torch.uint8), mn.to(torch.uint8), b[:, 16:]]
    else:
        d, sc = _q6_k_fields("Q6_K", b)
        fields = [d.reshape(-1, 1).view(torch.uint8), sc.view(torch.uint8),
                  (_int_quants("Q6_K", b) + 32).to(torch.uint8)]
    return BlockType(INT8_UNPACKED[kind]), torch.cat(fields, dim=1).reshape(blocks.shape[0], -1)


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
INT8_QTYPES = ("Q8_0", "Q4_0", "Q5_0", "Q5_0_U8", "Q4_K", "Q4_K_S8", "Q6_K", "Q6_K_U8")


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


def _int8_weight(qtype: str, blocks: torch.Tensor, n_cols: int) -> dict[str, torch.Tensor]:
    """A weight's integer quants (int32 [N, K]) and per-32-block scales ([N, K/32]) as the int8 path uses
    them: w = d * q for Q8_0/Q4_0/Q5_0/Q5_0_U8 (q signed, offset removed); Q4_K keeps its unsigned q with the
    6-bit scale `sc` and min `mn` (as Q4_K_S8); Q6_K's q is signed with two int8 scales per block (`sc` [N, K/32, 2])."""
    n = blocks.shape[0]
    b = blocks.contiguous().reshape(-1, GGML_BLOCKS[qtype][1])
    q = _int_quants(qtype, b).reshape(n, n_cols)
    if qtype in ("Q8_0", "Q4_0", "Q5_0", "Q5_0_U8"):
        return {"q": q, "d": _f16(b[:, 0:2]).reshape(n, -1)}
    if qtype in _Q4_K_LAYOUTS:
        d, dmin, sc, mn = _q4_k_fields(qtype, b)
        rep = lambda t: t.unsqueeze(-1).expand(-1, 8).reshape(n, -1)  # noqa: E731  (per super-block -> per group)
        return {"q": q, "sc": sc.to(torch.int32).reshape(n, -1),
                "mn": mn.to(torch.int32).reshape(n, -1), "d": rep(d), "dmin": rep(dmin)}
    # Q6_K, Q6_K_U8 (_int_quants raised for a type with no integer quants)
    d, sc = _q6_k_fields(qtype, b)
    sc = sc.to(torch.int32).reshape(n, -1, 2)
    d = d.unsqueeze(-1).expand(-1, 8).reshape(n, -1)
    return {"q": q, "sc": sc, "d": d}


def _int_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact integer a [M, L] . b [N, L]^T (float64 holds these sums exactly) -> int64 [M, N]."""
    return (a.double() @ b.double().T).to(torch.int64)


def linear_int8_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """float32 x [M, K] times the blocks with int8 activations: the numbers the compiled path gives
    (see csrc/int8.h for the arithmetic), float32 [M, N]."""
    if qtype not in INT8_QTYPES:
        raise ValueError(f"no int8 path for {qtype}; it serves {list(INT8_QTYPES)}")
    check_blocks(qtype, blocks, n_cols)
    q, dx = quantize_int8(x)
    w = _int8_weight(qtype, blocks, n_cols)
    acc = torch.zeros(x.shape[0], blocks.shape[0])
    for blk in range(n_cols // 32):
        cols = slice(32 * blk, 32 * blk + 32)
        xq, wq = q[:, cols], w["q"][:, cols]
        s = dx[:, blk : blk + 1] * w["d"][:, blk]
        if qtype in _Q6_K_LAYOUTS:
            isum = (_int_dot(xq[:, :16], wq[:, :16]) * w["sc"][:, blk, 0]
                    + _int_dot(xq[:, 16:], wq[:, 16:]) * w["sc"][:, blk, 1])
        elif qtype in _Q4_K_LAYOUTS:
            isum = _int_dot(xq, wq) * w["sc"][:, blk]
        else:
            isum = _int_dot(xq, wq)
        v = isum.float() * s
        if qtype in _Q4_K_LAYOUTS:
            mn = xq.to(torch.int64).sum(dim=1, keepdim=True) * w["mn"][:, blk]
            v = v - mn.float() * (dx[:, blk : blk + 1] * w["dmin"][:, blk])
        acc = acc + v
    return acc
