// The GGML block formats as the kernels read them, in place from the GGUF's bytes: a float decoder per
// type (32 elements at a time into two V, with the same float32 operations, in the same order, as
// gguf.quants and lockstep/kernels/blocks.py) and an integer one (I8<T>: the quants and scales the int8
// path multiplies), and the one switch from a block type's id to its decoder.
// The types added later are in more_blocks.h (included before the switch).
#pragma once

#include <ATen/core/Tensor.h>

#include "vec.h"

namespace lockstep {

// GGML's own type ids (ggml.h, the GGUF tensor_type field): the Python side passes these. Q5_0_U8,
// Q4_K_S8 and Q6_K_U8 are ours, not GGUF types: layouts the int8 path unpacks at load (blocks.py,
// unpack_for_int8)
enum class BlockType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
  Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30, Q5_0_U8 = 106, Q4_K_S8 = 112, Q6_K_U8 = 114
};

constexpr int64_t kPrefetchBytes = 8192;  // how far ahead a streamed weight row is fetched

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
#ifdef LOCKSTEP_AVX512
// A 5-bit block's 32 codes (Q5_0, Q5_1) as two 16-lane indices (elements 0-15 and 16-31): the low
// and the high nibbles, each with its 5th bit from qh. They index the block's 32-value table.
inline void codes5(const uint8_t* nibbles, uint32_t qh, __m512i& i0, __m512i& i1) {
  const __m512i bytes = _mm512_cvtepu8_epi32(load16(nibbles)), bit4 = _mm512_set1_epi32(16);
  const __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(bytes, 4);
  i0 = _mm512_mask_or_epi32(lo, static_cast<__mmask16>(qh & 0xFFFF), lo, bit4);
  i1 = _mm512_mask_or_epi32(hi, static_cast<__mmask16>(qh >> 16), hi, bit4);
}
#endif
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
    __m512i i0, i1;
    codes5(p + 6, qh, i0, i1);
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
// Q5_0 unpacked at load for the int8 path: half d, then each element's 5-bit quant q (0..31) in a byte
// of its own, w = d * (q - 16): the same values as the Q5_0 block it came from, in 34 bytes instead of
// 22, read with one load where Q5_0 spreads its 32 fifth bits over the bytes (measured: a one-row
// 640 -> 2048 product from memory 0.77x Q5_0's time on AVX2, at the read bandwidth of two cores)
struct Q5_0_U8 : Simple {
  static constexpr int kBytes = 34;
  static void load32(const uint8_t* row, int64_t b, const Scales&, V& w0, V& w1) {
    const uint8_t* p = row + 34 * b;
    const V d = vset1(half_at(p));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    from_i8x32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), w0, w1);
    w0 = vmul(d, w0);
    w1 = vmul(d, w1);
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
  static void prepare(const uint8_t* row, int64_t sb, Scales& s) { prepare_at(row + 144 * sb, s); }
  // the scales of the super-block at p (Q5_K's start the same way)
  static void prepare_at(const uint8_t* p, Scales& s) {
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
  // group j of a super-block whose 32-byte nibble chunk j / 2 is at p
  static void load_group(const uint8_t* p, int j, const Scales& s, V& w0, V& w1) {
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
  static void load32(const uint8_t* row, int64_t b, const Scales& s, V& w0, V& w1) {
    const int j = static_cast<int>(b & 7);
    load_group(row + 144 * (b >> 3) + 16 + 32 * (j >> 1), j, s, w0, w1);
  }
};
// Q4_K with its super-block scales unpacked at load for the int8 path: float d, float dmin, the eight
// 6-bit scales and eight 6-bit mins a byte each, then Q4_K's 128 bytes of nibbles (152 bytes per 256
// elements instead of 144): the same values, without the per-block 6-bit unpacking and half
// conversions (measured: a one-row 2048 -> 640 product 0.76x Q4_K's time on AVX2)
struct Q4_K_S8 {
  static constexpr int kBytes = 19;  // 152 / 8
  static constexpr int kPer = 8;
  using Scales = Q4_K::Scales;
  static void prepare(const uint8_t* row, int64_t sb, Scales& s) {
    const uint8_t* p = row + 152 * sb;
    const float d = float_at(p), dmin = float_at(p + 4);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16))));
    _mm256_store_ps(s.a, _mm256_mul_ps(_mm256_set1_ps(d), sc));
    _mm256_store_ps(s.m, _mm256_mul_ps(_mm256_set1_ps(dmin), mn));
  }
  static void load32(const uint8_t* row, int64_t b, const Scales& s, V& w0, V& w1) {
    const int j = static_cast<int>(b & 7);
    Q4_K::load_group(row + 152 * (b >> 3) + 24 + 32 * (j >> 1), j, s, w0, w1);
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
// Q6_K unpacked at load for the int8 path: float d, the 16 int8 scales, then each element's 6-bit quant
// q (0..63) in a byte of its own, in element order (276 bytes per 256 elements instead of 210):
// w = (d * scale) * (q - 32), the same values, read with one load (measured: a one-row 2048 -> 640
// product 0.56-0.61x Q6_K's time on AVX2, one thread)
struct Q6_K_U8 {
  static constexpr int kBytes = 35;  // 276 / 8, rounded up (only used to place prefetches)
  static constexpr int kPer = 8;
  using Scales = Q6_K::Scales;
  static void prepare(const uint8_t* row, int64_t sb, Scales& s) {
    const uint8_t* p = row + 276 * sb;
    const float d = float_at(p);
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
    _mm256_store_ps(s.s, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_store_ps(s.s + 8, _mm256_mul_ps(_mm256_set1_ps(d),
                                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
  }
  static void load32(const uint8_t* row, int64_t b, const Scales& s, V& w0, V& w1) {
    const int j = static_cast<int>(b & 7);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 276 * (b >> 3) + 20 + 32 * j));
    from_i8x32(_mm256_sub_epi8(q, _mm256_set1_epi8(32)), w0, w1);
    w0 = vmul(vset1(s.s[2 * j]), w0);
    w1 = vmul(vset1(s.s[2 * j + 1]), w1);
  }
};

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
// ---------------------------------------------------------------- weights: integer quants per block
struct WMeta {
  float d, dmin;   // dmin: the types with mins (Q4_K, Q5_K, Q2_K), or Q4_1's and Q5_1's m
  int16_t s0, s1;  // Q4_K, Q5_K: scale, min; IQ4_XS: scale; Q6_K, Q3_K, Q2_K: the two 16-element scales
  int16_t m0, m1;  // Q2_K: the two 16-element mins
};

// the x-side integers a block's value needs, computed once per block of a group
struct XSums {
  IV a, b;
};

// A type's integer sums (S of them: Q::kSplit) less the x-side terms its offset adds (Q::kXTerm):
// the isum its value() takes. Exact integers, so any order of the adds gives the same ones.
template <class Q, int S>
inline void less_xterms(IV* r, const XSums& xs) {
  if constexpr (Q::kXTerm) {
    r[0] = isub(r[0], xs.a);
    if constexpr (S == 2) r[1] = isub(r[1], xs.b);
  }
}

// a weight block's scales per lane: every lane the same row's (x rows in lanes), or each its own row's
struct WScales {
  V d, dmin;
  IV s0, s1, m0, m1;
};
inline WScales bcast(const WMeta& mt) {
  return {vset1(mt.d), vset1(mt.dmin), iset1(mt.s0), iset1(mt.s1), iset1(mt.m0), iset1(mt.m1)};
}

inline void store32(uint8_t* q, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v); }

template <class T>
struct I8;

#ifdef LOCKSTEP_AVX512
constexpr bool kQ8Signed = false;
#else
constexpr bool kQ8Signed = true;
#endif

// Q8_0 / Q4_0 / Q5_0: one float scale, integer quants w - kOff
template <int kOff>
struct I8Simple {
  static constexpr bool kSplit = false;  // one integer sum per block
  static constexpr bool kIntScales = false;  // WMeta's s0, s1 unused
  static constexpr bool kMin = false;        // WMeta's dmin unused
  static constexpr bool kMins = false;       // WMeta's m0, m1 unused
  static_assert(kOff == 0 || kOff == 8 || kOff == 16 || kOff == 128, "offsets are powers of two");
  static XSums xsums(IV bs0, IV bs1) {
    if constexpr (kOff == 0) {
      return {izero(), izero()};
    } else {
      constexpr int shift = kOff == 128 ? 7 : kOff == 16 ? 4 : 3;
      return {ishl<shift>(iadd(bs0, bs1)), izero()};
    }
  }
  static constexpr bool kXTerm = kOff != 0;  // isum = r - xs.a (the offset's share)
  static V value(const IV* isum, const XSums&, V dx, const WScales& ws) { return vmul(itof(isum[0]), vmul(dx, ws.d)); }
};

// kI16Group (AVX2): how many of maddubs' int16 outputs (pairs w0 x0 + w1 x1, |x| <= 127) add up in
// int16 without overflow: 32767 / (2 * 127 * max |w|), rounded down to a divisor of 8 (4 for a Q6_K half)
template <>
struct I8<Q8_0> : I8Simple<kQ8Signed ? 0 : 128> {
  static constexpr bool kSignedW = kQ8Signed;
  static constexpr int kI16Group = 1;  // |w| <= 128
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 34 * b;
    mt = {half_at(p), 0.0f, 0, 0};
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    if (!kQ8Signed) v = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128
    return v;
  }
};

template <>
struct I8<Q4_0> : I8Simple<8> {
  static constexpr bool kSignedW = false;
  static constexpr int kI16Group = 8;  // w <= 15: 8 x 3810
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 18 * b;
    mt = {half_at(p), 0.0f, 0, 0};
    return nibbles32(p + 2);
  }
};

template <>
struct I8<Q5_0> : I8Simple<16> {
  static constexpr bool kSignedW = false;
  static constexpr int kI16Group = 4;  // w <= 31: 4 x 7874
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 22 * b;
    mt = {half_at(p), 0.0f, 0, 0};
    uint32_t qh;
    std::memcpy(&qh, p + 2, 4);
    return _mm256_or_si256(nibbles32(p + 6), bits_to_0x10(qh));
  }
};

template <>
struct I8<Q5_0_U8> : I8Simple<16> {
  static constexpr bool kSignedW = false;
  static constexpr int kI16Group = 4;  // w <= 31, as Q5_0
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 34 * b;
    mt = {half_at(p), 0.0f, 0, 0};
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
  }
};

template <>
struct I8<Q4_K> {
  static constexpr bool kSplit = false;
  static constexpr bool kIntScales = true;  // WMeta carries integer scales
  static constexpr bool kMin = true;        // and dmin
  static constexpr bool kMins = false;      // the min in s1
  static constexpr bool kSignedW = false;
  static constexpr int kI16Group = 8;  // w <= 15
  // group j's 6-bit scale and min from the super-block at p (Q5_K's are packed the same way)
  static void scale_min(const uint8_t* p, int j, WMeta& mt) {
    const uint8_t* s = p + 4;
    int16_t sc, mn;
    if (j < 4) {
      sc = s[j] & 63;
      mn = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    mt = {half_at(p), half_at(p + 2), sc, mn};
  }
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 144 * (b >> 3);
    const int j = static_cast<int>(b & 7);
    scale_min(p, j, mt);
    return nibbles(p + 16, j);
  }
  // group j's 32 quants from the nibble chunks at q (the low nibbles of chunk j / 2 for even j)
  static __m256i nibbles(const uint8_t* q, int j) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * (j >> 1)));
    return _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(4 * (j & 1))), _mm256_set1_epi8(0x0F));
  }
  static XSums xsums(IV bs0, IV bs1) { return {iadd(bs0, bs1), izero()}; }
  static constexpr bool kXTerm = false;  // the mins use xs.a apart: isum = r
  static V value(const IV* isum, const XSums& xs, V dx, const WScales& ws) {
    const V hi = vmul(itof(imul(isum[0], ws.s0)), vmul(dx, ws.d));
    const V lo = vmul(itof(imul(xs.a, ws.s1)), vmul(dx, ws.dmin));
    return vsub(hi, lo);
  }
};

template <>
struct I8<Q4_K_S8> : I8<Q4_K> {
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 152 * (b >> 3);
    const int j = static_cast<int>(b & 7);
    mt = {float_at(p), float_at(p + 4), p[8 + j], p[16 + j]};
    return I8<Q4_K>::nibbles(p + 24, j);
  }
};

template <>
struct I8<Q6_K> {
  static constexpr bool kSplit = true;  // two integer sums per block: a scale per 16 elements
  static constexpr bool kIntScales = true;  // WMeta carries integer scales
  static constexpr bool kMin = false;
  static constexpr bool kMins = false;
  static constexpr bool kSignedW = false;
  static constexpr int kI16Group = 2;  // w <= 63: 2 x 16002
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 210 * (b >> 3);
    const int j = static_cast<int>(b & 7), h = j >> 2, g = j & 3;
    mt = {half_at(p + 208), 0.0f, static_cast<int8_t>(p[192 + 2 * j]), static_cast<int8_t>(p[193 + 2 * j])};
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (g & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128((g >> 1) * 4)),
                                        _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));  // 0..63, offset 32
  }
  static XSums xsums(IV bs0, IV bs1) { return {ishl<5>(bs0), ishl<5>(bs1)}; }
  static constexpr bool kXTerm = true;  // isum[0] = r[0] - xs.a, isum[1] = r[1] - xs.b (the offset 32's share)
  static V value(const IV* isum, const XSums&, V dx, const WScales& ws) {
    return vmul(itof(iadd(imul(isum[0], ws.s0), imul(isum[1], ws.s1))), vmul(dx, ws.d));
  }
};

template <>
struct I8<Q6_K_U8> : I8<Q6_K> {
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 276 * (b >> 3);
    const int j = static_cast<int>(b & 7);
    mt = {float_at(p), 0.0f, static_cast<int8_t>(p[4 + 2 * j]), static_cast<int8_t>(p[5 + 2 * j])};
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 20 + 32 * j));  // 0..63, offset 32
  }
};


}  // namespace lockstep

// the other GGUF types (Q4_1, Q5_1, the K-quants but Q4_K and Q6_K, the IQ4 types): their decoders
#include "more_blocks.h"

namespace lockstep {

template <class F>
void dispatch(int64_t type, F&& f) {
  switch (static_cast<BlockType>(type)) {
    case BlockType::Q8_0: return f(Q8_0{});
    case BlockType::Q4_0: return f(Q4_0{});
    case BlockType::Q4_1: return f(Q4_1{});
    case BlockType::Q5_0: return f(Q5_0{});
    case BlockType::Q5_1: return f(Q5_1{});
    case BlockType::Q5_0_U8: return f(Q5_0_U8{});
    case BlockType::Q2_K: return f(Q2_K{});
    case BlockType::Q3_K: return f(Q3_K{});
    case BlockType::Q4_K: return f(Q4_K{});
    case BlockType::Q4_K_S8: return f(Q4_K_S8{});
    case BlockType::Q5_K: return f(Q5_K{});
    case BlockType::Q6_K: return f(Q6_K{});
    case BlockType::Q6_K_U8: return f(Q6_K_U8{});
    case BlockType::IQ4_NL: return f(IQ4_NL{});
    case BlockType::IQ4_XS: return f(IQ4_XS{});
    case BlockType::F16: return f(F16{});
    case BlockType::BF16: return f(BF16{});
    case BlockType::F32: return f(F32{});
  }
  TORCH_CHECK(false, "lockstep kernels: no kernel for block type id ", type);
}

// the integer block types only (the int8 path)
template <class F>
void dispatch_int8(int64_t type, F&& f) {
  switch (static_cast<BlockType>(type)) {
    case BlockType::Q8_0: return f(Q8_0{});
    case BlockType::Q4_0: return f(Q4_0{});
    case BlockType::Q4_1: return f(Q4_1{});
    case BlockType::Q5_0: return f(Q5_0{});
    case BlockType::Q5_1: return f(Q5_1{});
    case BlockType::Q5_0_U8: return f(Q5_0_U8{});
    case BlockType::Q2_K: return f(Q2_K{});
    case BlockType::Q3_K: return f(Q3_K{});
    case BlockType::Q4_K: return f(Q4_K{});
    case BlockType::Q4_K_S8: return f(Q4_K_S8{});
    case BlockType::Q5_K: return f(Q5_K{});
    case BlockType::Q6_K: return f(Q6_K{});
    case BlockType::Q6_K_U8: return f(Q6_K_U8{});
    case BlockType::IQ4_NL: return f(IQ4_NL{});
    case BlockType::IQ4_XS: return f(IQ4_XS{});
    default: break;
  }
  TORCH_CHECK(false, "lockstep kernels: no int8 kernel for block type id ", type);
}

inline void check_blocks(const at::Tensor& blocks, int64_t k) {
  // rows may be strided (a slice of whole blocks of a wider tensor), bytes within a row contiguous
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1,
              "blocks must be uint8 [N, row_bytes] with contiguous rows");
  TORCH_CHECK(blocks.device().is_cpu(), "the lockstep kernels run on CPU tensors");
  TORCH_CHECK(k > 0 && k % 32 == 0, "the kernels take rows of whole 32-element groups, got ", k);
}

inline void check_x_f32(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) == k &&
                  x.device().is_cpu(),
              "x must be contiguous float32 [M, ", k, "] on the CPU");
}

}  // namespace lockstep
