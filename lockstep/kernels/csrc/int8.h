// Included by kernels.cpp inside its anonymous namespace (uses V and its helpers, half_at, nibbles32,
// bits_to_0x10, the block structs, check_blocks and UNROLL).
#pragma once

// ---------------------------------------------------------------- opt-in int8 activations
// llama.cpp's arithmetic: each row of x is quantized per block of 32 to int8 with one float32 scale
// (dx = max|x| / 127, q = round-half-even(x * (1 / dx)); a block whose dx is below the smallest normal
// float is all zeros), the weight block's integer quants are multiplied by q in int32 (exact), and
// every output element is accumulated in float32 over the blocks in increasing order:
//   Q8_0 / Q4_0 / Q5_0: isum = sum (w - offset) * q                 acc += float(isum) * (dx * d)
//   Q6_K: isum = sc0 * sum_lo16 (w - 32) * q + sc1 * sum_hi16 (...)   acc += float(isum) * (dx * d)
//   Q4_K: isum = sc * sum w * q,  mn = m * sum q                      acc += float(isum) * (dx * d)
//                                                                           - float(mn) * (dx * dmin)
// Each float operation is one rounding (built with -ffp-contract=off), and the integers are exact, so an
// element's value depends on nothing but its row of x and row of W: not on M, the other rows, the tile,
// the thread or the variant. blocks.py's linear_int8_reference computes the same sequence in torch and
// gives the same bits.
//
// Layout: x is quantized once per call into groups of 16 rows, each block of a group stored as 8 "k4"
// slices of 16 lanes x 4 bytes (lane i = row i's 4 consecutive quants), the layout VNNI's dpbusd (and
// AMX's B tiles) multiply: a weight's 4 bytes are broadcast to every lane, so one instruction advances
// 16 rows of x by 4 elements with no horizontal sums. Weights are decoded a panel of rows at a time into
// plain unsigned bytes (Q8_0 offset by 128 on AVX-512; on AVX2 it stays signed and uses the sign trick,
// as maddubs saturates on 255 * 127 * 2). At M <= kRowLanesMaxM the roles swap (W rows in lanes, x
// broadcast; see int8_rows). An AMX-INT8 version of the x-in-lanes tile (TDPBUSD per block of 32, the
// same integers) was measured no faster than VNNI here: the per-block float steps, not the integer dots,
// bound this arithmetic, so it is not kept.

#ifdef LOCKSTEP_AVX512
#define I8_TARGET __attribute__((target("avx512vnni")))
#else
#define I8_TARGET
#endif

constexpr int kXLanes = 16;          // x rows per packed group
constexpr int64_t kXGroupBytes = 512;  // one block of a group: 8 k4 slices x 16 lanes x 4 bytes

// ---------------------------------------------------------------- x: quantize and pack
inline float quantize_block32(const float* x, int8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  float d = _mm_cvtss_f32(h) / 127.0f;
  float id = 1.0f / d;
  if (!(d >= std::numeric_limits<float>::min())) d = id = 0.0f;  // 1/d would overflow
  const __m256 idv = _mm256_set1_ps(id);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));  // nearest even
  // packs interleave per 128-bit lane; the permute puts the 4-byte groups back in element order
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return d;
}

struct XInt8 {
  int64_t groups = 0, blocks = 0;
  std::vector<int8_t> q;     // [groups][blocks][8][16][4]
  std::vector<float> d;      // [groups][blocks][16]
  std::vector<int32_t> bs;   // [groups][blocks][2][16]: sums of a block's first and last 16 quants
};

inline int32_t sum_i8(const int8_t* q, int n) {
  int32_t s = 0;
  for (int i = 0; i < n; ++i) s += q[i];
  return s;
}

void pack_x_int8(const float* x, int64_t m, int64_t k, XInt8& p) {
  p.groups = (m + kXLanes - 1) / kXLanes;
  p.blocks = k / 32;
  const int64_t gb = p.groups * p.blocks;
  p.q.assign(static_cast<size_t>(gb * kXGroupBytes), 0);  // padded rows stay zero
  p.d.assign(static_cast<size_t>(gb * kXLanes), 0.0f);
  p.bs.assign(static_cast<size_t>(gb * 2 * kXLanes), 0);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    alignas(32) int8_t t[32];
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t g = r / kXLanes, i = r % kXLanes;
      for (int64_t b = 0; b < p.blocks; ++b) {
        const int64_t at = g * p.blocks + b;
        p.d[at * kXLanes + i] = quantize_block32(x + r * k + 32 * b, t);
        for (int k4 = 0; k4 < 8; ++k4) std::memcpy(&p.q[at * kXGroupBytes + 64 * k4 + 4 * i], t + 4 * k4, 4);
        p.bs[at * 32 + i] = sum_i8(t, 16);
        p.bs[at * 32 + 16 + i] = sum_i8(t + 16, 16);
      }
    }
  });
}

// ---------------------------------------------------------------- 16 int32 lanes, per ISA
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
// maddubs pairs u8 x s8 into saturating int16: fine for weights up to 63 (63 * 127 * 2 < 32767); a signed
// weight (Q8_0) goes in as |w| against x with w's sign, at most 128 * 127 * 2
inline __m256i dot4_half(__m256i r, __m256i w, __m256i x, bool signed_w) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (signed_w) return _mm256_add_epi32(r, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones));
  return _mm256_add_epi32(r, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
}
template <bool kSignedW>
inline void dot4(IV& r, IV w, IV x) {
  r.lo = dot4_half(r.lo, w.lo, x.lo, kSignedW);
  r.hi = dot4_half(r.hi, w.hi, x.hi, kSignedW);
}
#endif

// ---------------------------------------------------------------- weights: integer quants per block
struct WMeta {
  float d, dmin;   // dmin: Q4_K only
  int32_t s0, s1;  // Q4_K: scale, min; Q6_K: the two 16-element scales
};

// the x-side integers a block's value needs, computed once per block of a group
struct XSums {
  IV a, b;
};

// a weight block's scales per lane: every lane the same row's (x rows in lanes), or each its own row's
struct WScales {
  V d, dmin;
  IV s0, s1;
};
inline WScales bcast(const WMeta& mt) { return {vset1(mt.d), vset1(mt.dmin), iset1(mt.s0), iset1(mt.s1)}; }

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
  static_assert(kOff == 0 || kOff == 8 || kOff == 16 || kOff == 128, "offsets are powers of two");
  static XSums xsums(IV bs0, IV bs1) {
    if constexpr (kOff == 0) {
      return {izero(), izero()};
    } else {
      constexpr int shift = kOff == 128 ? 7 : kOff == 16 ? 4 : 3;
      return {ishl<shift>(iadd(bs0, bs1)), izero()};
    }
  }
  static V value(const IV* r, const XSums& xs, V dx, const WScales& ws) {
    const IV isum = kOff == 0 ? r[0] : isub(r[0], xs.a);
    return vmul(itof(isum), vmul(dx, ws.d));
  }
};

template <>
struct I8<Q8_0> : I8Simple<kQ8Signed ? 0 : 128> {
  static constexpr bool kSignedW = kQ8Signed;
  static void decode(const uint8_t* row, int64_t b, uint8_t* q, WMeta& mt) {
    const uint8_t* p = row + 34 * b;
    mt = {half_at(p), 0.0f, 0, 0};
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    if (!kQ8Signed) v = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128
    store32(q, v);
  }
};

template <>
struct I8<Q4_0> : I8Simple<8> {
  static constexpr bool kSignedW = false;
  static void decode(const uint8_t* row, int64_t b, uint8_t* q, WMeta& mt) {
    const uint8_t* p = row + 18 * b;
    mt = {half_at(p), 0.0f, 0, 0};
    store32(q, nibbles32(p + 2));
  }
};

template <>
struct I8<Q5_0> : I8Simple<16> {
  static constexpr bool kSignedW = false;
  static void decode(const uint8_t* row, int64_t b, uint8_t* q, WMeta& mt) {
    const uint8_t* p = row + 22 * b;
    mt = {half_at(p), 0.0f, 0, 0};
    uint32_t qh;
    std::memcpy(&qh, p + 2, 4);
    store32(q, _mm256_or_si256(nibbles32(p + 6), bits_to_0x10(qh)));
  }
};

template <>
struct I8<Q4_K> {
  static constexpr bool kSplit = false;
  static constexpr bool kSignedW = false;
  static void decode(const uint8_t* row, int64_t b, uint8_t* q, WMeta& mt) {
    const uint8_t* p = row + 144 * (b >> 3);
    const int j = static_cast<int>(b & 7);
    const uint8_t* s = p + 4;
    int32_t sc, mn;
    if (j < 4) {
      sc = s[j] & 63;
      mn = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    mt = {half_at(p), half_at(p + 2), sc, mn};
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * (j >> 1)));
    store32(q, _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(4 * (j & 1))), _mm256_set1_epi8(0x0F)));
  }
  static XSums xsums(IV bs0, IV bs1) { return {iadd(bs0, bs1), izero()}; }
  static V value(const IV* r, const XSums& xs, V dx, const WScales& ws) {
    const V hi = vmul(itof(imul(r[0], ws.s0)), vmul(dx, ws.d));
    const V lo = vmul(itof(imul(xs.a, ws.s1)), vmul(dx, ws.dmin));
    return vsub(hi, lo);
  }
};

template <>
struct I8<Q6_K> {
  static constexpr bool kSplit = true;  // two integer sums per block: a scale per 16 elements
  static constexpr bool kSignedW = false;
  static void decode(const uint8_t* row, int64_t b, uint8_t* q, WMeta& mt) {
    const uint8_t* p = row + 210 * (b >> 3);
    const int j = static_cast<int>(b & 7), h = j >> 2, g = j & 3;
    mt = {half_at(p + 208), 0.0f, static_cast<int8_t>(p[192 + 2 * j]), static_cast<int8_t>(p[193 + 2 * j])};
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (g & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128((g >> 1) * 4)),
                                        _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
    store32(q, _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));  // 0..63, offset 32
  }
  static XSums xsums(IV bs0, IV bs1) { return {ishl<5>(bs0), ishl<5>(bs1)}; }
  static V value(const IV* r, const XSums& xs, V dx, const WScales& ws) {
    const IV isum = iadd(imul(isub(r[0], xs.a), ws.s0), imul(isub(r[1], xs.b), ws.s1));
    return vmul(itof(isum), vmul(dx, ws.d));
  }
};

// ---------------------------------------------------------------- tiles
#ifdef LOCKSTEP_AVX512
constexpr int kI8Rows = 4;  // W rows per tile
#else
constexpr int kI8Rows = 2;
#endif

// out[j] (lane i) = the output of x row 16g + i and W row j, j < NT; W rows decoded at wq, stride k
template <class T, int NT>
I8_TARGET void int8_tile(const uint8_t* wq, int64_t k, const WMeta* meta, const XInt8& xp, int64_t g,
                         V* out) {
  using Q = I8<T>;
  constexpr int S = Q::kSplit ? 2 : 1;
  const int64_t nb = xp.blocks;
  V acc[NT];
  UNROLL for (int j = 0; j < NT; ++j) acc[j] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t at = g * nb + b;
    const int8_t* xq = xp.q.data() + at * kXGroupBytes;
    // two chains per integer sum (even and odd k4: exact integers, so the split changes nothing)
    IV r[NT][2 * S];
    UNROLL for (int j = 0; j < NT; ++j) UNROLL for (int s = 0; s < 2 * S; ++s) r[j][s] = izero();
    UNROLL for (int k4 = 0; k4 < 8; ++k4) {
      const IV x = iload(xq + 64 * k4);
      UNROLL for (int j = 0; j < NT; ++j) {
        int32_t w;
        std::memcpy(&w, wq + j * k + 32 * b + 4 * k4, 4);
        dot4<Q::kSignedW>(r[j][2 * (k4 * S / 8) + (k4 & 1)], iset1(w), x);
      }
    }
    const XSums xs = Q::xsums(iload(&xp.bs[at * 32]), iload(&xp.bs[at * 32 + 16]));
    const V dx = vload(&xp.d[at * kXLanes]);
    UNROLL for (int j = 0; j < NT; ++j) {
      IV sums[S];
      UNROLL for (int s = 0; s < S; ++s) sums[s] = iadd(r[j][2 * s], r[j][2 * s + 1]);
      acc[j] = vadd(acc[j], Q::value(sums, xs, dx, bcast(meta[j * nb + b])));
    }
  }
  UNROLL for (int j = 0; j < NT; ++j) out[j] = acc[j];
}

// W rows [r0, r0 + rows) decoded into wq (stride k) and meta (stride nb)
template <class T>
inline void decode_panel(const uint8_t* w, int64_t rb, int64_t r0, int64_t rows, int64_t k, uint8_t* wq,
                         WMeta* meta) {
  const int64_t nb = k / 32;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + (r0 + r) * rb;
    for (int64_t b = 0; b < nb; ++b) {
      // streamed once: fetch ahead, as the exact kernels do (T::kBytes: bytes per 32 elements)
      _mm_prefetch(reinterpret_cast<const char*>(row + b * T::kBytes + kPrefetchBytes), _MM_HINT_T0);
      I8<T>::decode(row, b, wq + r * k + 32 * b, meta[r * nb + b]);
    }
  }
}

// t[j][i] -> y[x row 16g + i][W row c0 + j] for the rows and lanes that exist
inline void store_lanes(const float* t, int64_t cols, int64_t lanes, float* y, int64_t n, int64_t g, int64_t c0) {
  for (int64_t i = 0; i < lanes; ++i) {
    float* dst = y + (g * kXLanes + i) * n + c0;
    for (int64_t j = 0; j < cols; ++j) dst[j] = t[j * kXLanes + i];
  }
}

// W row panels [p0, p1) of `prow` rows each against groups [g0, g1) of x
template <class T>
I8_TARGET void int8_panels(const uint8_t* w, int64_t rb, const XInt8& xp, float* y, int64_t m, int64_t n,
                           int64_t k, int64_t prow, int64_t p0, int64_t p1, int64_t g0, int64_t g1) {
  const int64_t nb = k / 32;
  std::vector<uint8_t> wq(static_cast<size_t>(prow * k), 0);
  std::vector<WMeta> meta(static_cast<size_t>(prow * nb), WMeta{0.0f, 0.0f, 0, 0});
  alignas(64) float t[kI8Rows * kXLanes];
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t r0 = p * prow, rows = std::min(prow, n - r0);
    decode_panel<T>(w, rb, r0, rows, k, wq.data(), meta.data());
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t lanes = std::min<int64_t>(kXLanes, m - g * kXLanes);
      for (int64_t j0 = 0; j0 < rows; j0 += kI8Rows) {  // rows past `rows` hold stale or zero data: not stored
        V out[kI8Rows];
        int8_tile<T, kI8Rows>(&wq[j0 * k], k, &meta[j0 * nb], xp, g, out);
        for (int j = 0; j < kI8Rows; ++j) vstore(t + j * kXLanes, out[j]);
        store_lanes(t, std::min<int64_t>(kI8Rows, rows - j0), lanes, y, n, g, r0 + j0);
      }
    }
  }
}

// ---------------------------------------------------------------- a few rows of x: W rows in lanes
// At M <= kRowLanesMaxM the x-in-lanes tiles above would leave most lanes empty; here each lane is a W
// row instead (16 rows' blocks transposed so that lane j holds row j's 4 consecutive quants) and x's 4
// bytes are broadcast. The same integers and the same float steps per output element: the same bits.
constexpr int64_t kRowLanesMaxM = 4;  // measured: x rows in lanes is as fast from about 4 rows on
constexpr int kRowTileM = 4;  // x rows per pass over a panel's blocks

// an 8 x 8 matrix of dwords (row i at src + i * stride) -> dst + 64 * c: column c's 8 dwords
inline void transpose8x8(const uint8_t* src, int64_t stride, uint8_t* dst) {
  __m256i r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * stride));
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // u[i + c]: column c in the low 128 bits, column c + 4 in the high
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    store32(dst + 64 * c, _mm256_permute2x128_si256(u[c], u[c + 4], 0x20));
    store32(dst + 64 * (c + 4), _mm256_permute2x128_si256(u[c], u[c + 4], 0x31));
  }
}

// 16 decoded W rows, per block: quants [8 k4][16 lanes][4 bytes] and each lane's scales
struct RowPanel {
  std::vector<uint8_t> q;
  std::vector<float> d, dmin;
  std::vector<int32_t> s0, s1;
  explicit RowPanel(int64_t nb)
      : q(static_cast<size_t>(nb * kXGroupBytes)), d(nb * 16), dmin(nb * 16), s0(nb * 16), s1(nb * 16) {}
};

// out[i] (lane j) = the output of x row i and W row j; x row-major int8 [MR][k], dx [MR][nb], bs [MR][nb][2]
template <class T, int MR>
I8_TARGET void rows_tile(const RowPanel& wp, int64_t nb, const int8_t* xq, const float* dx, const int32_t* bs,
                         int64_t k, V* out) {
  using Q = I8<T>;
  constexpr int S = Q::kSplit ? 2 : 1;
  V acc[MR];
  UNROLL for (int i = 0; i < MR; ++i) acc[i] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    IV r[MR][2 * S];
    UNROLL for (int i = 0; i < MR; ++i) UNROLL for (int s = 0; s < 2 * S; ++s) r[i][s] = izero();
    UNROLL for (int k4 = 0; k4 < 8; ++k4) {
      const IV w = iload(&wp.q[b * kXGroupBytes + 64 * k4]);
      UNROLL for (int i = 0; i < MR; ++i) {
        int32_t xv;
        std::memcpy(&xv, xq + i * k + 32 * b + 4 * k4, 4);
        dot4<Q::kSignedW>(r[i][2 * (k4 * S / 8) + (k4 & 1)], w, iset1(xv));
      }
    }
    const WScales ws{vload(&wp.d[16 * b]), vload(&wp.dmin[16 * b]), iload(&wp.s0[16 * b]), iload(&wp.s1[16 * b])};
    UNROLL for (int i = 0; i < MR; ++i) {
      IV sums[S];
      UNROLL for (int s = 0; s < S; ++s) sums[s] = iadd(r[i][2 * s], r[i][2 * s + 1]);
      const XSums xs = Q::xsums(iset1(bs[(i * nb + b) * 2]), iset1(bs[(i * nb + b) * 2 + 1]));
      acc[i] = vadd(acc[i], Q::value(sums, xs, vset1(dx[i * nb + b]), ws));
    }
  }
  UNROLL for (int i = 0; i < MR; ++i) out[i] = acc[i];
}

// 16-row W tiles [t0, t1) against all m (<= kRowLanesMaxM) rows of x
template <class T>
I8_TARGET void int8_rows(const uint8_t* w, int64_t rb, const int8_t* xq, const float* dx, const int32_t* bs,
                         float* y, int64_t m, int64_t n, int64_t k, int64_t t0, int64_t t1) {
  const int64_t nb = k / 32;
  std::vector<uint8_t> wq(static_cast<size_t>(16 * k), 0);
  std::vector<WMeta> meta(static_cast<size_t>(16 * nb), WMeta{0.0f, 0.0f, 0, 0});
  RowPanel wp(nb);
  alignas(64) float t[kXLanes];
  for (int64_t tt = t0; tt < t1; ++tt) {
    const int64_t r0 = tt * 16, rows = std::min<int64_t>(16, n - r0);  // lanes past `rows`: stale, not stored
    decode_panel<T>(w, rb, r0, rows, k, wq.data(), meta.data());
    for (int64_t b = 0; b < nb; ++b) {
      transpose8x8(&wq[32 * b], k, &wp.q[b * kXGroupBytes]);
      transpose8x8(&wq[8 * k + 32 * b], k, &wp.q[b * kXGroupBytes + 32]);
      for (int j = 0; j < 16; ++j) {
        const WMeta& mt = meta[j * nb + b];
        wp.d[16 * b + j] = mt.d;
        wp.dmin[16 * b + j] = mt.dmin;
        wp.s0[16 * b + j] = mt.s0;
        wp.s1[16 * b + j] = mt.s1;
      }
    }
    for (int64_t i0 = 0; i0 < m; i0 += kRowTileM) {
      const int64_t mr = std::min<int64_t>(kRowTileM, m - i0);
      V out[kRowTileM];
      const int8_t* xi = xq + i0 * k;
      const float* di = dx + i0 * nb;
      const int32_t* bi = bs + i0 * nb * 2;
      if (mr == 4) rows_tile<T, 4>(wp, nb, xi, di, bi, k, out);
      else if (mr == 3) rows_tile<T, 3>(wp, nb, xi, di, bi, k, out);
      else if (mr == 2) rows_tile<T, 2>(wp, nb, xi, di, bi, k, out);
      else rows_tile<T, 1>(wp, nb, xi, di, bi, k, out);
      for (int64_t i = 0; i < mr; ++i) {
        vstore(t, out[i]);
        std::memcpy(y + (i0 + i) * n + r0, t, static_cast<size_t>(rows) * sizeof(float));
      }
    }
  }
}

bool int8_supported() {
#ifdef LOCKSTEP_AVX512
  static const bool ok = __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return true;
#endif
}

template <class F>
void dispatch_int8(const std::string& qtype, F&& f) {
  if (qtype == "Q8_0") return f(Q8_0{});
  if (qtype == "Q4_0") return f(Q4_0{});
  if (qtype == "Q5_0") return f(Q5_0{});
  if (qtype == "Q4_K") return f(Q4_K{});
  if (qtype == "Q6_K") return f(Q6_K{});
  TORCH_CHECK(false, "lockstep kernels: no int8 kernel for block type ", qtype);
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& blocks, const std::string& qtype, int64_t k) {
  check_blocks(blocks, k);
  check_x_f32(x, k);
  TORCH_CHECK(int8_supported(), "the int8 kernels of this variant need AVX-512 VNNI");
  const int64_t m = x.size(0), n = blocks.size(0), rb = blocks.stride(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t nb = k / 32;
  if (m <= kRowLanesMaxM) {
    std::vector<int8_t> xq(static_cast<size_t>(m * k));
    std::vector<float> dx(static_cast<size_t>(m * nb));
    std::vector<int32_t> bs(static_cast<size_t>(m * nb * 2));
    const float* xs = x.data_ptr<float>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        int8_t* q = &xq[r * k + 32 * b];
        dx[r * nb + b] = quantize_block32(xs + r * k + 32 * b, q);
        bs[(r * nb + b) * 2] = sum_i8(q, 16);
        bs[(r * nb + b) * 2 + 1] = sum_i8(q + 16, 16);
      }
    dispatch_int8(qtype, [&](auto tag) {
      using T = decltype(tag);
      at::parallel_for(0, (n + 15) / 16, 16, [&](int64_t t0, int64_t t1) {
        int8_rows<T>(w, rb, xq.data(), dx.data(), bs.data(), yp, m, n, k, t0, t1);
      });
    });
    return y;
  }
  XInt8 xp;
  pack_x_int8(x.data_ptr<float>(), m, k, xp);
  // a panel of decoded rows stays in L1/L2 while every group of x passes over it
  const int64_t prow = std::max<int64_t>(kI8Rows, std::min<int64_t>(64, 32768 / k) / kI8Rows * kI8Rows);
  // x in passes of kPassGroups groups (256 rows): a pass's packed blocks stay in L2 while every W panel
  // goes over them; W panels are decoded once per pass (cheap next to 256 rows of dot products)
  constexpr int64_t kPassGroups = 16;
  dispatch_int8(qtype, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t g0 = 0; g0 < xp.groups; g0 += kPassGroups) {
      const int64_t g1 = std::min(xp.groups, g0 + kPassGroups);
      at::parallel_for(0, (n + prow - 1) / prow, 1, [&](int64_t p0, int64_t p1) {
        int8_panels<T>(w, rb, xp, yp, m, n, k, prow, p0, p1, g0, g1);
      });
    }
  });
  return y;
}

// x's int8 quantization alone (q [M, K] int8, d [M, K / 32] float32): what the tests hold against the reference
std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "x must be [M, K] with K a multiple of 32");
  check_x_f32(x, x.size(1));
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, k / 32}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < k / 32; ++b) dp[r * (k / 32) + b] = quantize_block32(xp + r * k + 32 * b, qp + r * k + 32 * b);
  return {q, d};
}
