// One decoder layer of the CPU float32 path in one call: what models/llama.py (and gemma3.py) run
// module by module, op for op, with the same kernels in the same order, so the same bits
// (tests/test_fused_kernels.py holds the two equal on Llama- and Gemma-shaped layers, block and float
// weights, int8 and exact activations). What it saves is the Python between the kernels: about 300
// interpreter calls per layer (module calls, dispatch checks, views) around ~10 kernel calls: 15% of a
// one-user decode step's CPU time on the AVX2 EPYC (docs/benchmarks.md). Tensor-parallel ranks keep
// the module path: their collectives sit between these ops.
#include <ATen/ATen.h>

#include "ops.h"

namespace lockstep {
namespace {

constexpr int64_t kOwnWeight = -2;  // the layer's own float weight: torch's linear with the bias
constexpr int64_t kFloatPart = -1;  // a float part beside block parts (dequantized at load)

// block_weight.matmul_parts, then the bias: all-exact block parts in one linear_parts call, all-int8 ones
// in one linear_int8_parts call, else one matmul per part (int8 or exact kernel, torch's for float parts)
at::Tensor parts_matmul(const at::Tensor& x, const std::vector<at::Tensor>& w, const std::vector<int64_t>& type,
                        const std::vector<int64_t>& int8, int64_t lo, int64_t hi, int64_t k,
                        const c10::optional<at::Tensor>& bias) {
  if (hi - lo == 1 && type[lo] == kOwnWeight) return at::linear(x, w[lo], bias);
  bool exact = true, all_int8 = true;
  for (int64_t i = lo; i < hi; ++i) {
    exact = exact && type[i] >= 0 && !int8[i];
    all_int8 = all_int8 && type[i] >= 0 && int8[i];
  }
  at::Tensor y;
  if (exact || all_int8) {
    const std::vector<at::Tensor> ws(w.begin() + lo, w.begin() + hi);
    const std::vector<int64_t> ts(type.begin() + lo, type.begin() + hi);
    y = exact ? linear_parts(x.contiguous(), ws, ts, k) : linear_int8_parts(x.contiguous(), ws, ts, k);
  } else {
    std::vector<at::Tensor> outs;
    for (int64_t i = lo; i < hi; ++i) {
      if (type[i] == kFloatPart) outs.push_back(at::linear(x, w[i]));
      else if (int8[i]) outs.push_back(linear_int8(x.contiguous(), w[i], type[i], k));
      else outs.push_back(linear(x.contiguous(), w[i], type[i], k));
    }
    y = outs.size() == 1 ? outs[0] : at::cat(outs, -1);
  }
  return bias ? y + *bias : y;
}

}  // namespace

at::Tensor decoder_layer(const at::Tensor& h, const std::vector<at::Tensor>& norms, double eps,
                         const std::vector<at::Tensor>& w, const std::vector<int64_t>& type,
                         const std::vector<int64_t>& int8, const std::vector<int64_t>& count,
                         const std::vector<int64_t>& k, const c10::optional<at::Tensor>& qkv_bias, int64_t hq,
                         int64_t hk, int64_t dh, const c10::optional<at::Tensor>& qw,
                         const c10::optional<at::Tensor>& kw, double qk_eps, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& k_buf, const at::Tensor& v_buf,
                         const at::Tensor& loc, const at::Tensor& kv_slots, const at::Tensor& starts,
                         const at::Tensor& lens, double scaling, double softcap, int64_t window,
                         const std::string& act) {
  TORCH_CHECK(norms.size() == 2 || norms.size() == 4, "norms: 2 (Llama) or 4 (Gemma)");
  TORCH_CHECK(count.size() == 4 && k.size() == 4, "four linears: qkv, o, gate_up, down");
  TORCH_CHECK(w.size() == type.size() && w.size() == int8.size() &&
                  static_cast<int64_t>(w.size()) == count[0] + count[1] + count[2] + count[3],
              "one type and int8 flag per weight part");
  const bool gemma = norms.size() == 4;
  int64_t at_part = 0;
  auto matmul = [&](const at::Tensor& x, int i, const c10::optional<at::Tensor>& bias) {
    const int64_t lo = at_part;
    at_part += count[i];
    return parts_matmul(x, w, type, int8, lo, at_part, k[i], bias);
  };
  // attention: input norm, qkv, q/k norms and rotary in place, KV written, every row's attention
  const at::Tensor qkv = matmul(rms_norm(h, norms[0], eps), 0, qkv_bias);
  qk_norm_rope(qkv, hq, hk, dh, qw, kw, cos, sin, qk_eps);
  const int64_t t = qkv.size(0);
  const at::Tensor q = qkv.narrow(1, 0, hq * dh).view({t, hq, dh});
  // K/V rounded to the pool's type (--kv-cache-dtype) as TokenToKVPool.set_kv rounds them: torch's conversion
  k_buf.index_put_({loc}, qkv.narrow(1, hq * dh, hk * dh).view({t, hk, dh}).to(k_buf.scalar_type()));
  v_buf.index_put_({loc}, qkv.narrow(1, (hq + hk) * dh, hk * dh).view({t, hk, dh}).to(v_buf.scalar_type()));
  const at::Tensor a = matmul(decode_attention(q, k_buf, v_buf, kv_slots, starts, lens, scaling, softcap, window),
                              1, c10::nullopt);
  // residual steps around the MLP (layers/norm.add_norm)
  at::Tensor h2, x;
  if (gemma) std::tie(h2, x) = add_rms_norm(h, a, norms[1], norms[2], eps);
  else std::tie(h2, x) = add_rms_norm(h, a, c10::nullopt, norms[1], eps);
  const at::Tensor m = matmul(act_and_mul(matmul(x, 2, c10::nullopt), act), 3, c10::nullopt);
  if (gemma) return std::get<0>(add_rms_norm(h2, m, norms[3], c10::nullopt, eps));
  return h2 + m;
}

}  // namespace lockstep
