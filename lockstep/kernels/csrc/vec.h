// The vector abstraction every kernel is written in: 16 float32 lanes (V) and 16 int32 lanes (IV), one
// AVX-512 register or two AVX2 ones, with the same operations in both builds (compiled once with
// LOCKSTEP_AVX512 and once without), plus the byte helpers the block decoders share.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// Unrolled before GCC's scalar replacement runs, so the accumulator arrays live in registers
// (left as loops, every accumulator is stored to the stack on every iteration).
#define UNROLL _Pragma("GCC unroll 8")

#ifdef LOCKSTEP_AVX512
#define I8_TARGET __attribute__((target("avx512vnni")))
#else
#define I8_TARGET
#endif

namespace lockstep {

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
inline float float_at(const uint8_t* p) {  // an unaligned little-endian float32 (our unpacked layouts)
  float f;
  std::memcpy(&f, p, 4);
  return f;
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

// ---------------------------------------------------------------- 16 int32 lanes, per ISA
// int16 pair sums -> int32 sums of adjacent pairs (one madd; an AVX2 op, in both builds)
inline __m256i widen16(__m256i p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
#ifdef LOCKSTEP_AVX512
struct IV {
  __m512i v;
};
inline IV iload(const void* p) { return {_mm512_loadu_si512(p)}; }
inline IV izero() { return {_mm512_setzero_si512()}; }
inline IV iadd(IV a, IV b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline IV isub(IV a, IV b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline IV iset1(int32_t s) { return {_mm512_set1_epi32(s)}; }
inline IV imul(IV a, IV b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
template <int S>
inline IV ishl(IV a) { return {_mm512_slli_epi32(a.v, S)}; }
inline V itof(IV a) { return {_mm512_cvtepi32_ps(a.v)}; }
// r += w . x per lane: w 16 lanes of 4 unsigned bytes, x 16 lanes of 4 signed bytes (either broadcast)
template <bool kSignedW>
I8_TARGET inline void dot4(IV& r, IV w, IV x) {
  static_assert(!kSignedW, "the VNNI path takes unsigned weights");
  r.v = _mm512_dpbusd_epi32(r.v, w.v, x.v);
}
#else
struct IV {
  __m256i lo, hi;
};
inline IV iload(const void* p) {
  const auto* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline IV izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline IV iadd(IV a, IV b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline IV isub(IV a, IV b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline IV iset1(int32_t s) { return {_mm256_set1_epi32(s), _mm256_set1_epi32(s)}; }
inline IV imul(IV a, IV b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
template <int S>
inline IV ishl(IV a) { return {_mm256_slli_epi32(a.lo, S), _mm256_slli_epi32(a.hi, S)}; }
inline V itof(IV a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
// w0 x0 + w1 x1 per int16 lane (maddubs: u8 x s8, saturating): exact for weights up to 63 (63 * 127 * 2
// < 32767); a signed weight (Q8_0) goes in as |w| against x with w's sign, at most 128 * 127 * 2
template <bool kSignedW>
inline __m256i pairs16(__m256i w, __m256i x) {
  if constexpr (kSignedW) return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return _mm256_maddubs_epi16(w, x);
}
template <bool kSignedW>
inline void dot4(IV& r, IV w, IV x) {
  r.lo = _mm256_add_epi32(r.lo, widen16(pairs16<kSignedW>(w.lo, x.lo)));
  r.hi = _mm256_add_epi32(r.hi, widen16(pairs16<kSignedW>(w.hi, x.hi)));
}
#endif

// ---------------------------------------------------------------- vector helpers not in V
#ifdef LOCKSTEP_AVX512
inline V vdiv(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V vmin(V a, V b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V vmax(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
// round to nearest even, then 2^n for integral n in [-126, 127]
inline V vround(V a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V vpow2i(V n) {
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
#else
inline V vdiv(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V vmin(V a, V b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V vround(V a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline __m256 pow2i8(__m256 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline V vpow2i(V n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }
#endif

// exp(a) within 2 ulp for a in [-87, 88] (Cephes' expf: n = round(a / ln 2), a polynomial on the
// remainder, times 2^n); clamped outside, which only matters where the activations saturate anyway.
inline V vexp(V a) {
  a = vmin(vmax(a, vset1(-87.0f)), vset1(88.0f));
  const V n = vround(vmul(a, vset1(1.44269504088896341f)));
  V r = vsub(a, vmul(n, vset1(0.693359375f)));
  r = vsub(r, vmul(n, vset1(-2.12194440e-4f)));
  V p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vadd(vfma(p, vmul(r, r), r), vset1(1.0f));
  return vmul(p, vpow2i(n));
}

inline float exp_scalar(float a) {  // the same steps on one element (row tails)
  a = std::min(std::max(a, -87.0f), 88.0f);
  const float n = std::nearbyint(a * 1.44269504088896341f);
  float r = a - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = std::fma(p, r, c);
  p = std::fma(p, r * r, r) + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

}  // namespace lockstep
