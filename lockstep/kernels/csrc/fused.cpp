// Row-wise float32 ops of a decoder layer, fused so a decode step makes one call where torch makes
// several: RMSNorm (with the residual add before it), per-head q/k RMSNorm with rotary, and the gated
// activations. Included by kernels.cpp inside its anonymous namespace (it uses V and reduce32).
//
// Every output row depends on its own input row only, computed in the same order whatever the number
// of rows or the thread: so a request's numbers do not depend on its batch. Sums of squares follow the
// linear kernels' lane order (element k to lane k % 32, fixed tree), then the elements past the last
// whole 32 in increasing k.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "blocks.h"
#include "ops.h"

namespace lockstep {
// ---------------------------------------------------------------- RMSNorm
// 1 / sqrt(mean(x^2) + eps) over d elements
inline float inv_rms(const float* x, int64_t d, float eps) {
  V a0 = vzero(), a1 = vzero();
  int64_t k = 0;
  for (; k + 32 <= d; k += 32) {
    const V x0 = vload(x + k), x1 = vload(x + k + 16);
    a0 = vfma(x0, x0, a0);
    a1 = vfma(x1, x1, a1);
  }
  float ss = reduce32(a0, a1);
  for (; k < d; ++k) ss = std::fma(x[k], x[k], ss);
  return 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
}

// y = (x * r) * w, elementwise; y may be x
inline void scale_row(const float* x, float r, const float* w, float* y, int64_t d) {
  const V rv = vset1(r);
  int64_t k = 0;
  for (; k + 16 <= d; k += 16) vstore(y + k, vmul(vmul(vload(x + k), rv), vload(w + k)));
  for (; k < d; ++k) y[k] = (x[k] * r) * w[k];
}

// h + x, elementwise into out
inline void add_row(const float* h, const float* x, float* out, int64_t d) {
  int64_t k = 0;
  for (; k + 16 <= d; k += 16) vstore(out + k, vadd(vload(h + k), vload(x + k)));
  for (; k < d; ++k) out[k] = h[k] + x[k];
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1 && t.device().is_cpu(),
              what, " must be float32 [T, D] on the CPU with contiguous rows");
}
void check_vec(const at::Tensor& w, int64_t d, const char* what) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == d && w.is_contiguous(),
              what, " must be contiguous float32 [", d, "]");
}
// rows per task: at least 128k elements (tens of microseconds), so a decode batch's few rows run on
// the calling thread: a fork costs more than it saves there, and far more when another process holds
// the second core (the calling thread then waits a scheduler tick at the join). Prefill forks.
inline int64_t row_grain(int64_t d) { return std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(d, 1)); }

// y = rmsnorm(x) * w per row
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t t = x.size(0), d = x.size(1), xs = x.stride(0);
  check_vec(w, d, "w");
  at::Tensor y = at::empty({t, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, t, row_grain(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      scale_row(xp + r * xs, inv_rms(xp + r * xs, d, static_cast<float>(eps)), wp, yp + r * d, d);
  });
  return y;
}

// The residual step between sublayers: h2 = h + (wx given ? rmsnorm(x) * wx : x), then
// y = rmsnorm(h2) * wy. Returns (h2, y); y is undefined when wy is None.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& x,
                                                const c10::optional<at::Tensor>& wx,
                                                const c10::optional<at::Tensor>& wy, double eps) {
  check_rows(h, "h");
  check_rows(x, "x");
  const int64_t t = h.size(0), d = h.size(1);
  TORCH_CHECK(x.size(0) == t && x.size(1) == d, "h and x must have the same shape");
  if (wx) check_vec(*wx, d, "wx");
  if (wy) check_vec(*wy, d, "wy");
  at::Tensor h2 = at::empty({t, d}, h.options());
  at::Tensor y = wy ? at::empty({t, d}, h.options()) : at::Tensor();
  const float* hp = h.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wxp = wx ? wx->data_ptr<float>() : nullptr;
  const float* wyp = wy ? wy->data_ptr<float>() : nullptr;
  float* h2p = h2.data_ptr<float>();
  float* yp = wy ? y.data_ptr<float>() : nullptr;
  const int64_t hs = h.stride(0), xs = x.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, row_grain(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * xs;
      float* out = h2p + r * d;
      if (wxp) {
        scale_row(xr, inv_rms(xr, d, e), wxp, out, d);  // rmsnorm(x) * wx, then + h below
        add_row(hp + r * hs, out, out, d);
      } else {
        add_row(hp + r * hs, xr, out, d);
      }
      if (wyp) scale_row(out, inv_rms(out, d, e), wyp, yp + r * d, d);
    }
  });
  return {h2, y};
}

// ---------------------------------------------------------------- q/k norm and rotary
// In place on qkv [T, (hq + hk + hv) * dh]: each of the first hq + hk heads of a row is RMS-normed
// (by qw for query heads, kw for key heads, when given), then rotated by the rotate-half rule with
// that row's cos/sin [T, dh]: out[i] = x[i] cos[i] - x[i+h] sin[i], out[i+h] = x[i+h] cos[i+h] +
// x[i] sin[i+h] (the torch reference's x * cos + cat(-x2, x1) * sin, rounded the same way).
void qk_norm_rope(const at::Tensor& qkv, int64_t hq, int64_t hk, int64_t dh, const c10::optional<at::Tensor>& qw,
                  const c10::optional<at::Tensor>& kw, const at::Tensor& cos, const at::Tensor& sin,
                  double eps) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t t = qkv.size(0);
  TORCH_CHECK(dh > 0 && dh % 2 == 0 && dh <= 1024, "head_dim must be even and at most 1024, got ", dh);
  TORCH_CHECK(hq >= 0 && hk >= 0 && qkv.size(1) >= (hq + hk) * dh, "qkv rows are narrower than the heads");
  TORCH_CHECK(cos.size(0) == t && cos.size(1) == dh && sin.size(0) == t && sin.size(1) == dh,
              "cos and sin must be [T, head_dim]");
  if (qw) check_vec(*qw, dh, "q norm weight");
  if (kw) check_vec(*kw, dh, "k norm weight");
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float* qwp = qw ? qw->data_ptr<float>() : nullptr;
  const float* kwp = kw ? kw->data_ptr<float>() : nullptr;
  const int64_t rs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0), half = dh / 2;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, row_grain((hq + hk) * dh), [&](int64_t r0, int64_t r1) {
    alignas(64) float buf[1024];
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cp + r * cs;
      const float* s = sp + r * ss;
      for (int64_t head = 0; head < hq + hk; ++head) {
        float* x = base + r * rs + head * dh;
        const float* w = head < hq ? qwp : kwp;
        const float* src = x;
        if (w) {
          scale_row(x, inv_rms(x, dh, e), w, buf, dh);
          src = buf;
        } else {
          std::memcpy(buf, x, dh * sizeof(float));
          src = buf;
        }
        int64_t i = 0;
        for (; i + 16 <= half; i += 16) {
          const V a = vload(src + i), b = vload(src + half + i);
          vstore(x + i, vsub(vmul(a, vload(c + i)), vmul(b, vload(s + i))));
          vstore(x + half + i, vadd(vmul(b, vload(c + half + i)), vmul(a, vload(s + half + i))));
        }
        for (; i < half; ++i) {
          const float a = src[i], b = src[half + i];
          x[i] = a * c[i] - b * s[i];
          x[half + i] = b * c[half + i] + a * s[half + i];
        }
      }
    }
  });
}

// ---------------------------------------------------------------- gated activations
// out[T, I] = act(gate) * up for gate_up [T, 2I] (gate = first I columns). gelu_tanh(g) is written
// as g / (1 + exp(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3): the same function as
// 0.5 g (1 + tanh(u)), without its cancellation where tanh(u) is near -1. silu(g) = g / (1 + exp(-g)).
template <bool kGelu>
inline V gate_act(V g) {
  if (kGelu) {
    const V u = vmul(vset1(0.7978845608028654f), vadd(g, vmul(vset1(0.044715f), vmul(g, vmul(g, g)))));
    return vdiv(g, vadd(vset1(1.0f), vexp(vmul(vset1(-2.0f), u))));
  }
  return vdiv(g, vadd(vset1(1.0f), vexp(vsub(vzero(), g))));
}
template <bool kGelu>
inline float gate_act_scalar(float g) {
  if (kGelu) {
    const float u = 0.7978845608028654f * (g + 0.044715f * (g * (g * g)));
    return g / (1.0f + exp_scalar(-2.0f * u));
  }
  return g / (1.0f + exp_scalar(0.0f - g));
}

at::Tensor act_and_mul(const at::Tensor& gate_up, const std::string& act) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(act == "gelu_tanh" || act == "silu", "act_and_mul: no compiled ", act);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t t = gate_up.size(0), n = gate_up.size(1) / 2, gs = gate_up.stride(0);
  at::Tensor out = at::empty({t, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto run = [&](auto gelu) {
    constexpr bool kGelu = decltype(gelu)::value;
    at::parallel_for(0, t, row_grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* g = gp + r * gs;
        const float* u = g + n;
        float* o = op + r * n;
        int64_t k = 0;
        for (; k + 16 <= n; k += 16) vstore(o + k, vmul(gate_act<kGelu>(vload(g + k)), vload(u + k)));
        for (; k < n; ++k) o[k] = gate_act_scalar<kGelu>(g[k]) * u[k];
      }
    });
  };
  if (act == "gelu_tanh")
    run(std::true_type{});
  else
    run(std::false_type{});
  return out;
}

}  // namespace lockstep
