"""The kernels' public entry points: each validates its operands and runs through the dispatch table
(the compiled version where this process has one and the operands fit, else the torch reference)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lockstep.kernels import reference
from lockstep.kernels.blocks import INT8_QTYPES, BlockType, block_type, check_blocks
from lockstep.kernels.dispatch import table
from lockstep.kernels.layer_consts import LayerConsts


def kernel_variant() -> str:
    """"avx512" | "avx2" | "torch": the variant this process serves with (selected once, see build.py)."""
    return table().variant


def compiled(op: str) -> bool:
    """True when `op` (a dispatch.Table field: "linear", "linear_int8", "linear_bf16", ...) runs compiled
    in this process for operands that fit it."""
    return table().compiled(op)


def _check_x(x: torch.Tensor, n_cols: int) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != n_cols:
        raise ValueError(f"linear takes float32 x [M, {n_cols}], got {x.dtype} {list(x.shape)}")


def _checked(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> BlockType:
    kind = block_type(qtype)
    check_blocks(kind, blocks, n_cols)
    _check_x(x, n_cols)
    return kind


def linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequantize(qtype, blocks, K).T for float32 x [M, K=n_cols].

    On the compiled path each output element is summed in an order that depends on nothing but that
    element, so a row of y is bitwise the same whatever M and the other rows of x are.
    """
    return table().linear(x, blocks, _checked(x, blocks, qtype, n_cols), n_cols)


def linear_parts(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, BlockType]], n_cols: int) -> torch.Tensor:
    """x [M, K] @ [W_0; W_1; ...].T -> [M, sum N_i], W_i = dequantize(kind_i, blocks_i, K): the
    parts of a fused layer, each of its own block type, in one call (compiled: one parallel region
    over every part at small M). Each output element as `linear` computes it. The parts' blocks
    are not checked here: callers validate them at load."""
    _check_x(x, n_cols)
    return table().linear_parts(x, parts, n_cols)


def embedding(ids: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """Rows `ids` of the blocks, dequantized: float32 [*ids.shape, n_cols] (ids must be in range)."""
    kind = block_type(qtype)
    check_blocks(kind, blocks, n_cols)
    flat = ids.reshape(-1).to(torch.int64)
    return table().embedding(flat, blocks, kind, n_cols).reshape(*ids.shape, n_cols)


def linear_bf16(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """Opt-in batched path: y = bf16(x) @ bf16(dequantize(W)).T, float32 out, for float32 x [M, K].

    Both operands are rounded to bfloat16 (the weights after exact dequantization), products are
    summed in float32. Compiled (AMX) it is still batch invariant, as `linear` is, and several times
    faster than `linear` at batch 32; the numbers differ from `linear`'s by bfloat16 rounding, so
    callers offer it behind a flag. The fallback is torch's bfloat16 matmul (not batch invariant).
    """
    return table().linear_bf16(x, blocks, _checked(x, blocks, qtype, n_cols), n_cols)


def linear_int8(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """llama.cpp's arithmetic: each row of float32 x [M, K] quantized per block of 32 to int8 with a
    float32 scale, integer dot products against the weight blocks' quants, scaled and summed in
    float32 per output element in block order -> float32 [M, N].

    Batch invariant like `linear` (a row's output depends on that row and W only) and bitwise the
    same on every variant and the torch reference (`blocks.linear_int8_reference`); the numbers
    differ from `linear`'s by the activation rounding.
    Block types in INT8_QTYPES only (float weights have nothing to gain: use `linear`).
    """
    kind = _checked(x, blocks, qtype, n_cols)
    if kind not in INT8_QTYPES:
        raise ValueError(f"no int8 path for {qtype}; it serves {list(INT8_QTYPES)}")
    return table().linear_int8(x, blocks, kind, n_cols)


def linear_int8_parts(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, BlockType]], n_cols: int) -> torch.Tensor:
    """`linear_int8` of a fused layer's parts (each of its own INT8_QTYPES block type) side by side,
    [M, sum N_i], in one call: x quantized once, one parallel region over every part at small M."""
    _check_x(x, n_cols)
    return table().linear_int8_parts(x, parts, n_cols)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_slots: torch.Tensor,
                     starts: torch.Tensor, lens: torch.Tensor, scaling: float, softcap: float | None,
                     window: int | None) -> torch.Tensor:
    """One query per request: q [R, H, D] against K/V buffers [S, Hkv, D]; request r sees the pool rows
    kv_slots[starts[r] : starts[r] + lens[r]] (the last `window` of them if windowed) -> [R, H * D].

    Compiled, each request's output is summed in an order fixed by its own keys alone, so it is bitwise
    the same whatever it is batched with."""
    return table().decode_attention(q, k_buf, v_buf, kv_slots, starts, lens, scaling, softcap, window)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row of x [B, V] (a NaN counts as the maximum), int64 [B]."""
    return table().argmax(x)


# ---------------------------------------------------------------- row-wise float32 ops of a layer
# Each takes float32 rows; a row's result depends on that row alone (in the same order at any batch),
# so a request's numbers do not depend on what it is batched with. Callers with other dtypes keep
# their own torch code (the model's dtype decides where the casts go).

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight over the last dim of float32 x [T, D] (weight: the effective float32
    scale, e.g. Gemma's 1 + w)."""
    return table().rms_norm(x, weight, eps)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, wx: torch.Tensor | None, wy: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual step of float32 rows [T, D]: h2 = h + (rmsnorm(x) * wx if wx given, else x), then
    (h2, rmsnorm(h2) * wy), the second None without wy. h is not modified."""
    return table().add_rms_norm(h, x, wx, wy, eps)


def qk_norm_rope(qkv: torch.Tensor, n_q: int, n_kv: int, head_dim: int, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q [T, n_q, D], k, v [T, n_kv, D] of float32 qkv [T, (n_q + 2 n_kv) D], with q and k
    RMS-normed per head (when weights are given) and rotated by cos/sin [T, D] (rotate-half form),
    in place in qkv."""
    t, d = qkv.shape[0], head_dim
    table().qk_norm_rope(qkv, n_q, n_kv, d, q_weight, k_weight, cos, sin, eps)
    q = qkv[:, :n_q * d].view(t, n_q, d)
    k = qkv[:, n_q * d:(n_q + n_kv) * d].view(t, n_kv, d)
    v = qkv[:, (n_q + n_kv) * d:(n_q + 2 * n_kv) * d].view(t, n_kv, d)
    return q, k, v


rotate = reference.rotate


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for float32 gate_up [T, 2I] (gate: the first I columns), act one of
    COMPILED_ACTS ("gelu_tanh": the tanh approximation of GELU)."""
    if act not in reference.COMPILED_ACTS:
        raise ValueError(f"act_and_mul: {act!r} is not one of {reference.COMPILED_ACTS}")
    return table().act_and_mul(gate_up, act)


def lora_sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
              ranks: torch.Tensor, slots: torch.Tensor, splits: Sequence[int]) -> None:
    """LoRA adapters' low-rank products beside one linear, every adapter's rows in one call (Punica's
    SGMV): y[t] += B_s A_s x[t] in place for each row t of slot s = slots[t] >= 0 (-1: the base).
    x [T, K], y [T, N]; the slots' weights stacked: a [S, M R, K] (module m's A in rows m R ..
    m R + ranks[s, m]), b [S, R, N] (B transposed, module m's outputs in columns splits[m] ..
    splits[m + 1], the scaling folded in), float32, bfloat16 or int8 (widened to float32 as they are
    read); scales float32 [S, M R] (each shrink result times its row's: 1 for float slots, A's and
    B's row scales multiplied for int8 ones); ranks int64 [S, M], slots int64 [T]. Each row's
    numbers depend on that row alone (csrc/lora.cpp states the compiled order)."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or slots.shape != (x.shape[0],):
        raise ValueError(f"lora_sgmv takes x [T, K], y [T, N], slots [T]; got {list(x.shape)}, "
                         f"{list(y.shape)}, {list(slots.shape)}")
    table().lora_sgmv(y, x, a, b, scales, ranks, slots, splits)


def decoder_layer(h: torch.Tensor, consts: LayerConsts, cos: torch.Tensor, sin: torch.Tensor,
                  k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, kv_slots: torch.Tensor,
                  starts: torch.Tensor, lens: torch.Tensor, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
    """A whole decoder layer of the float32 CPU path in one call (csrc/layer.cpp): the ops the
    model's modules run one by one, in their order, so the same bits. h [T, D] float32 rows; the
    layer's constants by name (`consts`, built once per layer: models/one_call.py); cos/sin [T,
    head_dim]; the layer's K/V buffers, where this step's K/V goes (loc) and each row's K/V slots
    (kv_slots[starts[r] : starts[r] + lens[r]]) as `decode_attention` reads them; each row's LoRA
    slot (`lora_sgmv`'s, with the consts' lora_* operands), None where no row has an adapter."""
    return table().decoder_layer(h, consts, cos, sin, k_buf, v_buf, loc, kv_slots, starts, lens, lora_slots)
