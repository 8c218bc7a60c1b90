// The GGUF block types added after the first ones (Q4_1, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS): their
// float decoders (exact path) and integer ones (I8<T>, int8 path), in the conventions blocks.h sets
// out for the first ones. Included by blocks.h (only), after those, before its one switch over the type ids.
#pragma once

namespace lockstep {

// ---------------------------------------------------------------- the other GGUF types
// Each gives gguf.quants' float32 values: its operations in its order (per element, or in a table of the
// values a code can take, built with the same operations, so the same bits).
#ifdef LOCKSTEP_AVX512
inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
#endif
// IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl), as signed bytes
inline __m128i iq4_levels() {
  return _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
}
// 16 nibble codes at p (low nibbles: elements 0-15, high: 16-31) -> the 32 weights scale * level[code]
inline void iq4_load32(const uint8_t* p, float scale, V& w0, V& w1) {
#ifdef LOCKSTEP_AVX512
  const __m512 tab = _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(iq4_levels())));
  const __m512i codes = _mm512_cvtepu8_epi32(load16(p));
  w0 = {_mm512_permutexvar_ps(codes, tab)};  // uses the index's low 4 bits: the low nibble
  w1 = {_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), tab)};
#else
  const __m256i q = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(iq4_levels()), nibbles32(p));
  from_i8x32(q, w0, w1);
  w0 = vmul(vset1(scale), w0);
  w1 = vmul(vset1(scale), w1);
#endif
}

// Q4_1: half d, half m, 16 bytes of nibbles (low: elements 0-15, high: 16-31); w = d * q + m
struct Q4_1 : Simple {
  static constexpr int kBytes = 20;
  static void load32(const uint8_t* row, int64_t b, const Scales&, V& w0, V& w1) {
    const uint8_t* p = row + 20 * b;
#ifdef LOCKSTEP_AVX512
    // the 16 values a code can take, d * i + m, looked up (as Q4_K's groups are)
    const __m512 tab = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(half_at(p)), iota16()), _mm512_set1_ps(half_at(p + 2)));
    const __m512i codes = _mm512_cvtepu8_epi32(load16(p + 4));
    w0 = {_mm512_permutexvar_ps(codes, tab)};
    w1 = {_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), tab)};
#else
    const V d = vset1(half_at(p)), m = vset1(half_at(p + 2));
    const __m128i qs = load16(p + 4);
    w0 = vadd(vmul(d, from_i8(lo_nibbles(qs))), m);
    w1 = vadd(vmul(d, from_i8(hi_nibbles(qs))), m);
#endif
  }
};
// Q5_1: half d, half m, uint32 qh (bit i = 5th bit of element i), 16 bytes of nibbles; w = d * q + m
struct Q5_1 : Simple {
  static constexpr int kBytes = 24;
  static void load32(const uint8_t* row, int64_t b, const Scales&, V& w0, V& w1) {
    const uint8_t* p = row + 24 * b;
    uint32_t qh;
    std::memcpy(&qh, p + 4, 4);
#ifdef LOCKSTEP_AVX512
    // the 32 values a code can take in two tables (codes 0-15, 16-31), as Q5_0
    const __m512 d = _mm512_set1_ps(half_at(p)), m = _mm512_set1_ps(half_at(p + 2));
    const __m512 lo_tab = _mm512_add_ps(_mm512_mul_ps(d, iota16()), m);
    const __m512 hi_tab = _mm512_add_ps(_mm512_mul_ps(d, _mm512_add_ps(iota16(), _mm512_set1_ps(16))), m);
    __m512i i0, i1;
    codes5(p + 8, qh, i0, i1);
    w0 = {_mm512_permutex2var_ps(lo_tab, i0, hi_tab)};
    w1 = {_mm512_permutex2var_ps(lo_tab, i1, hi_tab)};
#else
    const V d = vset1(half_at(p)), m = vset1(half_at(p + 2));
    from_i8x32(_mm256_or_si256(nibbles32(p + 8), bits_to_0x10(qh)), w0, w1);
    w0 = vadd(vmul(d, w0), m);
    w1 = vadd(vmul(d, w1), m);
#endif
  }
};
// IQ4_NL: half d, 16 bytes of 4-bit codes (Q4_0's order); w = d * level[code]
struct IQ4_NL : Simple {
  static constexpr int kBytes = 18;
  static void load32(const uint8_t* row, int64_t b, const Scales&, V& w0, V& w1) {
    const uint8_t* p = row + 18 * b;
    iq4_load32(p + 2, half_at(p), w0, w1);
  }
};
// Q5_K super-block of 256: Q4_K's d, dmin and 12 bytes of scales and mins, then qh[32] (element 32j + l's
// fifth bit: bit j of qh[l]), then Q4_K's 128 bytes of nibbles; w = (d * sc) * q - (dmin * m)
struct Q5_K {
  static constexpr int kBytes = 22;  // 176 / 8
  static constexpr int kPer = 8;
  using Scales = Q4_K::Scales;
  static void prepare(const uint8_t* row, int64_t sb, Scales& s) { Q4_K::prepare_at(row + 176 * sb, s); }
  // group j's 32 quants (0..31) of the super-block at p
  static __m256i quants(const uint8_t* p, int j) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 48 + 32 * (j >> 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(4 * (j & 1))), _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));  // hi is 0 or 1: the shift stays in its byte
  }
  static void load32(const uint8_t* row, int64_t b, const Scales& s, V& w0, V& w1) {
    const int j = static_cast<int>(b & 7);
    from_i8x32(quants(row + 176 * (b >> 3), j), w0, w1);
    const V a = vset1(s.a[j]), m = vset1(s.m[j]);
    w0 = vsub(vmul(a, w0), m);
    w1 = vsub(vmul(a, w1), m);
  }
};
// Q2_K super-block of 256: scales[16] (low nibble: a 16-element sub-block's scale, high: its min), qs[64]
// (2-bit quants: 32-byte chunk c, shift 2i holds group 4c + i), half d, half dmin;
// w = (d * sc) * q - (dmin * m)
struct Q2_K {
  static constexpr int kBytes = 11;  // 84 / 8, rounded up (only used to place prefetches)
  static constexpr int kPer = 8;
  struct Scales {
    alignas(64) float a[16];  // d * sc per 16 elements
    alignas(64) float m[16];  // dmin * m per 16 elements
  };
  static void prepare(const uint8_t* row, int64_t sb, Scales& s) {
    const uint8_t* p = row + 84 * sb;
    const __m128i sc = load16(p);
    const __m128i lo = lo_nibbles(sc), hi = hi_nibbles(sc);
    const __m256 d = _mm256_set1_ps(half_at(p + 80)), dmin = _mm256_set1_ps(half_at(p + 82));
    _mm256_store_ps(s.a, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo))));
    _mm256_store_ps(s.a + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)))));
    _mm256_store_ps(s.m, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))));
    _mm256_store_ps(s.m + 8, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))));
  }
  static __m256i quants(const uint8_t* p, int j) {  // group j's 32 quants (0..3) of the super-block at p
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * (j >> 2)));
    return _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * (j & 3))), _mm256_set1_epi8(3));
  }
  static void load32(const uint8_t* row, int64_t b, const Scales& s, V& w0, V& w1) {
    const int j = static_cast<int>(b & 7);
    from_i8x32(quants(row + 84 * (b >> 3), j), w0, w1);
    w0 = vsub(vmul(vset1(s.a[2 * j]), w0), vset1(s.m[2 * j]));
    w1 = vsub(vmul(vset1(s.a[2 * j + 1]), w1), vset1(s.m[2 * j + 1]));
  }
};
// Q3_K super-block of 256: hmask[32] (element 32j + l: bit j of hmask[l]), qs[64] (2-bit, as Q2_K's),
// 12 bytes of sixteen 6-bit scales, half d; q = low 2 bits + 4 * hmask bit - 4, w = (d * (scale - 32)) * q
struct Q3_K {
  static constexpr int kBytes = 14;  // 110 / 8, rounded up (only used to place prefetches)
  static constexpr int kPer = 8;
  using Scales = Q6_K::Scales;
  // the sixteen 6-bit scales (offset 32) of the 12 bytes at p: the low 4 bits are the nibbles of bytes
  // 0-7 (scales 0-7 the low ones), the top 2 of scale i are bits 2 (i / 4) of byte 8 + i % 4
  static __m128i scales(const uint8_t* p) {
    uint64_t lo;
    uint32_t hi;
    std::memcpy(&lo, p, 8);
    std::memcpy(&hi, p + 8, 4);
    constexpr uint64_t kNib = 0x0F0F0F0F0F0F0F0FULL;
    constexpr uint32_t kTwo = 0x03030303u;
    const uint64_t top0 = (hi & kTwo) | (static_cast<uint64_t>((hi >> 2) & kTwo) << 32);
    const uint64_t top1 = ((hi >> 4) & kTwo) | (static_cast<uint64_t>((hi >> 6) & kTwo) << 32);
    return _mm_set_epi64x(static_cast<int64_t>(((lo >> 4) & kNib) | (top1 << 4)),
                          static_cast<int64_t>((lo & kNib) | (top0 << 4)));
  }
  static void prepare(const uint8_t* row, int64_t sb, Scales& s) {
    const uint8_t* p = row + 110 * sb;
    const __m128i sc = _mm_sub_epi8(scales(p + 96), _mm_set1_epi8(32));
    const __m256 d = _mm256_set1_ps(half_at(p + 108));
    _mm256_store_ps(s.s, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_store_ps(s.s + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
  }
  static __m256i quants(const uint8_t* p, int j) {  // group j's 32 quants, 0..7 (offset 4)
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 + 32 * (j >> 2)));
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * (j & 3))), _mm256_set1_epi8(3));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 2));
  }
  static void load32(const uint8_t* row, int64_t b, const Scales& s, V& w0, V& w1) {
    const int j = static_cast<int>(b & 7);
    from_i8x32(_mm256_sub_epi8(quants(row + 110 * (b >> 3), j), _mm256_set1_epi8(4)), w0, w1);
    w0 = vmul(vset1(s.s[2 * j]), w0);
    w1 = vmul(vset1(s.s[2 * j + 1]), w1);
  }
};
// IQ4_XS super-block of 256: half d, uint16 scales_h (2 bits per group of 32), scales_l[4] (a nibble per
// group), then 8 x 16 bytes of IQ4_NL codes; w = (d * (scale - 32)) * level[code]
struct IQ4_XS {
  static constexpr int kBytes = 17;  // 136 / 8
  static constexpr int kPer = 8;
  struct Scales {
    alignas(32) float s[8];  // d * (scale - 32) per group of 32
  };
  static int scale(const uint8_t* p, int j) {  // group j's 6-bit scale, offset 32 removed
    const int hi = (p[2 + (j >> 2)] >> (2 * (j & 3))) & 3;
    return (((p[4 + (j >> 1)] >> (4 * (j & 1))) & 0x0F) | (hi << 4)) - 32;
  }
  static void prepare(const uint8_t* row, int64_t sb, Scales& s) {
    const uint8_t* p = row + 136 * sb;
    const float d = half_at(p);
    for (int j = 0; j < 8; ++j) s.s[j] = d * static_cast<float>(scale(p, j));
  }
  static void load32(const uint8_t* row, int64_t b, const Scales& s, V& w0, V& w1) {
    const int j = static_cast<int>(b & 7);
    iq4_load32(row + 136 * (b >> 3) + 8 + 16 * j, s.s[j], w0, w1);
  }
};

// ---------------------------------------------------------------- their integer quants (int8 path)
// Q4_1 / Q5_1: unsigned quants, one float scale d and a float offset m (WMeta's dmin):
// value = float(isum) * (dx * d) + float(sum x) * (dx * m)
template <int kGroup>
struct I8Offset {
  static constexpr bool kSplit = false;
  static constexpr bool kIntScales = false;
  static constexpr bool kMin = true;  // m
  static constexpr bool kMins = false;
  static constexpr bool kSignedW = false;
  static constexpr int kI16Group = kGroup;
  static XSums xsums(IV bs0, IV bs1) { return {iadd(bs0, bs1), izero()}; }
  static constexpr bool kXTerm = false;  // the offset uses xs.a apart: isum = r
  static V value(const IV* isum, const XSums& xs, V dx, const WScales& ws) {
    return vadd(vmul(itof(isum[0]), vmul(dx, ws.d)), vmul(itof(xs.a), vmul(dx, ws.dmin)));
  }
};

template <>
struct I8<Q4_1> : I8Offset<8> {  // w <= 15
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 20 * b;
    mt = {half_at(p), half_at(p + 2), 0, 0};
    return nibbles32(p + 4);
  }
};

template <>
struct I8<Q5_1> : I8Offset<4> {  // w <= 31
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 24 * b;
    mt = {half_at(p), half_at(p + 2), 0, 0};
    uint32_t qh;
    std::memcpy(&qh, p + 4, 4);
    return _mm256_or_si256(nibbles32(p + 8), bits_to_0x10(qh));
  }
};

template <>
struct I8<Q5_K> : I8<Q4_K> {
  static constexpr int kI16Group = 4;  // w <= 31
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 176 * (b >> 3);
    const int j = static_cast<int>(b & 7);
    scale_min(p, j, mt);
    return Q5_K::quants(p, j);
  }
};

// Q2_K: a scale and a min per 16 elements: value = float(sc0 * isum0 + sc1 * isum1) * (dx * d)
//                                                  - float(m0 * sum x0 + m1 * sum x1) * (dx * dmin)
template <>
struct I8<Q2_K> {
  static constexpr bool kSplit = true;
  static constexpr bool kIntScales = true;
  static constexpr bool kMin = true;
  static constexpr bool kMins = true;
  static constexpr bool kSignedW = false;
  static constexpr int kI16Group = 4;  // w <= 3, at most a block half (kSplit)
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 84 * (b >> 3);
    const int j = static_cast<int>(b & 7);
    const uint8_t s0 = p[2 * j], s1 = p[2 * j + 1];
    mt = {half_at(p + 80), half_at(p + 82), static_cast<int16_t>(s0 & 0x0F), static_cast<int16_t>(s1 & 0x0F),
          static_cast<int16_t>(s0 >> 4), static_cast<int16_t>(s1 >> 4)};
    return Q2_K::quants(p, j);
  }
  static XSums xsums(IV bs0, IV bs1) { return {bs0, bs1}; }
  static constexpr bool kXTerm = false;  // the mins use xs apart: isum = r
  static V value(const IV* isum, const XSums& xs, V dx, const WScales& ws) {
    const V hi = vmul(itof(iadd(imul(isum[0], ws.s0), imul(isum[1], ws.s1))), vmul(dx, ws.d));
    const V lo = vmul(itof(iadd(imul(xs.a, ws.m0), imul(xs.b, ws.m1))), vmul(dx, ws.dmin));
    return vsub(hi, lo);
  }
};

// Q3_K: Q6_K's arithmetic (a signed scale per 16 elements) on quants 0..7 offset by 4
template <>
struct I8<Q3_K> : I8<Q6_K> {
  static constexpr int kI16Group = 4;  // w <= 7, at most a block half (kSplit)
  static int16_t scale(const uint8_t* s, int i) {  // scale i (offset 32 removed) of the 12 bytes at s
    const int lo = i < 8 ? s[i] & 0x0F : s[i - 8] >> 4;
    return static_cast<int16_t>((lo | (((s[8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4)) - 32);
  }
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 110 * (b >> 3);
    const int j = static_cast<int>(b & 7);
    mt = {half_at(p + 108), 0.0f, scale(p + 96, 2 * j), scale(p + 96, 2 * j + 1)};
    return Q3_K::quants(p, j);
  }
  static XSums xsums(IV bs0, IV bs1) { return {ishl<2>(bs0), ishl<2>(bs1)}; }
};

// IQ4_NL / IQ4_XS: signed levels, |w| <= 127, as Q8_0's (offset by 128 for VNNI's unsigned bytes)
inline __m256i iq4_quants(const uint8_t* codes) {
  const __m128i levels = kQ8Signed ? iq4_levels() : _mm_xor_si128(iq4_levels(), _mm_set1_epi8(static_cast<char>(0x80)));
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(levels), nibbles32(codes));
}

template <>
struct I8<IQ4_NL> : I8Simple<kQ8Signed ? 0 : 128> {
  static constexpr bool kSignedW = kQ8Signed;
  static constexpr int kI16Group = 1;  // |w| <= 127
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 18 * b;
    mt = {half_at(p), 0.0f, 0, 0};
    return iq4_quants(p + 2);
  }
};

// IQ4_XS: an integer scale per 32: value = float(sc * isum) * (dx * d)
template <>
struct I8<IQ4_XS> : I8Simple<kQ8Signed ? 0 : 128> {
  static constexpr bool kIntScales = true;
  static constexpr bool kSignedW = kQ8Signed;
  static constexpr int kI16Group = 1;  // |w| <= 127
  static __m256i quants(const uint8_t* row, int64_t b, WMeta& mt) {
    const uint8_t* p = row + 136 * (b >> 3);
    const int j = static_cast<int>(b & 7);
    mt = {half_at(p), 0.0f, static_cast<int16_t>(IQ4_XS::scale(p, j)), 0};
    return iq4_quants(p + 8 + 16 * j);
  }
  static V value(const IV* isum, const XSums&, V dx, const WScales& ws) {
    return vmul(itof(imul(isum[0], ws.s0)), vmul(dx, ws.d));
  }
};


}  // namespace lockstep
