// LoRA adapters' low-rank products beside one linear, for the whole batch in one call (Punica's SGMV,
// S-LoRA's shape): y[t] += B_s (A_s x[t]) for every row t whose slot s = slots[t] is >= 0, each fused
// linear's modules (q/k/v, gate/up) in the same call, one shrink and one expand per module.
//
// Operands, the adapter slots stacked so that a row indexes its own:
//   x [T, K], y [T, N]   float32 rows (each contiguous; y is added to in place)
//   a [S, M * R, K]      slot s's A: module m's rows are m * R .. m * R + ranks[s, m]
//   b [S, R, N]          slot s's B transposed: b[s, j, n] = B_m[n - splits[m], j] for n in module m's
//                        output columns splits[m] .. splits[m + 1] (the adapter's scaling folded in)
//   scales [S, M R]      float32, each A row's shrink result is multiplied by (1 where a and b are floats;
//                        int8 slots: A row i's scale times B row i's, as lora/layers.py quantizes them)
//   ranks [S, M] int64   each slot's rank per module (0: the module is not adapted, nothing is added)
// Each slot's a, b and scales are contiguous; the slots may lie at any stride apart (lora/layers.py keeps
// one buffer per slot, every linear's A and B views into it, so that one adapter's weights are one run).
// a and b are both float32, both bfloat16 or both int8 (lora/layers.slot_dtype decides): a decode step
// streams every adapter row's A and B from memory, so fewer bytes is what one user's step feels; each
// value is widened exactly to float32 as it is loaded (bfloat16's 16 bits shifted into the high half,
// int8 converted), so everything below is float32 whatever the slots hold.
// Arithmetic contract, one row at a time (so a row's bits never depend on the other rows, how many
// there are, their slots or the threads; the same on the AVX2 and AVX-512 builds, and in
// tests/kernels/test_lora_kernel.py's torch emulation, which is why products and sums are not fused):
//   shrink  u[i] = A row i . x[t]: element k's product goes to lane k % 32 of a 32-lane accumulator
//           (acc = acc + x * a, in increasing k, from 0), then the lanes are summed by linear.cpp's tree
//           (i + i+16, i + i+8, i + i+4, i + i+2, i + i+1), and that sum times scales[s, i]
//   expand  d[n] = 0; d = d + b[s, j, n] * u[m R + j] for j = 0 .. ranks[s, m] - 1; then y[t, n] += d
// Rows of one slot next to each other share each load of A and B (up to kRowTile rows): the reason the
// scheduler orders a batch by slot (LoraManager.grouped). Threads split both phases into small items
// (which thread computes an item changes nothing in it).
#include <ATen/Parallel.h>
#include <omp.h>

#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace lockstep {
namespace {

constexpr int64_t kRowTile = 4;   // rows of one slot sharing each weight load
constexpr int64_t kShrinkRows = 8;  // A rows per shrink work item
constexpr int64_t kExpandCols = 64;  // output columns per expand work item
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead A is fetched

// The slots' element types: float, bfloat16 as its bits, or int8 (each widened exactly as it is loaded)
using bf16 = uint16_t;
inline V wload(const float* p) { return vload(p); }
inline V wload(const bf16* p) { return from_bf16(reinterpret_cast<const uint8_t*>(p)); }
inline V wload(const int8_t* p) { return from_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float wvalue(float w) { return w; }
inline float wvalue(int8_t w) { return static_cast<float>(w); }
inline float wvalue(bf16 w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// u[i * us + j] = (A row j . x row i) * scale[j], for i < MT rows (stride xs) and j < NT rows of A (stride k)
template <int MT, int NT, class W>
inline void shrink_tile(const float* x, int64_t xs, const W* a, const float* scale, int64_t k, float* u,
                        int64_t us) {
  V acc[MT][NT][2];
  UNROLL for (int i = 0; i < MT; ++i)
    UNROLL for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = vzero();
  for (int64_t c = 0; c < k; c += 32) {
    V w0[NT], w1[NT];
    UNROLL for (int j = 0; j < NT; ++j) {
      // A streams from memory (8 adapters' slots do not stay in cache): fetch ahead, into the
      // rows that follow (a slot's rows are contiguous); 32 elements are half a line in int8, one in
      // bfloat16, two in float
      const char* ahead = reinterpret_cast<const char*>(a + j * k + c) + kPrefetchBytes;
      if (sizeof(W) > 1 || c % 64 == 0) _mm_prefetch(ahead, _MM_HINT_T0);
      if (sizeof(W) == 4) _mm_prefetch(ahead + 64, _MM_HINT_T0);
      w0[j] = wload(a + j * k + c);
      w1[j] = wload(a + j * k + c + 16);
    }
    UNROLL for (int i = 0; i < MT; ++i) {
      const V x0 = vload(x + i * xs + c), x1 = vload(x + i * xs + c + 16);
      UNROLL for (int j = 0; j < NT; ++j) {
        acc[i][j][0] = vadd(acc[i][j][0], vmul(x0, w0[j]));
        acc[i][j][1] = vadd(acc[i][j][1], vmul(x1, w1[j]));
      }
    }
  }
  UNROLL for (int i = 0; i < MT; ++i)
    UNROLL for (int j = 0; j < NT; ++j) u[i * us + j] = reduce32(acc[i][j][0], acc[i][j][1]) * scale[j];
}

// u[i * us + j] for rows j of A [j0, j1): as many A rows at once as the accumulators fit in
// registers (more rows in flight, more of memory's latency hidden: one row is a decode step's case)
template <int MT, class W>
void shrink_rows(const float* x, int64_t xs, const W* a, const float* scale, int64_t k, float* u, int64_t us,
                 int64_t j0, int64_t j1) {
#ifdef LOCKSTEP_AVX512
  constexpr int kRows = MT == 1 ? 8 : MT == 2 ? 4 : 2;
#else
  constexpr int kRows = MT == 1 ? 4 : 2;
#endif
  int64_t j = j0;
  for (; j + kRows <= j1; j += kRows) shrink_tile<MT, kRows>(x, xs, a + j * k, scale + j, k, u + j, us);
  for (; j + 2 <= j1; j += 2) shrink_tile<MT, 2>(x, xs, a + j * k, scale + j, k, u + j, us);
  if (j < j1) shrink_tile<MT, 1>(x, xs, a + j * k, scale + j, k, u + j, us);
}

// y[i * ys + n] += sum_j b[j * bs + n] * u[i * us + j] (j < r, in order) for columns n .. n + 16 NV: NV
// vectors of columns at once, so that a one-row expand is NV independent chains of adds, not one
template <int MT, int NV, class W>
inline void expand_block(const float* u, int64_t us, const W* b, int64_t bs, int64_t r, float* y, int64_t ys,
                         int64_t n) {
  V acc[MT][NV];
  UNROLL for (int i = 0; i < MT; ++i)
    UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  for (int64_t j = 0; j < r; ++j) {
    // the same columns of this B row for the blocks ahead (a row's columns are apart by its stride)
    _mm_prefetch(reinterpret_cast<const char*>(b + j * bs + n + 2 * kExpandCols), _MM_HINT_T0);
    V bv[NV];
    UNROLL for (int v = 0; v < NV; ++v) bv[v] = wload(b + j * bs + n + 16 * v);
    UNROLL for (int i = 0; i < MT; ++i) {
      const V uj = vset1(u[i * us + j]);
      UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = vadd(acc[i][v], vmul(bv[v], uj));
    }
  }
  UNROLL for (int i = 0; i < MT; ++i)
    UNROLL for (int v = 0; v < NV; ++v)
      vstore(y + i * ys + n + 16 * v, vadd(vload(y + i * ys + n + 16 * v), acc[i][v]));
}

// the same for columns n in [c0, c1)
template <int MT, class W>
void expand_cols(const float* u, int64_t us, const W* b, int64_t bs, int64_t r, float* y, int64_t ys,
                 int64_t c0, int64_t c1) {
  constexpr int kWide = MT == 1 ? 4 : MT == 2 ? 2 : 1;  // accumulators that fit in registers on AVX2 too
  int64_t n = c0;
  for (; n + 16 * kWide <= c1; n += 16 * kWide) expand_block<MT, kWide>(u, us, b, bs, r, y, ys, n);
  for (; n + 16 <= c1; n += 16) expand_block<MT, 1>(u, us, b, bs, r, y, ys, n);
  for (; n < c1; ++n) {  // the same operations, one lane at a time
    for (int i = 0; i < MT; ++i) {
      float d = 0.0f;
      for (int64_t j = 0; j < r; ++j) d = d + wvalue(b[j * bs + n]) * u[i * us + j];
      y[i * ys + n] = y[i * ys + n] + d;
    }
  }
}

template <class F>
void by_rows(int64_t rows, F f) {  // f(MT as a constant) for a tile of `rows` (1 .. kRowTile) rows
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// which part of n items part `part` of `parts` takes (contiguous, as OpenMP's static schedule)
std::pair<int64_t, int64_t> share(int64_t n, int64_t part, int64_t parts) {
  const int64_t chunk = (n + parts - 1) / parts;
  return {std::min(n, part * chunk), std::min(n, (part + 1) * chunk)};
}

template <class W>
void shrink_items(const LoraPlan::Items& items, const float* x, int64_t xs, const W* ap, int64_t a_slot,
                  const float* sp, int64_t s_slot, float* u, int64_t us, int64_t k, int64_t r_max, int64_t part,
                  int64_t parts) {
  const auto [w0, w1] = share(static_cast<int64_t>(items.size()), part, parts);
  for (int64_t w = w0; w < w1; ++w) {
    const LoraPlan::Item& it = items[w];
    const W* arows = ap + it.slot * a_slot + it.module * r_max * k;
    const float* scale = sp + it.slot * s_slot + it.module * r_max;
    float* urow = u + it.row0 * us + it.module * r_max;
    by_rows(it.rows, [&](auto mt) {
      shrink_rows<decltype(mt)::value>(x + it.row0 * xs, xs, arows, scale, k, urow, us, it.lo, it.hi);
    });
  }
}

template <class W>
void expand_items(const LoraPlan::Items& items, const float* u, int64_t us, const W* bp, int64_t b_slot,
                  const int64_t* ranks, int64_t m, int64_t n, int64_t r_max, float* y, int64_t ys, int64_t part,
                  int64_t parts) {
  const auto [w0, w1] = share(static_cast<int64_t>(items.size()), part, parts);
  for (int64_t w = w0; w < w1; ++w) {
    const LoraPlan::Item& it = items[w];
    const float* urow = u + it.row0 * us + it.module * r_max;
    by_rows(it.rows, [&](auto mt) {
      expand_cols<decltype(mt)::value>(urow, us, bp + it.slot * b_slot, n, ranks[it.slot * m + it.module],
                                       y + it.row0 * ys, ys, it.lo, it.hi);
    });
  }
}

// f(W{}) for the slots' element type
template <class F>
void by_type(at::ScalarType type, F f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(bf16{}); break;
    default: f(int8_t{}); break;  // the plan's checks let nothing else through
  }
}

}  // namespace

LoraWeights::LoraWeights(const at::Tensor& a_, const at::Tensor& b_, const at::Tensor& scales_,
                         const at::Tensor& ranks_, const std::vector<int64_t>& splits_)
    : a(a_), b(b_), scales(scales_), ranks(ranks_), splits(splits_), type(a_.scalar_type()) {
  m = static_cast<int64_t>(splits.size()) - 1;
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && b.scalar_type() == type &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kChar) && m >= 1,
              "lora_sgmv: a [S, M R, K], b [S, R, N], both float32, both bfloat16 or both int8");
  s_count = a.size(0);
  r_max = b.size(1);
  n = b.size(2);
  k = a.size(2);
  TORCH_CHECK(a.size(1) == m * r_max && k % 32 == 0 && b.size(0) == s_count && splits.front() == 0 &&
                  splits.back() == n,
              "lora_sgmv: a [S, M R, K] and b [S, R, N] for M = len(splits) - 1 modules splitting N, K whole "
              "groups of 32");
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(splits[i] <= splits[i + 1], "lora_sgmv: splits must not decrease");
  TORCH_CHECK(a.stride(2) == 1 && a.stride(1) == k && a.stride(0) >= m * r_max * k && b.stride(2) == 1 &&
                  b.stride(1) == n && b.stride(0) >= r_max * n,
              "lora_sgmv: each slot's a and b contiguous (the slots at any stride apart)");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == s_count &&
                  scales.size(1) == m * r_max && scales.stride(1) == 1,
              "lora_sgmv: scales float32 [S, M R], each slot's contiguous");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous() && ranks.dim() == 2 &&
                  ranks.size(0) == s_count && ranks.size(1) == m,
              "lora_sgmv: ranks int64 [S, M]");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && scales.device().is_cpu() && ranks.device().is_cpu(),
              "lora_sgmv: CPU tensors");
  ap = a.data_ptr();
  bp = b.data_ptr();
  sp = scales.data_ptr<float>();
  rp = ranks.data_ptr<int64_t>();
  a_slot = a.stride(0);
  b_slot = b.stride(0);
  s_slot = scales.stride(0);
}

LoraPlan::LoraPlan(const at::Tensor& x, const LoraWeights& w, const at::Tensor& slots) : w_(w) {
  const int64_t t = x.size(0), m = w.m;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) == w.k,
              "lora_sgmv: float32 rows x [T, K] (K the adapters' in features)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 && slots.size(0) == t,
              "lora_sgmv: slots int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* rp = w.rp;
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sp[i] < w.s_count, "lora_sgmv: slot ", sp[i], " of ", w.s_count);
  for (int64_t i = 0; i < w.s_count * m; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] <= w.r_max, "lora_sgmv: rank ", rp[i]);
  // the work: tiles of up to kRowTile consecutive rows of one slot, split by A rows, then by columns;
  // counted first, so that each list is allocated once (a plan per linear, 120 a decode step)
  const auto& splits = w.splits;
  auto tiles = [&](auto each) {
    for (int64_t i = 0; i < t;) {
      const int64_t s = sp[i];
      int64_t e = i + 1;
      while (e < t && e - i < kRowTile && sp[e] == s) ++e;
      for (int64_t mod = 0; s >= 0 && mod < m; ++mod)
        if (rp[s * m + mod]) each(i, e, s, mod, rp[s * m + mod]);
      i = e;
    }
  };
  size_t n_shrink = 0, n_expand = 0;
  tiles([&](int64_t, int64_t, int64_t, int64_t mod, int64_t r) {
    n_shrink += (r + kShrinkRows - 1) / kShrinkRows;
    n_expand += (splits[mod + 1] - splits[mod] + kExpandCols - 1) / kExpandCols;
  });
  if (!n_shrink) return;
  shrink_.reserve(n_shrink);
  expand_.reserve(n_expand);
  tiles([&](int64_t i, int64_t e, int64_t s, int64_t mod, int64_t r) {
    for (int64_t j = 0; j < r; j += kShrinkRows) shrink_.push_back({i, e - i, s, mod, j, std::min(r, j + kShrinkRows)});
    for (int64_t c = splits[mod]; c < splits[mod + 1]; c += kExpandCols)
      expand_.push_back({i, e - i, s, mod, c, std::min(splits[mod + 1], c + kExpandCols)});
  });
  x_ = x.data_ptr<float>();
  xs_ = x.stride(0);
  u_.resize(static_cast<size_t>(t * m * w.r_max));
}

void LoraPlan::shrink(int64_t part, int64_t parts) {
  const int64_t us = w_.m * w_.r_max;
  by_type(w_.type, [&](auto e) {
    using W = decltype(e);
    shrink_items(shrink_, x_, xs_, static_cast<const W*>(w_.ap), w_.a_slot, w_.sp, w_.s_slot, u_.data(), us, w_.k,
                 w_.r_max, part, parts);
  });
}

void LoraPlan::expand(float* y, int64_t ys, int64_t part, int64_t parts) const {
  const int64_t us = w_.m * w_.r_max;
  by_type(w_.type, [&](auto e) {
    using W = decltype(e);
    expand_items(expand_, u_.data(), us, static_cast<const W*>(w_.bp), w_.b_slot, w_.rp, w_.m, w_.n, w_.r_max, y,
                 ys, part, parts);
  });
}

void LoraPlan::run(int64_t threads, const std::function<void(int64_t, int64_t)>& before, float* y, int64_t ys) {
  // One parallel region for everything, a barrier before the expand (it reads every shrink result and
  // adds to what `before` wrote): one fork per linear, not two or three, which one user's decode step
  // feels (120 linears a step, a fork and its barriers a few microseconds each).
#pragma omp parallel num_threads(static_cast<int>(threads)) if (threads > 1 && !omp_in_parallel())
  {
    const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
    if (before) before(part, parts);
    if (!empty()) shrink(part, parts);
#pragma omp barrier
    if (!empty()) expand(y, ys, part, parts);
  }
}

void lora_add(const at::Tensor& y, const at::Tensor& x, const LoraOperands& lora) {
  LoraPlan plan(x, lora.w, lora.slots);
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.stride(1) == 1 && y.size(0) == x.size(0) &&
                  y.size(1) == lora.w.n,
              "lora_sgmv: float32 rows y [T, N]");
  if (plan.empty()) return;
  plan.run(std::min<int64_t>(at::get_num_threads(), plan.items()), nullptr, y.data_ptr<float>(), y.stride(0));
}

void lora_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& scales, const at::Tensor& ranks, const at::Tensor& slots,
               const std::vector<int64_t>& splits) {
  const LoraWeights w(a, b, scales, ranks, splits);
  lora_add(y, x, {w, slots});
}

}  // namespace lockstep
