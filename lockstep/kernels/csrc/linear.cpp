// The exact linear (and the embedding gather) on GGML blocks: y[M, N] = x[M, K] . W^T, W dequantized in registers.
//
// Every source here is compiled twice: with LOCKSTEP_AVX512 (AVX-512 F/BW/VL/DQ) and without (AVX2 + FMA + F16C).
// Determinism contract: every output element is accumulated the same way whatever M, the tile it lands in,
// the thread that computes it and the variant: element k of the dot product goes to lane k % 32 of a
// 32-lane float32 accumulator (fma, in increasing k), then the lanes are summed by a fixed tree
// (i + i+16, i + i+8, i + i+4, i + i+2, i + i+1). The weights are dequantized with the same float32
// operations, in the same order, as gguf.quants (and lockstep/kernels/blocks.py); build with
// -ffp-contract=off so the compiler fuses nothing we did not ask for.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "blocks.h"
#include "ops.h"

namespace lockstep {
// ---------------------------------------------------------------- tiles
#ifdef LOCKSTEP_AVX512
constexpr int kGemvRows = 4;  // W rows per tile at M = 1
constexpr int kSmallRows = 2;  // W rows per tile at M = 2 to 4
constexpr int kTileM = 4, kTileN = 2;
#else
constexpr int kGemvRows = 2;
constexpr int kSmallRows = 1;
constexpr int kTileM = 3, kTileN = 1;
#endif

// y[i * ys + j] = dot(x[i * xs ...], W row j) for i < MT, j < NT; W row j at w + j * wstride.
template <class T, int MT, int NT, bool kPrefetch>
inline void tile(const uint8_t* w, int64_t wstride, const float* x, int64_t xs, float* y, int64_t ys,
                 int64_t groups) {
  V acc[MT][NT][2];
  typename T::Scales scales[NT];
  UNROLL for (int i = 0; i < MT; ++i)
    UNROLL for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = vzero();
  for (int64_t b = 0; b < groups; ++b) {
    V w0[NT], w1[NT];
    UNROLL for (int j = 0; j < NT; ++j) {
      if (kPrefetch && (b & 1) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * wstride + b * T::kBytes + kPrefetchBytes),
                     _MM_HINT_T0);
      if (b % T::kPer == 0) T::prepare(w + j * wstride, b / T::kPer, scales[j]);
      T::load32(w + j * wstride, b, scales[j], w0[j], w1[j]);
    }
    UNROLL for (int i = 0; i < MT; ++i) {
      V x0 = vload(x + i * xs + 32 * b), x1 = vload(x + i * xs + 32 * b + 16);
      UNROLL for (int j = 0; j < NT; ++j) {
        acc[i][j][0] = vfma(x0, w0[j], acc[i][j][0]);
        acc[i][j][1] = vfma(x1, w1[j], acc[i][j][1]);
      }
    }
  }
  UNROLL for (int i = 0; i < MT; ++i)
    UNROLL for (int j = 0; j < NT; ++j) y[i * ys + j] = reduce32(acc[i][j][0], acc[i][j][1]);
}

// M = 1 to 3 (4 on AVX-512): stream W once, dequantizing in registers (a panel buffer costs more than
// it saves here). Tiles [t0, t1) of NT rows of one W of n rows; y row stride ys.
template <class T, int MT, int NT>
void gemv_tiles(const uint8_t* w, int64_t rb, const float* x, int64_t k, float* y, int64_t ys, int64_t n,
                int64_t groups, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t r = t * NT;
    if (r + NT <= n) {
      tile<T, MT, NT, true>(w + r * rb, rb, x, k, y + r, ys, groups);
    } else {
      for (int64_t q = r; q < n; ++q) tile<T, MT, 1, true>(w + q * rb, rb, x, k, y + q, ys, groups);
    }
  }
}
using GemvTiles = void (*)(const uint8_t*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t,
                           int64_t, int64_t);
constexpr int64_t kGemvMaxM =
#ifdef LOCKSTEP_AVX512
    4;  // 16 accumulators, 4 weight and 2 input registers: still fits 32
#else
    3;
#endif
inline int64_t gemv_rows(int64_t m) { return m == 1 ? kGemvRows : kSmallRows; }
template <class T>
GemvTiles gemv_fn(int64_t m) {
  switch (m) {
    case 1: return &gemv_tiles<T, 1, kGemvRows>;
    case 2: return &gemv_tiles<T, 2, kSmallRows>;
    case 3: return &gemv_tiles<T, 3, kSmallRows>;
#ifdef LOCKSTEP_AVX512
    case 4: return &gemv_tiles<T, 4, kSmallRows>;
#endif
    default: return nullptr;
  }
}

template <int MT>
void panel_rows(const float* wp, int64_t k, int64_t rows, const float* x, float* y, int64_t ys,
                int64_t groups) {
  const auto* wb = reinterpret_cast<const uint8_t*>(wp);
  const int64_t stride = k * 4;
  int64_t j = 0;
  for (; j + kTileN <= rows; j += kTileN)
    tile<F32, MT, kTileN, false>(wb + j * stride, stride, x, k, y + j, ys, groups);
  for (; j < rows; ++j) tile<F32, MT, 1, false>(wb + j * stride, stride, x, k, y + j, ys, groups);
}

// Larger M: dequantize a panel of W rows once into a float buffer, then run every M tile over it.
// y row stride ys.
template <class T>
void gemm(const uint8_t* w, int64_t rb, const float* x, float* y, int64_t ys, int64_t m, int64_t n, int64_t k,
          int64_t groups) {
  const int64_t panel = std::max<int64_t>(kTileN, (65536 / (4 * k)) / kTileN * kTileN);
  const int64_t panels = (n + panel - 1) / panel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> buf(static_cast<size_t>(panel * k));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r0 = p * panel, rows = std::min(panel, n - r0);
      for (int64_t r = 0; r < rows; ++r) dequant_row<T>(w + (r0 + r) * rb, groups, buf.data() + r * k);
      int64_t i = 0;
      for (; i + kTileM <= m; i += kTileM)
        panel_rows<kTileM>(buf.data(), k, rows, x + i * k, y + i * ys + r0, ys, groups);
      if (i + 2 <= m) {
        panel_rows<2>(buf.data(), k, rows, x + i * k, y + i * ys + r0, ys, groups);
        i += 2;
      }
      for (; i < m; ++i) panel_rows<1>(buf.data(), k, rows, x + i * k, y + i * ys + r0, ys, groups);
    }
  });
}

// rows ids of W, dequantized: out[t] = W[ids[t]]
template <class T>
void gather(const uint8_t* w, int64_t rb, const int64_t* ids, float* out, int64_t t, int64_t k,
            int64_t groups) {
  at::parallel_for(0, t, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t r = t0; r < t1; ++r) dequant_row<T>(w + ids[r] * rb, groups, out + r * k);
  });
}

// y [M, sum N_i] = x . [W_0; W_1; ...]^T: the parts of a fused layer (q/k/v, gate/up), each of its own
// block type, side by side in one output. At M <= kGemvMaxM one parallel region spans every part's
// tiles (one fork per layer call, the threads balanced over all of them); larger M runs part by part.
at::Tensor linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                        const std::vector<int64_t>& types, int64_t k) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == types.size(), "one block type per part");
  for (const auto& b : blocks) check_blocks(b, k);
  check_x_f32(x, k);
  const int64_t m = x.size(0), groups = k / 32, parts = static_cast<int64_t>(blocks.size());
  int64_t n_total = 0;
  for (const auto& b : blocks) n_total += b.size(0);
  at::Tensor y = at::empty({m, n_total}, x.options());
  if (m == 0 || n_total == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (m > kGemvMaxM) {
    int64_t col = 0;
    for (int64_t p = 0; p < parts; ++p) {
      const at::Tensor& b = blocks[p];
      dispatch(types[p], [&](auto t) {
        gemm<decltype(t)>(b.data_ptr<uint8_t>(), b.stride(0), xp, yp + col, n_total, m, b.size(0), k, groups);
      });
      col += b.size(0);
    }
    return y;
  }
  struct Part {
    GemvTiles fn;
    const uint8_t* w;
    int64_t rb, n, col, first_tile;
  };
  std::vector<Part> plan;
  int64_t tiles = 0, col = 0;
  const int64_t nt = gemv_rows(m);
  for (int64_t p = 0; p < parts; ++p) {
    const at::Tensor& b = blocks[p];
    GemvTiles fn = nullptr;
    dispatch(types[p], [&](auto t) { fn = gemv_fn<decltype(t)>(m); });
    plan.push_back({fn, b.data_ptr<uint8_t>(), b.stride(0), b.size(0), col, tiles});
    tiles += (b.size(0) + nt - 1) / nt;
    col += b.size(0);
  }
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (const Part& p : plan) {
      const int64_t end = p.first_tile + (p.n + nt - 1) / nt;
      const int64_t a = std::max(t0, p.first_tile), b = std::min(t1, end);
      if (a < b) p.fn(p.w, p.rb, xp, k, yp + p.col, n_total, p.n, groups, a - p.first_tile, b - p.first_tile);
    }
  });
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t k) {
  return linear_parts(x, {blocks}, {type}, k);
}

at::Tensor embedding(const at::Tensor& ids, const at::Tensor& blocks, int64_t type, int64_t k) {
  check_blocks(blocks, k);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "ids must be contiguous int64 [T]");
  const int64_t t = ids.size(0), n = blocks.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "id ", ip[r], " out of range [0, ", n, ")");
  at::Tensor out = at::empty({t, k}, blocks.options().dtype(at::kFloat));
  dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    gather<T>(blocks.data_ptr<uint8_t>(), blocks.stride(0), ip, out.data_ptr<float>(), t, k, k / 32);
  });
  return out;
}


}  // namespace lockstep
