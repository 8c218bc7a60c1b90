#ifdef LOCKSTEP_AVX512  // the AVX-512 build only
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "blocks.h"
#include "ops.h"

namespace lockstep {
#include <sys/syscall.h>
#include <unistd.h>

// ---------------------------------------------------------------- opt-in AMX bfloat16 path
// y = bf16(x) . bf16(W)^T with float32 accumulation on AMX tiles. Numerics differ from the exact path
// (both operands rounded to bfloat16), so it is opt-in; it is still batch invariant: a tile computes
// each output element from its own row of x and row of W, in a fixed K order, whatever the other rows.
// W rows are the A operand (dequantized exactly, rounded to bfloat16, no transpose), x the B operand
// (packed once per call in the pair-interleaved layout AMX wants), so C tiles hold y transposed.
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {
  // Linux hands out AMX tile state only on request, once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

constexpr int64_t kAmxRows = 32;  // W rows (two A tiles) and x rows (two B tiles) per step

AMX_TARGET void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// one W row dequantized (exactly as dequant_row) and rounded to bfloat16 (nearest even, as torch rounds)
template <class T>
AMX_TARGET void dequant_row_bf16(const uint8_t* row, int64_t groups, uint16_t* out) {
  typename T::Scales scales;
  for (int64_t b = 0; b < groups; ++b) {
    if (b % T::kPer == 0) T::prepare(row, b / T::kPer, scales);
    V w0, w1;
    T::load32(row, b, scales, w0, w1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * b),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w0.v)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * b + 16),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w1.v)));
  }
}

// W rows [b0 * 32, b1 * 32) against all of x (a lambda cannot carry the AMX target attribute)
template <class T>
AMX_TARGET void amx_rows(const uint8_t* w, int64_t rb, const uint32_t* xp, int64_t mp, float* y, int64_t m,
                         int64_t n, int64_t k, int64_t groups, int64_t b0, int64_t b1) {
  {
    amx_configure();  // tile configuration is per thread
    std::vector<uint16_t> a(static_cast<size_t>(kAmxRows * k));
    alignas(64) float c[4][16][16];
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t n0 = nb * kAmxRows, rows = std::min(kAmxRows, n - n0);
      for (int64_t r = 0; r < kAmxRows; ++r) {
        if (r < rows) {
          dequant_row_bf16<T>(w + (n0 + r) * rb, groups, a.data() + r * k);
        } else {
          std::fill(a.begin() + r * k, a.begin() + (r + 1) * k, 0);
        }
      }
      for (int64_t m0 = 0; m0 < mp; m0 += kAmxRows) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < k / 32; ++t) {
          _tile_loadd(4, a.data() + t * 32, k * 2);
          _tile_loadd(5, a.data() + 16 * k + t * 32, k * 2);
          _tile_loadd(6, xp + t * 16 * mp + m0, mp * 4);
          _tile_loadd(7, xp + t * 16 * mp + m0 + 16, mp * 4);
          _tile_dpbf16ps(0, 4, 6);  // W rows 0-15 x x rows 0-15
          _tile_dpbf16ps(1, 4, 7);  // W rows 0-15 x x rows 16-31
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        for (int q = 0; q < 4; ++q) {  // c[q][W row][x row] -> y[x row][W row], contiguous writes
          const int64_t wn = n0 + (q >> 1) * 16, xm = m0 + (q & 1) * 16, cols = std::min<int64_t>(16, n - wn);
          for (int64_t j = 0; j < 16 && xm + j < m; ++j) {
            float* dst = y + (xm + j) * n + wn;
            for (int64_t i = 0; i < cols; ++i) dst[i] = c[q][i][j];
          }
        }
      }
    }
    _tile_release();
  }
}

template <class T>
void amx_gemm(const uint8_t* w, int64_t rb, const uint32_t* xp, int64_t mp, float* y, int64_t m, int64_t n,
              int64_t k, int64_t groups) {
  at::parallel_for(0, (n + kAmxRows - 1) / kAmxRows, 1, [&](int64_t b0, int64_t b1) {
    amx_rows<T>(w, rb, xp, mp, y, m, n, k, groups, b0, b1);
  });
}

at::Tensor linear_amx_bf16(const at::Tensor& xb, const at::Tensor& blocks, int64_t type, int64_t k) {
  check_blocks(blocks, k);
  TORCH_CHECK(xb.scalar_type() == at::kBFloat16 && xb.dim() == 2 && xb.is_contiguous() && xb.size(1) == k,
              "x must be contiguous bfloat16 [M, ", k, "]");
  TORCH_CHECK(amx_permitted(), "the kernel was refused AMX tile state (arch_prctl)");
  const int64_t m = xb.size(0), n = blocks.size(0), mp = (m + kAmxRows - 1) / kAmxRows * kAmxRows;
  at::Tensor y = at::empty({m, n}, xb.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return y;
  // x as B: word [kk][row] = the bfloat16 pair (x[row][2kk], x[row][2kk + 1]); padded rows are zero
  std::vector<uint32_t> xp(static_cast<size_t>(k / 2 * mp), 0);
  const auto* xw = reinterpret_cast<const uint32_t*>(xb.data_ptr<at::BFloat16>());
  // 16 rows at a time: their cache lines stay in L1 while the writes go out 64 contiguous bytes at a time
  for (int64_t r0 = 0; r0 < m; r0 += 16) {
    const int64_t r1 = std::min<int64_t>(m, r0 + 16);
    for (int64_t kk = 0; kk < k / 2; ++kk)
      for (int64_t r = r0; r < r1; ++r) xp[kk * mp + r] = xw[r * (k / 2) + kk];
  }
  dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    amx_gemm<T>(blocks.data_ptr<uint8_t>(), blocks.stride(0), xp.data(), mp, y.data_ptr<float>(), m, n, k,
                k / 32);
  });
  return y;
}

}  // namespace lockstep
#endif
