"""What each GGML block holds, read from its bytes in plain torch: its integer quants and the scales (and
mins) that turn them into weights. One decoder per type, shared by the reference dequantization and the
int8 path's reference (blocks.py), so both read the same bits; the compiled decoders (csrc/blocks.h)
follow the same layouts. The layouts are ggml's (ggml-common.h); gguf.quants' numpy code is the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# IQ4_NL's and IQ4_XS's 16 non-linear levels (ggml's kvalues_iq4nl), indexed by a 4-bit code
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class Fields:
    """A batch of B blocks of one type. The weights, in gguf.quants' float32 operations and order:
      no `sc`:          d * q  (+ m where `m` is given: Q4_1, Q5_1)
      `sc`:             (d * sc) * q, one integer scale per sub-block of q.shape[1] / sc.shape[1] elements
      `sc`, `mn`:       (d * sc) * q - (dmin * mn)  (the K-quants with mins: Q2_K, Q4_K, Q5_K)
    The int8 path multiplies x by the same integers `q` (signed, offset removed; the types with a min
    or `m` keep theirs unsigned) and applies `sc`, `mn` as integers (blocks.linear_int8_reference)."""

    q: torch.Tensor  # int32 [B, elements per block]
    d: torch.Tensor  # float32 [B]
    sc: torch.Tensor | None = None  # int32 [B, sub-blocks]
    dmin: torch.Tensor | None = None  # float32 [B]
    mn: torch.Tensor | None = None  # int32 [B, sub-blocks]
    m: torch.Tensor | None = None  # float32 [B]: the offset Q4_1 and Q5_1 add

    @property
    def sub(self) -> int:
        """Elements per integer scale (a whole block where there is none)."""
        return self.q.shape[1] if self.sc is None else self.q.shape[1] // self.sc.shape[1]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian half -> float32 [...] (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _f32(b: torch.Tensor) -> torch.Tensor:
    """[..., 4] uint8 little-endian float32 -> float32 [...] (our unpacked layouts' scales)."""
    return b.contiguous().view(torch.float32).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> int32 [..., 2n]: all low nibbles, then all high nibbles (the GGML order)."""
    qs = qs.to(torch.int32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _chunk_nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, n] -> [B, 2n]: chunks of `chunk` bytes, each its low nibbles, then its high ones."""
    b = qs.shape[0]
    return _nibbles(qs.reshape(b, -1, chunk)).reshape(b, -1)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """[B, 64] -> int32 [B, 256]: 2-bit fields, per 32-byte chunk shifts 0, 2, 4, 6 (Q2_K, Q3_K)."""
    shifts = torch.arange(0, 8, 2, dtype=torch.int32).reshape(1, 1, 4, 1)
    q = qs.to(torch.int32).reshape(qs.shape[0], 2, 1, 32) >> shifts
    return (q & 3).reshape(qs.shape[0], 256)


def _bit_planes(h: torch.Tensor) -> torch.Tensor:
    """[B, 32] -> int32 [B, 256]: element 32j + l is bit j of byte l (Q3_K's hmask, Q5_K's qh)."""
    shifts = torch.arange(8, dtype=torch.int32).reshape(1, 8, 1)
    return ((h.to(torch.int32).reshape(-1, 1, 32) >> shifts) & 1).reshape(-1, 256)


def _bits32(b: torch.Tensor) -> torch.Tensor:
    """[B, 4] little-endian uint32 -> int32 [B, 32], element j = bit j (Q5_0's and Q5_1's fifth bits)."""
    qh = b.contiguous().view(torch.int32)  # [B, 1]
    return (qh >> torch.arange(32, dtype=torch.int32)) & 1


def _q4_k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes per block -> eight 6-bit scales and eight 6-bit mins (each int32 [B, 8])."""
    s = s.to(torch.int32)
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 scale bytes -> sixteen signed 6-bit scales (int32 [B, 16]): low 4 bits from the
    nibbles of bytes 0-7 (low nibbles first), top 2 bits from bytes 8-11 (shifts 0, 2, 4, 6)."""
    s = s.to(torch.int32)
    low = torch.cat([s[:, :8] & 0x0F, s[:, :8] >> 4], dim=-1)
    high = torch.cat([(s[:, 8:12] >> (2 * i)) & 3 for i in range(4)], dim=-1)
    return (low | (high << 4)) - 32


def _iq4(codes: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_LEVELS, dtype=torch.int32)[codes]


def fields(qtype: str, b: torch.Tensor) -> Fields:
    """uint8 [B, bytes per block] of a block type (a GGML name, or one of our unpacked layouts) -> its Fields."""
    if qtype == "Q8_0":
        return Fields(b[:, 2:].contiguous().view(torch.int8).to(torch.int32), _f16(b[:, 0:2]))
    if qtype == "Q4_0":
        return Fields(_nibbles(b[:, 2:]) - 8, _f16(b[:, 0:2]))
    if qtype == "Q4_1":
        return Fields(_nibbles(b[:, 4:]), _f16(b[:, 0:2]), m=_f16(b[:, 2:4]))
    if qtype == "Q5_0":
        return Fields((_nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)) - 16, _f16(b[:, 0:2]))
    if qtype == "Q5_1":
        return Fields(_nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4), _f16(b[:, 0:2]), m=_f16(b[:, 2:4]))
    if qtype == "Q5_0_U8":
        return Fields(b[:, 2:].to(torch.int32) - 16, _f16(b[:, 0:2]))
    if qtype == "IQ4_NL":
        return Fields(_iq4(_nibbles(b[:, 2:])), _f16(b[:, 0:2]))
    if qtype == "Q2_K":  # scales[16] (low nibble scale, high min), qs[64], half d, half dmin
        s = b[:, 0:16].to(torch.int32)
        return Fields(_crumbs(b[:, 16:80]), _f16(b[:, 80:82]), s & 0x0F, _f16(b[:, 82:84]), s >> 4)
    if qtype == "Q3_K":  # hmask[32], qs[64], scales[12], half d: q = low 2 bits - 4 where the hmask bit is 0
        q = (_crumbs(b[:, 32:96]) | (_bit_planes(b[:, 0:32]) << 2)) - 4
        return Fields(q, _f16(b[:, 108:110]), _q3_k_scales(b[:, 96:108]))
    if qtype == "Q4_K":  # half d, half dmin, 12 bytes of scales and mins, 4 chunks of 32 nibble bytes
        sc, mn = _q4_k_scale_min(b[:, 4:16])
        return Fields(_chunk_nibbles(b[:, 16:], 32), _f16(b[:, 0:2]), sc, _f16(b[:, 2:4]), mn)
    if qtype == "Q4_K_S8":  # float d, float dmin, a byte per scale, a byte per min, Q4_K's nibbles
        q = _chunk_nibbles(b[:, 24:], 32)
        return Fields(q, _f32(b[:, 0:4]), b[:, 8:16].to(torch.int32), _f32(b[:, 4:8]), b[:, 16:24].to(torch.int32))
    if qtype == "Q5_K":  # Q4_K's fields, then qh[32] (the fifth bits, a bit plane per 32 elements), then qs[128]
        sc, mn = _q4_k_scale_min(b[:, 4:16])
        q = _chunk_nibbles(b[:, 48:], 32) | (_bit_planes(b[:, 16:48]) << 4)
        return Fields(q, _f16(b[:, 0:2]), sc, _f16(b[:, 2:4]), mn)
    if qtype == "Q6_K":  # ql[128], qh[64], int8 scales[16], half d
        ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].to(torch.int32).reshape(-1, 2, 32)
        low = _nibbles(ql)  # [B, 2, 128]: 32-groups use ql[0:32], ql[32:64] low, then the same high
        high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)  # [B, 2, 128]
        q = ((low | (high << 4)) - 32).reshape(-1, 256)
        return Fields(q, _f16(b[:, 208:210]), b[:, 192:208].contiguous().view(torch.int8).to(torch.int32))
    if qtype == "Q6_K_U8":
        return Fields(b[:, 20:].to(torch.int32) - 32, _f32(b[:, 0:4]), b[:, 4:20].contiguous().view(torch.int8).to(torch.int32))
    if qtype == "IQ4_XS":  # half d, uint16 scales_h (2 bits a sub-block), scales_l[4] (nibbles), qs[128]
        high = (b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF) >> torch.arange(0, 16, 2)
        low = b[:, 4:8].to(torch.int32)
        sc = (torch.stack([low & 0x0F, low >> 4], dim=-1).reshape(-1, 8) | ((high & 3) << 4)) - 32
        return Fields(_iq4(_chunk_nibbles(b[:, 8:], 16)), _f16(b[:, 0:2]), sc)
    raise ValueError(f"no block decoder for {qtype}")


def dequantize_fields(f: Fields) -> torch.Tensor:
    """Fields of B blocks -> float32 [B, elements per block], gguf.quants' operations in its order."""
    q = f.q.float()  # exact: every quant is a small integer
    if f.sc is None:
        w = f.d.unsqueeze(-1) * q
        return w if f.m is None else w + f.m.unsqueeze(-1)
    n, subs = f.sc.shape
    w = (f.d.unsqueeze(-1) * f.sc.float()).unsqueeze(-1) * q.reshape(n, subs, -1)
    if f.mn is not None:
        w = w - (f.dmin.unsqueeze(-1) * f.mn.float()).unsqueeze(-1)
    return w.reshape(n, -1)
