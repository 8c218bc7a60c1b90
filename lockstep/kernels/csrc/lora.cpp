// LoRA adapters' low-rank products beside one linear, for the whole batch in one call (Punica's SGMV,
// S-LoRA's shape): y[t] += B_s (A_s x[t]) for every row t whose slot s = slots[t] is >= 0, each fused
// linear's modules (q/k/v, gate/up) in the same call, one shrink and one expand per module.
//
// Operands, the adapter slots stacked so that a row indexes its own:
//   x [T, K], y [T, N]   float32 rows (each contiguous; y is added to in place)
//   a [S, M * R, K]      slot s's A: module m's rows are m * R .. m * R + ranks[s, m]
//   b [S, R, N]          slot s's B transposed: b[s, j, n] = B_m[n - splits[m], j] for n in module m's
//                        output columns splits[m] .. splits[m + 1] (the adapter's scaling folded in)
//   ranks [S, M] int64   each slot's rank per module (0: the module is not adapted, nothing is added)
// a and b are both float32 or both bfloat16 (lora/layers.slot_dtype decides): bfloat16 halves the bytes
// a decode step streams per adapter row, and each value is widened exactly to float32 as it is loaded
// (its 16 bits shifted into the high half), so everything below is float32 either way.
// Arithmetic contract, one row at a time (so a row's bits never depend on the other rows, how many
// there are, their slots or the threads; the same on the AVX2 and AVX-512 builds, and in
// tests/kernels/test_lora_kernel.py's torch emulation, which is why products and sums are not fused):
//   shrink  u[i] = A row i . x[t]: element k's product goes to lane k % 32 of a 32-lane accumulator
//           (acc = acc + x * a, in increasing k, from 0), then the lanes are summed by linear.cpp's tree
//           (i + i+16, i + i+8, i + i+4, i + i+2, i + i+1)
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

// The slots' element types: float, or bfloat16 as its bits (widened exactly as it is loaded)
using bf16 = uint16_t;
inline V wload(const float* p) { return vload(p); }
inline V wload(const bf16* p) { return from_bf16(reinterpret_cast<const uint8_t*>(p)); }
inline float wvalue(float w) { return w; }
inline float wvalue(bf16 w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// u[i * us + j] = A row j . x row i, for i < MT rows (stride xs) and j < NT rows of A (stride k)
template <int MT, int NT, class W>
inline void shrink_tile(const float* x, int64_t xs, const W* a, int64_t k, float* u, int64_t us) {
  V acc[MT][NT][2];
  UNROLL for (int i = 0; i < MT; ++i)
    UNROLL for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = vzero();
  for (int64_t c = 0; c < k; c += 32) {
    V w0[NT], w1[NT];
    UNROLL for (int j = 0; j < NT; ++j) {
      // A streams from memory (8 adapters' slots do not stay in cache): fetch ahead, into the
      // rows that follow (a slot's rows are contiguous); 32 elements are one line in bfloat16, two in float
      const char* ahead = reinterpret_cast<const char*>(a + j * k + c) + kPrefetchBytes;
      _mm_prefetch(ahead, _MM_HINT_T0);
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
    UNROLL for (int j = 0; j < NT; ++j) u[i * us + j] = reduce32(acc[i][j][0], acc[i][j][1]);
}

// u[i * us + j] for rows j of A [j0, j1): as many A rows at once as the accumulators fit in
// registers (more rows in flight, more of memory's latency hidden: one row is a decode step's case)
template <int MT, class W>
void shrink_rows(const float* x, int64_t xs, const W* a, int64_t k, float* u, int64_t us, int64_t j0,
                 int64_t j1) {
#ifdef LOCKSTEP_AVX512
  constexpr int kRows = MT == 1 ? 8 : MT == 2 ? 4 : 2;
#else
  constexpr int kRows = MT == 1 ? 4 : 2;
#endif
  int64_t j = j0;
  for (; j + kRows <= j1; j += kRows) shrink_tile<MT, kRows>(x, xs, a + j * k, k, u + j, us);
  for (; j + 2 <= j1; j += 2) shrink_tile<MT, 2>(x, xs, a + j * k, k, u + j, us);
  if (j < j1) shrink_tile<MT, 1>(x, xs, a + j * k, k, u + j, us);
}

// y[i * ys + n] += sum_j b[j * bs + n] * u[i * us + j] (j < r, in order) for columns n in [c0, c1)
template <int MT, class W>
void expand_cols(const float* u, int64_t us, const W* b, int64_t bs, int64_t r, float* y, int64_t ys,
                 int64_t c0, int64_t c1) {
  int64_t n = c0;
  for (; n + 16 <= c1; n += 16) {
    V acc[MT];
    UNROLL for (int i = 0; i < MT; ++i) acc[i] = vzero();
    for (int64_t j = 0; j < r; ++j) {
      // the next columns of each B row this item reads (columns of a row are apart by its stride)
      _mm_prefetch(reinterpret_cast<const char*>(b + j * bs + n + 2 * kExpandCols), _MM_HINT_T0);
      const V bv = wload(b + j * bs + n);
      UNROLL for (int i = 0; i < MT; ++i) acc[i] = vadd(acc[i], vmul(bv, vset1(u[i * us + j])));
    }
    UNROLL for (int i = 0; i < MT; ++i) vstore(y + i * ys + n, vadd(vload(y + i * ys + n), acc[i]));
  }
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

struct Item {
  int64_t row0, rows, slot, module, lo, hi;  // a tile of one slot's rows; A rows or columns [lo, hi)
};

struct Work {
  std::vector<Item> shrink, expand;
  const float* x;
  float* y;
  float* u;  // each row's shrink results, [T, M R]
  int64_t xs, ys, us, k, n, m, r_max;
  const int64_t* ranks;
};

template <class W>
void run(const Work& wk, const W* ap, const W* bp) {
  const int64_t n_shrink = static_cast<int64_t>(wk.shrink.size()), n_expand = static_cast<int64_t>(wk.expand.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), n_expand));
  const int64_t us = wk.us, k = wk.k, r_max = wk.r_max;
  // One parallel region for both phases, a barrier between them (the expand reads every shrink
  // result): one fork per linear, not two, which one user's decode step feels (120 linears a step).
#pragma omp parallel num_threads(threads) if (threads > 1 && !omp_in_parallel())
  {
#pragma omp for schedule(static)
    for (int64_t w = 0; w < n_shrink; ++w) {
      const Item& it = wk.shrink[w];
      const W* arows = ap + (it.slot * us + it.module * r_max) * k;
      float* urow = wk.u + it.row0 * us + it.module * r_max;
      by_rows(it.rows, [&](auto mt) {
        shrink_rows<decltype(mt)::value>(wk.x + it.row0 * wk.xs, wk.xs, arows, k, urow, us, it.lo, it.hi);
      });
    }
#pragma omp for schedule(static)
    for (int64_t w = 0; w < n_expand; ++w) {
      const Item& it = wk.expand[w];
      const float* urow = wk.u + it.row0 * us + it.module * r_max;
      const int64_t r = wk.ranks[it.slot * wk.m + it.module];
      by_rows(it.rows, [&](auto mt) {
        expand_cols<decltype(mt)::value>(urow, us, bp + it.slot * r_max * wk.n, wk.n, r, wk.y + it.row0 * wk.ys,
                                         wk.ys, it.lo, it.hi);
      });
    }
  }
}

}  // namespace

void lora_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& ranks, const at::Tensor& slots, const std::vector<int64_t>& splits) {
  const int64_t t = x.size(0), k = x.size(1), m = static_cast<int64_t>(splits.size()) - 1;
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                  x.stride(1) == 1 && y.stride(1) == 1 && y.size(0) == t && k % 32 == 0,
              "lora_sgmv: float32 rows x [T, K] (K whole groups of 32) and y [T, N]");
  const auto wtype = a.scalar_type();
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && b.scalar_type() == wtype &&
                  (wtype == at::kFloat || wtype == at::kBFloat16) && m >= 1,
              "lora_sgmv: contiguous a [S, M R, K], b [S, R, N], both float32 or both bfloat16");
  const int64_t s_count = a.size(0), r_max = b.size(1), n = b.size(2);
  TORCH_CHECK(a.size(1) == m * r_max && a.size(2) == k && b.size(0) == s_count && y.size(1) == n &&
                  splits.front() == 0 && splits.back() == n,
              "lora_sgmv: a [S, M R, K] and b [S, R, N] for M = len(splits) - 1 modules splitting N");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous() && ranks.dim() == 2 &&
                  ranks.size(0) == s_count && ranks.size(1) == m,
              "lora_sgmv: ranks int64 [S, M]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 && slots.size(0) == t,
              "lora_sgmv: slots int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* rp = ranks.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sp[i] < s_count, "lora_sgmv: slot ", sp[i], " of ", s_count);
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(splits[i] <= splits[i + 1], "lora_sgmv: splits must not decrease");
  for (int64_t i = 0; i < s_count * m; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] <= r_max, "lora_sgmv: rank ", rp[i]);

  // the work: tiles of up to kRowTile consecutive rows of one slot, split by A rows, then by columns
  Work wk;
  for (int64_t i = 0; i < t;) {
    const int64_t s = sp[i];
    int64_t e = i + 1;
    while (e < t && e - i < kRowTile && sp[e] == s) ++e;
    if (s >= 0) {
      for (int64_t mod = 0; mod < m; ++mod) {
        const int64_t r = rp[s * m + mod];
        if (r == 0) continue;
        for (int64_t j = 0; j < r; j += kShrinkRows)
          wk.shrink.push_back({i, e - i, s, mod, j, std::min(r, j + kShrinkRows)});
        for (int64_t c = splits[mod]; c < splits[mod + 1]; c += kExpandCols)
          wk.expand.push_back({i, e - i, s, mod, c, std::min(splits[mod + 1], c + kExpandCols)});
      }
    }
    i = e;
  }
  if (wk.shrink.empty()) return;
  std::vector<float> u(static_cast<size_t>(t * m * r_max));
  wk.x = x.data_ptr<float>();
  wk.y = y.data_ptr<float>();
  wk.u = u.data();
  wk.xs = x.stride(0);
  wk.ys = y.stride(0);
  wk.us = m * r_max;
  wk.k = k;
  wk.n = n;
  wk.m = m;
  wk.r_max = r_max;
  wk.ranks = rp;
  if (wtype == at::kFloat) run(wk, a.data_ptr<float>(), b.data_ptr<float>());
  else run(wk, static_cast<const bf16*>(a.data_ptr()), static_cast<const bf16*>(b.data_ptr()));
}

}  // namespace lockstep
