// One decoder layer of the CPU float32 path in one call: what models/llama.py (and gemma3.py) run
// module by module, op for op, with the same kernels in the same order, so the same bits
// (tests/test_fused_kernels.py holds the two equal on Llama- and Gemma-shaped layers, block and float
// weights, int8 and exact activations). What it saves is the Python between the kernels: hundreds of
// interpreter calls per layer (module calls, dispatch checks, views) around about ten kernel calls, a
// visible share of a one-user decode step (docs/benchmarks.md, "One call per decoder layer").
// Tensor-parallel ranks keep the module path: their collectives sit between these ops.
#include <ATen/ATen.h>

#include "ops.h"

namespace lockstep {
namespace {

// block_weight.matmul_parts, then the bias, then the adapters' products (lora, or null): a lone float part
// is the layer's own float weight (torch's linear with the bias, as the module runs it); all-exact parts
// in one linear_parts call, all-int8 ones in one linear_int8_parts call (which also runs the adapters'
// products where no bias comes between: the same bits as lora_sgmv after it, one parallel region fewer);
// else one matmul per part, each on its kind's kernel
at::Tensor parts_matmul(const at::Tensor& x, const LayerConsts& c, int64_t lo, int64_t hi, int64_t k,
                        const c10::optional<at::Tensor>& bias, const LoraOperands* lora) {
  const auto& w = c.weights;
  bool exact = true, int8 = true;
  for (int64_t i = lo; i < hi; ++i) {
    exact = exact && c.kinds[i] == PartKind::kExact;
    int8 = int8 && c.kinds[i] == PartKind::kInt8;
  }
  at::Tensor y;
  if (hi - lo == 1 && c.kinds[lo] == PartKind::kFloat) {
    y = at::linear(x, w[lo], bias);
  } else if (exact || int8) {
    const std::vector<at::Tensor> ws(w.begin() + lo, w.begin() + hi);
    const std::vector<int64_t> ts(c.block_types.begin() + lo, c.block_types.begin() + hi);
    if (int8 && lora && !bias) return linear_int8_parts_lora(x.contiguous(), ws, ts, k, lora);
    y = exact ? linear_parts(x.contiguous(), ws, ts, k) : linear_int8_parts(x.contiguous(), ws, ts, k);
    if (bias) y = y + *bias;
  } else {
    std::vector<at::Tensor> outs;
    for (int64_t i = lo; i < hi; ++i) {
      switch (c.kinds[i]) {
        case PartKind::kFloat: outs.push_back(at::linear(x, w[i])); break;
        case PartKind::kInt8: outs.push_back(linear_int8(x.contiguous(), w[i], c.block_types[i], k)); break;
        case PartKind::kExact: outs.push_back(linear(x.contiguous(), w[i], c.block_types[i], k)); break;
      }
    }
    y = outs.size() == 1 ? outs[0] : at::cat(outs, -1);
    if (bias) y = y + *bias;
  }
  if (lora) lora_add(y, x, *lora);
  return y;
}

}  // namespace

at::Tensor decoder_layer(const at::Tensor& h, const LayerConsts& c, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& loc,
                         const at::Tensor& kv_slots, const at::Tensor& starts, const at::Tensor& lens,
                         const c10::optional<at::Tensor>& lora_slots) {
  const auto& norms = c.norms;
  const bool gemma = norms.size() == 4;
  int64_t at_part = 0;
  // a linear as _BlockParts._matmul runs it: the parts, the bias, then the adapters' products
  auto matmul = [&](const at::Tensor& x, int i, const c10::optional<at::Tensor>& bias) {
    const int64_t lo = at_part;
    at_part += c.part_counts[i];
    if (!lora_slots || c.lora.empty() || !c.lora[i]) return parts_matmul(x, c, lo, at_part, c.in_features[i], bias, nullptr);
    const LoraOperands lora{*c.lora[i], *lora_slots};
    return parts_matmul(x, c, lo, at_part, c.in_features[i], bias, &lora);
  };
  const int64_t hq = c.n_q, hk = c.n_kv, dh = c.head_dim;
  // attention: input norm, qkv, q/k norms and rotary in place, KV written, every row's attention
  const at::Tensor qkv = matmul(rms_norm(h, norms[0], c.eps), 0, c.qkv_bias);
  qk_norm_rope(qkv, hq, hk, dh, c.q_norm, c.k_norm, cos, sin, c.qk_eps);
  const int64_t t = qkv.size(0);
  const at::Tensor q = qkv.narrow(1, 0, hq * dh).view({t, hq, dh});
  // K/V rounded to the pool's type (--kv-cache-dtype) as TokenToKVPool.set_kv rounds them: torch's conversion
  k_buf.index_put_({loc}, qkv.narrow(1, hq * dh, hk * dh).view({t, hk, dh}).to(k_buf.scalar_type()));
  v_buf.index_put_({loc}, qkv.narrow(1, (hq + hk) * dh, hk * dh).view({t, hk, dh}).to(v_buf.scalar_type()));
  const at::Tensor a = matmul(decode_attention(q, k_buf, v_buf, kv_slots, starts, lens, c.scaling, c.softcap,
                                               c.window), 1, c10::nullopt);
  // residual steps around the MLP (layers/norm.add_norm)
  at::Tensor h2, x;
  if (gemma) std::tie(h2, x) = add_rms_norm(h, a, norms[1], norms[2], c.eps);
  else std::tie(h2, x) = add_rms_norm(h, a, c10::nullopt, norms[1], c.eps);
  const at::Tensor m = matmul(act_and_mul(matmul(x, 2, c10::nullopt), c.act), 3, c10::nullopt);
  if (gemma) return std::get<0>(add_rms_norm(h2, m, norms[3], c10::nullopt, c.eps));
  return h2 + m;
}

void finish_layer_consts(LayerConsts& c) {
  TORCH_CHECK(c.norms.size() == 2 || c.norms.size() == 4, "norms: 2 (Llama) or 4 (Gemma)");
  TORCH_CHECK(c.part_counts.size() == 4 && c.in_features.size() == 4, "four linears: qkv, o, gate_up, down");
  int64_t parts = 0;
  for (int64_t n : c.part_counts) parts += n;
  TORCH_CHECK(c.weights.size() == c.kinds.size() && c.weights.size() == c.block_types.size() &&
                  static_cast<int64_t>(c.weights.size()) == parts,
              "one kind and block type per weight part, part_counts adding up to them");
  const size_t lora = c.lora_a.size();
  TORCH_CHECK((lora == 0 || lora == 4) && c.lora_b.size() == lora && c.lora_scales.size() == lora &&
                  c.lora_ranks.size() == lora && c.lora_splits.size() == lora,
              "LoRA operands: none, or one of each per linear");
  for (size_t i = 0; i < lora; ++i) {
    if (!c.lora_a[i].numel()) c.lora.emplace_back();  // this linear has no adapter slots
    else c.lora.emplace_back(LoraWeights(c.lora_a[i], c.lora_b[i], c.lora_scales[i], c.lora_ranks[i], c.lora_splits[i]));
  }
}

}  // namespace lockstep
