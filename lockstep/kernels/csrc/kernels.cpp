// Weight-only kernels on GGML blocks: y[M, N] = x[M, K] . W^T, W dequantized in registers.
//
// One source, compiled twice: with LOCKSTEP_AVX512 (AVX-512 F/BW/VL/DQ) and without (AVX2 + FMA + F16C).
// Determinism contract: every output element is accumulated the same way whatever M, the tile it lands in,
// the thread that computes it and the variant: element k of the dot product goes to lane k % 32 of a
// 32-lane float32 accumulator (fma, in increasing k), then the lanes are summed by a fixed tree
// (i + i+16, i + i+8, i + i+4, i + i+2, i + i+1). The weights are dequantized with the same float32
// operations, in the same order, as gguf.quants (and lockstep/kernels/blocks.py); build with
// -ffp-contract=off so the compiler fuses nothing we did not ask for.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// ---------------------------------------------------------------- 16 float lanes, per ISA
#ifdef LOCKSTEP_AVX512
struct V {
  __m512 v;
};
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset1(float a) { return {_mm512_set1_ps(a)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vsub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// 16 signed bytes -> 16 floats
inline V from_i8(__m128i q) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))}; }
inline V from_f16(const uint8_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline V from_bf16(const uint8_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
// lanes i + i+8 -> 8 lanes
inline __m256 fold8(V a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
}
#else
struct V {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V vfma(V a, V b, V c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V from_i8(__m128i q) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
}
inline V from_f16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline __m256 bf16x8(const uint8_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline V from_bf16(const uint8_t* p) { return {bf16x8(p), bf16x8(p + 16)}; }
inline __m256 fold8(V a) { return _mm256_add_ps(a.lo, a.hi); }
#endif

// The fixed lane tree over one 32-lane accumulator (a0 = lanes 0-15, a1 = lanes 16-31).
inline float reduce32(V a0, V a1) {
  __m256 h = fold8(vadd(a0, a1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i lo_nibbles(__m128i b) { return _mm_and_si128(b, _mm_set1_epi8(0x0F)); }
inline __m128i hi_nibbles(__m128i b) { return _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F)); }

// 32 bits (bit i = element i) -> 32 bytes, 0x10 where the bit is set
#ifdef LOCKSTEP_AVX512
inline __m256i bits_to_0x10(uint32_t bits) {
  return _mm256_maskz_mov_epi8(static_cast<__mmask32>(bits), _mm256_set1_epi8(0x10));
}
#else
inline __m256i bits_to_0x10(uint32_t bits) {
  // byte i of the result looks at byte i / 8 of `bits`, then at its bit i % 8
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread);
  v = _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}
#endif

// 16 bytes -> 32 nibbles: the low nibbles (elements 0-15), then the high ones (16-31)
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i b = load16(p);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

// ---------------------------------------------------------------- block decoders
// Each decodes the b-th group of 32 elements of a row into w0 (elements 0-15) and w1 (16-31).
// K-quants keep per-super-block scales: prepare() computes them once per 256 elements (kPer groups)
// into Scales, which load32 then reads; the simple types have nothing to prepare.
struct NoScales {};
struct Simple {
  static constexpr int kPer = 1;
  using Scales = NoScales;
  static void prepare(const uint8_t*, int64_t, Scales&) {}
};

// 32 signed bytes -> 32 floats
inline void from_i8x32(__m256i q, V& w0, V& w1) {
  w0 = from_i8(_mm256_castsi256_si128(q));
  w1 = from_i8(_mm256_extracti128_si256(q, 1));
}
struct F32 : Simple {
  static constexpr int kBytes = 128;  // per 32 elements
  static void load32(const uint8_t* row, int64_t b, const Scales&, V& w0, V& w1) {
    const float* p = reinterpret_cast<const float*>(row) + 32 * b;
    w0 = vload(p);
    w1 = vload(p + 16);
  }
};
struct F16 : Simple {
  static constexpr int kBytes = 64;
  static void load32(const uint8_t* row, int64_t b, const Scales&, V& w0, V& w1) {
    w0 = from_f16(row + 64 * b);
    w1 = from_f16(row + 64 * b + 32);
  }
};
struct BF16 : Simple {
  static constexpr int kBytes = 64;
  static void load32(const uint8_t* row, int64_t b, const Scales&, V& w0, V& w1) {
    w0 = from_bf16(row + 64 * b);
    w1 = from_bf16(row + 64 * b + 32);
  }
};
struct Q8_0 : Simple {  // half d, int8 q[32]: w = q * d
  static constexpr int kBytes = 34;
  static void load32(const uint8_t* row, int64_t b, const Scales&, V& w0, V& w1) {
    const uint8_t* p = row + 34 * b;
    V d = vset1(half_at(p));
    w0 = vmul(from_i8(load16(p + 2)), d);
    w1 = vmul(from_i8(load16(p + 18)), d);
  }
};
struct Q4_0 : Simple {  // half d, 16 bytes: low nibbles are elements 0-15, high 16-31; w = d * (q - 8)
  static constexpr int kBytes = 18;
  static void load32(const uint8_t* row, int64_t b, const Scales&, V& w0, V& w1) {
    const uint8_t* p = row + 18 * b;
    const V d = vset1(half_at(p));
    const __m128i qs = load16(p + 2), eight = _mm_set1_epi8(8);
    // 16-byte halves here: measured faster for Q4_0 than one 32-byte vector and an extract
    w0 = vmul(d, from_i8(_mm_sub_epi8(lo_nibbles(qs), eight)));
    w1 = vmul(d, from_i8(_mm_sub_epi8(hi_nibbles(qs), eight)));
  }
};
struct Q5_0 : Simple {  // half d, uint32 qh (bit i = 5th bit of element i), 16 bytes of nibbles
  static constexpr int kBytes = 22;
  static void load32(const uint8_t* row, int64_t b, const Scales&, V& w0, V& w1) {
    const uint8_t* p = row + 22 * b;
    uint32_t qh;
    std::memcpy(&qh, p + 2, 4);
#ifdef LOCKSTEP_AVX512
    // A table of the 32 values this block can take, (i - 16) * d: exact products (5 x 11 bits), so
    // the same bits as converting each quant and scaling it, in fewer instructions: each 5-bit
    // code indexes the table (a two-register permute) instead of a convert and a multiply.
    const __m512 d = _mm512_set1_ps(half_at(p));
    const __m512 neg = _mm512_mul_ps(d, _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5,
                                                       -4, -3, -2, -1));
    const __m512 pos = _mm512_mul_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i bytes = _mm512_cvtepu8_epi32(load16(p + 6)), bit4 = _mm512_set1_epi32(16);
    __m512i i0 = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F));
    __m512i i1 = _mm512_srli_epi32(bytes, 4);
    i0 = _mm512_mask_or_epi32(i0, static_cast<__mmask16>(qh & 0xFFFF), i0, bit4);
    i1 = _mm512_mask_or_epi32(i1, static_cast<__mmask16>(qh >> 16), i1, bit4);
    w0 = {_mm512_permutex2var_ps(neg, i0, pos)};
    w1 = {_mm512_permutex2var_ps(neg, i1, pos)};
#else
    const V d = vset1(half_at(p));
    const __m256i q = _mm256_or_si256(nibbles32(p + 6), bits_to_0x10(qh));
    from_i8x32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), w0, w1);
    w0 = vmul(d, w0);
    w1 = vmul(d, w1);
#endif
  }
};
// Q4_K super-block of 256: half d, half dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
// (32-byte chunk c: low nibbles = group 2c, high = group 2c+1); w = (d * sc) * q - (dmin * m)
struct Q4_K {
  static constexpr int kBytes = 18;  // 144 / 8
  static constexpr int kPer = 8;
  struct Scales {
    alignas(32) float a[8];  // d * sc per group
    alignas(32) float m[8];  // dmin * m per group
  };
  static void prepare(const uint8_t* row, int64_t sb, Scales& s) {
    const uint8_t* p = row + 144 * sb;
    uint32_t A, B, C;  // bytes 0-3: sc low 6 bits (+ top 2 of sc 4-7), 4-7: the same for mins, 8-11: low nibbles
    std::memcpy(&A, p + 4, 4);
    std::memcpy(&B, p + 8, 4);
    std::memcpy(&C, p + 12, 4);
    const uint32_t sc_lo = A & 0x3F3F3F3F, mn_lo = B & 0x3F3F3F3F;
    const uint32_t sc_hi = (C & 0x0F0F0F0F) | ((A >> 2) & 0x30303030);
    const uint32_t mn_hi = ((C >> 4) & 0x0F0F0F0F) | ((B >> 2) & 0x30303030);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, sc_hi, sc_lo)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, mn_hi, mn_lo)));
    _mm256_store_ps(s.a, _mm256_mul_ps(_mm256_set1_ps(half_at(p)), sc));
    _mm256_store_ps(s.m, _mm256_mul_ps(_mm256_set1_ps(half_at(p + 2)), mn));
  }
  static void load32(const uint8_t* row, int64_t b, const Scales& s, V& w0, V& w1) {
    const int j = static_cast<int>(b & 7);
    const uint8_t* p = row + 144 * (b >> 3) + 16 + 32 * (j >> 1);
#ifdef LOCKSTEP_AVX512
    // The 16 values this group can take, a * i - m (the same two roundings as per element), looked
    // up by each 4-bit code (one permute) instead of converting, scaling and offsetting each quant.
    const __m512 tab = _mm512_sub_ps(
        _mm512_mul_ps(_mm512_set1_ps(s.a[j]), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
        _mm512_set1_ps(s.m[j]));
    const __m128i shift = _mm_cvtsi32_si128(4 * (j & 1));
    const __m512i lo = _mm512_srl_epi32(_mm512_cvtepu8_epi32(load16(p)), shift);
    const __m512i hi = _mm512_srl_epi32(_mm512_cvtepu8_epi32(load16(p + 16)), shift);
    w0 = {_mm512_permutexvar_ps(lo, tab)};  // uses the index's low 4 bits: the code
    w1 = {_mm512_permutexvar_ps(hi, tab)};
#else
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i q = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(4 * (j & 1))),
                                       _mm256_set1_epi8(0x0F));
    const V a = vset1(s.a[j]), m = vset1(s.m[j]);
    from_i8x32(q, w0, w1);
    w0 = vsub(vmul(a, w0), m);
    w1 = vsub(vmul(a, w1), m);
#endif
  }
};
// Q6_K super-block of 256: ql[128], qh[64], int8 scales[16] (one per 16 elements), half d at the end.
// Group j = 4h + g: low 4 bits from ql[64h + 32(g&1) + l] (low nibble for g<2, high for g>=2),
// top 2 bits from qh[32h + l] >> 2g; w = (d * scale) * (q - 32)
struct Q6_K {
  static constexpr int kBytes = 27;  // 210 / 8, rounded up (only used to place prefetches)
  static constexpr int kPer = 8;
  struct Scales {
    alignas(64) float s[16];  // d * scale per 16 elements
  };
  static void prepare(const uint8_t* row, int64_t sb, Scales& s) {
    const uint8_t* p = row + 210 * sb;
    const __m256 d = _mm256_set1_ps(half_at(p + 208));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
    _mm256_store_ps(s.s, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_store_ps(s.s + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
  }
  static void load32(const uint8_t* row, int64_t b, const Scales& s, V& w0, V& w1) {
    const uint8_t* p = row + 210 * (b >> 3);
    const int j = static_cast<int>(b & 7), h = j >> 2, g = j & 3;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (g & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128((g >> 1) * 4)),
                                        _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    from_i8x32(q, w0, w1);
    w0 = vmul(vset1(s.s[2 * j]), w0);
    w1 = vmul(vset1(s.s[2 * j + 1]), w1);
  }
};

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
constexpr int64_t kPrefetchBytes = 8192;
// Unrolled before GCC's scalar replacement runs, so the accumulator arrays live in registers
// (left as loops, every accumulator is stored to the stack on every iteration).
#define UNROLL _Pragma("GCC unroll 8")

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

template <class T>
void dequant_row(const uint8_t* row, int64_t groups, float* out) {
  typename T::Scales scales;
  for (int64_t b = 0; b < groups; ++b) {
    if (b % T::kPer == 0) T::prepare(row, b / T::kPer, scales);
    V w0, w1;
    T::load32(row, b, scales, w0, w1);
    vstore(out + 32 * b, w0);
    vstore(out + 32 * b + 16, w1);
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

template <class F>
void dispatch(const std::string& qtype, F&& f) {
  if (qtype == "Q8_0") return f(Q8_0{});
  if (qtype == "Q4_0") return f(Q4_0{});
  if (qtype == "Q5_0") return f(Q5_0{});
  if (qtype == "Q4_K") return f(Q4_K{});
  if (qtype == "Q6_K") return f(Q6_K{});
  if (qtype == "F16") return f(F16{});
  if (qtype == "BF16") return f(BF16{});
  if (qtype == "F32") return f(F32{});
  TORCH_CHECK(false, "lockstep kernels: no kernel for block type ", qtype);
}

void check_blocks(const at::Tensor& blocks, int64_t k) {
  // rows may be strided (a slice of whole blocks of a wider tensor), bytes within a row contiguous
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1,
              "blocks must be uint8 [N, row_bytes] with contiguous rows");
  TORCH_CHECK(blocks.device().is_cpu(), "the lockstep kernels run on CPU tensors");
  TORCH_CHECK(k > 0 && k % 32 == 0, "the kernels take rows of whole 32-element groups, got ", k);
}

void check_x_f32(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) == k &&
                  x.device().is_cpu(),
              "x must be contiguous float32 [M, ", k, "] on the CPU");
}

// y [M, sum N_i] = x . [W_0; W_1; ...]^T: the parts of a fused layer (q/k/v, gate/up), each of its own
// block type, side by side in one output. At M <= kGemvMaxM one parallel region spans every part's
// tiles (one fork per layer call, the threads balanced over all of them); larger M runs part by part.
at::Tensor linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                        const std::vector<std::string>& qtypes, int64_t k) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == qtypes.size(), "one block type per part");
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
      dispatch(qtypes[p], [&](auto t) {
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
    dispatch(qtypes[p], [&](auto t) { fn = gemv_fn<decltype(t)>(m); });
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

at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, const std::string& qtype, int64_t k) {
  return linear_parts(x, {blocks}, {qtype}, k);
}

at::Tensor embedding(const at::Tensor& ids, const at::Tensor& blocks, const std::string& qtype, int64_t k) {
  check_blocks(blocks, k);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "ids must be contiguous int64 [T]");
  const int64_t t = ids.size(0), n = blocks.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "id ", ip[r], " out of range [0, ", n, ")");
  at::Tensor out = at::empty({t, k}, blocks.options().dtype(at::kFloat));
  dispatch(qtype, [&](auto tag) {
    using T = decltype(tag);
    gather<T>(blocks.data_ptr<uint8_t>(), blocks.stride(0), ip, out.data_ptr<float>(), t, k, k / 32);
  });
  return out;
}



#include "int8.h"  // the opt-in int8 activation path, inside this namespace: it reuses the decoders' helpers
#include "argmax.h"  // greedy sampling's row argmax
#include "attention.h"  // decode attention over the paged KV pool
#include "fused.h"  // norms, rotary, gated activations: row-wise float32 ops of a layer

#ifdef LOCKSTEP_AVX512
#include "amx_bf16.h"  // the opt-in AMX bfloat16 path, inside this namespace: it reuses the decoders
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("linear", &linear, pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("linear_parts", &linear_parts, pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("embedding", &embedding, pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("linear_int8", &linear_int8, pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("quantize_int8", &quantize_int8, pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("decode_attention", &decode_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("argmax_rows", &argmax_rows, pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("rms_norm", &rms_norm, pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("add_rms_norm", &add_rms_norm, pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("qk_norm_rope", &qk_norm_rope, pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("act_and_mul", &act_and_mul, pybind11::call_guard<pybind11::gil_scoped_release>());
#ifdef LOCKSTEP_AVX512
  mod.def("linear_amx_bf16", &linear_amx_bf16, pybind11::call_guard<pybind11::gil_scoped_release>());
#endif
}
