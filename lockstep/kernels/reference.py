"""Every op's plain-torch reference: what serves where no compiled variant is loaded or the operands do not
fit one (see dispatch.py), and what the tests hold each compiled version against. The block linears give
the compiled numbers bitwise on the int8 path and up to float summation order on the exact one; the
row-wise ops and LoRA's products up to float rounding (each row's bits still independent of the
others); argmax exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lockstep.kernels.blocks import BlockType, dequantize, linear_int8_reference
from lockstep.kernels.layer_consts import LayerConsts

COMPILED_ACTS = ("gelu_tanh", "silu")


def linear(x: torch.Tensor, blocks: torch.Tensor, kind: BlockType, n_cols: int) -> torch.Tensor:
    return x @ dequantize(kind, blocks, n_cols).T


def linear_parts(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, BlockType]], n_cols: int) -> torch.Tensor:
    outs = [linear(x, b, kind, n_cols) for b, kind in parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def embedding(ids: torch.Tensor, blocks: torch.Tensor, kind: BlockType, n_cols: int) -> torch.Tensor:
    return dequantize(kind, blocks[ids], n_cols)


linear_int8 = linear_int8_reference


def linear_int8_parts(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, BlockType]], n_cols: int) -> torch.Tensor:
    return torch.cat([linear_int8(x, b, kind, n_cols) for b, kind in parts], dim=-1)


def linear_bf16(x: torch.Tensor, blocks: torch.Tensor, kind: BlockType, n_cols: int) -> torch.Tensor:
    # float32 sums of the bf16-rounded operands: a bf16 matmul would round its output to bfloat16
    # too (an error of 0.09 at K=256). Not batch invariant.
    return x.to(torch.bfloat16).float() @ dequantize(kind, blocks, n_cols).to(torch.bfloat16).float().T


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_slots: torch.Tensor,
                     starts: torch.Tensor, lens: torch.Tensor, scaling: float, softcap: float | None,
                     window: int | None) -> torch.Tensor:
    r, h, d = q.shape
    hkv = k_buf.shape[1]
    # one gather for the batch (a call per request costs more at batch 32), then each request's rows; a
    # 16-bit pool's values widen to q's type exactly, as the kernel widens them
    keys_all = k_buf.index_select(0, kv_slots).to(q.dtype)
    vals_all = v_buf.index_select(0, kv_slots).to(q.dtype)
    outs = []
    for i, (s, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        lo = 0 if window is None else max(0, n - window)
        keys = keys_all[s + lo:s + n].transpose(0, 1)  # [Hkv, L, D]
        vals = vals_all[s + lo:s + n].transpose(0, 1)
        # the query heads sharing a KV head are stacked into its rows, so K/V are not repeated
        scores = torch.matmul(q[i].reshape(hkv, h // hkv, d), keys.transpose(-1, -2)).mul_(scaling)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        outs.append(torch.matmul(scores.softmax(-1), vals).reshape(1, h * d))
    return torch.cat(outs) if outs else q.new_empty(0, h * d)


def argmax(x: torch.Tensor) -> torch.Tensor:
    # max(dim) returns the same first-maximum index as argmax, and is the faster of the two on CPU
    return x.max(dim=-1).indices


def rowwise(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ wt [K, N], each row multiplied alone (a batched product of 1-row matrices, the
    same small kernel for every row): a row's bits never depend on T, as torch's matmul's would
    (it picks its blocking by the number of rows)."""
    return torch.bmm(x.unsqueeze(1), wt.expand(x.shape[0], *wt.shape)).squeeze(1)


def lora_sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
              ranks: torch.Tensor, slots: torch.Tensor, splits: Sequence[int]) -> None:
    # slot by slot, module by module, each product row-wise (csrc/lora.cpp states the layout), the
    # slots' values widened to x's type first as the kernel widens them (bfloat16 or int8 slots, float32
    # rows), each shrink result times its row's scale;
    # index_add_ adds each row's delta once (the rows are distinct), so it is deterministic on GPUs too
    r_max = b.shape[1]
    present = slots[slots >= 0]
    for s in sorted(set(present.tolist())):
        rows = (slots == s).nonzero().squeeze(1)
        xs = x[rows]
        delta = torch.zeros(len(rows), y.shape[1], dtype=y.dtype, device=y.device)
        for m, r in enumerate(ranks[s].tolist()):
            if r:
                rows_m = slice(m * r_max, m * r_max + r)
                u = rowwise(xs, a[s, rows_m].to(x.dtype).T) * scales[s, rows_m].to(x.dtype)
                delta[:, splits[m]:splits[m + 1]] = rowwise(u, b[s, :r, splits[m]:splits[m + 1]].to(x.dtype))
        y.index_add_(0, rows, delta)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, wx: torch.Tensor | None, wy: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = (h.shape[-1],)
    h2 = h + (x if wx is None else F.rms_norm(x, shape, wx, eps))
    return h2, (None if wy is None else F.rms_norm(h2, shape, wy, eps))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of x [T, H, D] by cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qk_norm_rope(qkv: torch.Tensor, n_q: int, n_kv: int, head_dim: int, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> None:
    t, d = qkv.shape[0], head_dim
    for heads, w in ((qkv[:, :n_q * d].view(t, n_q, d), q_weight),
                     (qkv[:, n_q * d:(n_q + n_kv) * d].view(t, n_kv, d), k_weight)):
        normed = heads if w is None else F.rms_norm(heads, (d,), w, eps)
        heads.copy_(rotate(normed, cos, sin))


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    g = F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)
    return g * up


_BY_CODE = {t.code: t for t in BlockType}  # GGML type id -> BlockType (LayerConsts.block_types)


def _parts_matmul(x: torch.Tensor, c: LayerConsts, lo: int, hi: int, k: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """csrc/layer.cpp's parts_matmul: a lone float part with its bias in torch's linear, else the
    parts by kind (block_weight.matmul_parts), then the bias."""
    if hi - lo == 1 and c.kinds[lo] == "float":
        return F.linear(x, c.weights[lo], bias)
    by = {"exact": linear, "int8": linear_int8}
    outs = [F.linear(x, c.weights[i]) if c.kinds[i] == "float"
            else by[c.kinds[i]](x, c.weights[i], _BY_CODE[c.block_types[i]], k) for i in range(lo, hi)]
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return y if bias is None else y + bias


def decoder_layer(h: torch.Tensor, consts: LayerConsts, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor,
                  v_buf: torch.Tensor, loc: torch.Tensor, kv_slots: torch.Tensor, starts: torch.Tensor,
                  lens: torch.Tensor, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
    """csrc/layer.cpp step for step on the references above (the model's modules run the same ops)."""
    c = consts
    ends = [sum(c.part_counts[:i + 1]) for i in range(4)]
    starts_ = [0, *ends[:3]]

    def matmul(x: torch.Tensor, i: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = _parts_matmul(x, c, starts_[i], ends[i], c.in_features[i], bias)
        if lora_slots is not None and c.lora_a and c.lora_a[i].numel():
            lora_sgmv(y, x, c.lora_a[i], c.lora_b[i], c.lora_scales[i], c.lora_ranks[i], lora_slots, c.lora_splits[i])
        return y

    qkv = matmul(rms_norm(h, c.norms[0], c.eps), 0, c.qkv_bias)
    qk_norm_rope(qkv, c.n_q, c.n_kv, c.head_dim, c.q_norm, c.k_norm, cos, sin, c.qk_eps)
    t, d, hq, hk = qkv.shape[0], c.head_dim, c.n_q, c.n_kv
    k_buf[loc] = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d).to(k_buf.dtype)
    v_buf[loc] = qkv[:, (hq + hk) * d:(hq + 2 * hk) * d].view(t, hk, d).to(v_buf.dtype)
    a = matmul(decode_attention(qkv[:, :hq * d].view(t, hq, d), k_buf, v_buf, kv_slots, starts, lens,
                                c.scaling, c.softcap or None, c.window or None), 1)
    gemma = len(c.norms) == 4
    h2, x = add_rms_norm(h, a, c.norms[1] if gemma else None, c.norms[2] if gemma else c.norms[1], c.eps)
    m = matmul(act_and_mul(matmul(x, 2), c.act), 3)
    return add_rms_norm(h2, m, c.norms[3], None, c.eps)[0] if gemma else h2 + m
