// ---------------------------------------------------------------- int8 activations
// llama.cpp's arithmetic: each row of x is quantized per block of 32 to int8 with one float32 scale
// (dx = max|x| / 127, q = round-half-even(x * (1 / dx)); a block whose dx is below the smallest normal
// float is all zeros), the weight block's integer quants are multiplied by q in int32 (exact), and
// every output element is accumulated in float32 over the blocks in increasing order:
//   Q8_0 / Q4_0 / Q5_0: isum = sum (w - offset) * q                 acc += float(isum) * (dx * d)
//   Q6_K: isum = sc0 * sum_lo16 (w - 32) * q + sc1 * sum_hi16 (...)   acc += float(isum) * (dx * d)
//   Q4_K, Q5_K: isum = sc * sum w * q,  mn = m * sum q                acc += float(isum) * (dx * d)
//                                                                           - float(mn) * (dx * dmin)
//   Q4_1 / Q5_1: isum = sum w * q, s = sum q                          acc += float(isum) * (dx * d)
//                                                                           + float(s) * (dx * m)
//   Q3_K as Q6_K (offset 4); Q2_K as Q6_K, less float(m0 * sum_lo16 q + m1 * sum_hi16 q) * (dx * dmin);
//   IQ4_NL as Q8_0 (its levels the quants); IQ4_XS: isum = sc * sum w * q  acc += float(isum) * (dx * d)
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
// as maddubs saturates on 255 * 127 * 2). At M <= row_lanes' limit the W blocks are read as stored
// instead, nothing decoded to memory (see rows_tile). An AMX-INT8 version of the x-in-lanes tile (TDPBUSD per block of 32, the
// same integers) was measured no faster than VNNI here: the per-block float steps, not the integer dots,
// bound this arithmetic, so it is not kept.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <limits>
#include <type_traits>
#include <vector>

#include "blocks.h"
#include "ops.h"

namespace lockstep {

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

// ---------------------------------------------------------------- tiles
#ifdef LOCKSTEP_AVX512
constexpr int kI8Rows = 8;  // W rows per tile
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
#ifdef LOCKSTEP_AVX512
    const XSums xs = Q::xsums(iload(&xp.bs[at * 32]), iload(&xp.bs[at * 32 + 16]));
    // one chain per integer sum, started at minus the x-side terms: the tile's 8 rows keep enough
    // chains in flight, and this took 0.90-0.98x the time of two chains per sum with the subtraction
    // after (Q5_0, Q6_K; benchmarks/kernel_source_ab.py)
    IV r[NT][S];
    IV start[S];
    UNROLL for (int s = 0; s < S; ++s) start[s] = izero();
    less_xterms<Q, S>(start, xs);
    UNROLL for (int j = 0; j < NT; ++j) UNROLL for (int s = 0; s < S; ++s) r[j][s] = start[s];
    UNROLL for (int k4 = 0; k4 < 8; ++k4) {
      const IV x = iload(xq + 64 * k4);
      UNROLL for (int j = 0; j < NT; ++j) {
        int32_t w;
        std::memcpy(&w, wq + j * k + 32 * b + 4 * k4, 4);
        dot4<Q::kSignedW>(r[j][k4 * S / 8], iset1(w), x);
      }
    }
#else
    // two chains per integer sum (even and odd k4: exact integers, so the split changes nothing)
    IV r[NT][2 * S];
    UNROLL for (int j = 0; j < NT; ++j) UNROLL for (int s = 0; s < 2 * S; ++s) r[j][s] = izero();
    // maddubs' int16 pair sums of kI16Group slices are added in int16 before one madd widens them:
    // half the multiplier port's work or less for the 4-, 5- and 6-bit types (the bound per type keeps
    // every int16 sum exact: blocks.h, kI16Group), so the integers and the bits are the same
    constexpr int G = Q::kI16Group;
    __m256i t[NT][2];
    UNROLL for (int k4 = 0; k4 < 8; ++k4) {
      const IV x = iload(xq + 64 * k4);
      UNROLL for (int j = 0; j < NT; ++j) {
        int32_t w32;
        std::memcpy(&w32, wq + j * k + 32 * b + 4 * k4, 4);
        const __m256i w = _mm256_set1_epi32(w32);
        const __m256i p[2] = {pairs16<Q::kSignedW>(w, x.lo), pairs16<Q::kSignedW>(w, x.hi)};
        UNROLL for (int e = 0; e < 2; ++e) t[j][e] = k4 % G == 0 ? p[e] : _mm256_add_epi16(t[j][e], p[e]);
        if (k4 % G == G - 1) {
          IV& rr = r[j][2 * (k4 * S / 8) + ((k4 / G) & 1)];
          rr.lo = _mm256_add_epi32(rr.lo, widen16(t[j][0]));
          rr.hi = _mm256_add_epi32(rr.hi, widen16(t[j][1]));
        }
      }
    }
    const XSums xs = Q::xsums(iload(&xp.bs[at * 32]), iload(&xp.bs[at * 32 + 16]));  // after: 16 registers
    UNROLL for (int j = 0; j < NT; ++j) {
      UNROLL for (int s = 0; s < S; ++s) r[j][s] = iadd(r[j][2 * s], r[j][2 * s + 1]);
      less_xterms<Q, S>(r[j], xs);
    }
#endif
    const V dx = vload(&xp.d[at * kXLanes]);
    UNROLL for (int j = 0; j < NT; ++j) acc[j] = vadd(acc[j], Q::value(r[j], xs, dx, bcast(meta[j * nb + b])));
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
      store32(wq + r * k + 32 * b, I8<T>::quants(row, b, meta[r * nb + b]));
    }
  }
}

constexpr int64_t kMaxPanelRows = 64;  // W rows per int8 panel at most (panel_rows)

// An 8 x 8 block of floats transposed: in rows 8 apart (stride si), out rows so apart
inline void transpose8x8(const float* in, int64_t si, float* out, int64_t so) {
  __m256 r[8], t[8];
  UNROLL for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * si);
  UNROLL for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  UNROLL for (int i = 0; i < 2; ++i) UNROLL for (int h = 0; h < 2; ++h) {
    r[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0x44);
    r[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0xEE);
  }
  // r[c], c < 4: column c of rows 0-3 in the low half, column c + 4 in the high; r[4 + c]: rows 4-7
  UNROLL for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(out + c * so, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
    _mm256_storeu_ps(out + (c + 4) * so, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
  }
}

// A panel's outputs for one group of x, yb[j][i] (W row j < rows, lane i, rows padded to a multiple of 8),
// -> y[x row 16g + i][W row c0 + j] for the lanes that exist. Transposed in L1 first (yt[i][j]), then each
// x row's run written whole, where each tile stored its 8 x 16 outputs one float at a time: 0.97x on the
// 262k-row head at 32 rows, 0.97-0.99x on the layers (kernel_source_ab.py). `stream`: non-temporal stores
// for an output too big to stay cached.
inline void store_panel(const float* yb, int64_t rows, int64_t lanes, float* y, int64_t ldy, int64_t g, int64_t c0,
                        bool stream) {
  alignas(64) float yt[kXLanes * kMaxPanelRows];
  const int64_t padded = (rows + 7) / 8 * 8;
  for (int64_t j0 = 0; j0 < padded; j0 += 8)
    for (int i0 = 0; i0 < kXLanes; i0 += 8)
      transpose8x8(yb + j0 * kXLanes + i0, kXLanes, yt + i0 * kMaxPanelRows + j0, kMaxPanelRows);
  for (int64_t i = 0; i < lanes; ++i) {
    float* dst = y + (g * kXLanes + i) * ldy + c0;
    const float* src = yt + i * kMaxPanelRows;
    int64_t j = 0;
    if (stream && reinterpret_cast<uintptr_t>(dst) % 32 == 0)
      for (; j + 8 <= rows; j += 8) _mm256_stream_ps(dst + j, _mm256_load_ps(src + j));
    for (; j < rows; ++j) dst[j] = src[j];
  }
}

// Outputs bigger than this (a vocabulary-wide head's logits at a decode batch: 32 MiB at 32 rows) are written
// past the caches: they would only evict the weights and x the tiles reuse.
constexpr int64_t kStreamOutBytes = 8 << 20;

// W row panels [p0, p1) of `prow` rows each against groups [g0, g1) of x
template <class T>
I8_TARGET void int8_panels(const uint8_t* w, int64_t rb, const XInt8& xp, float* y, int64_t ldy, int64_t m,
                           int64_t n, int64_t k, int64_t prow, int64_t p0, int64_t p1, int64_t g0, int64_t g1) {
  const int64_t nb = k / 32;
  std::vector<uint8_t> wq(static_cast<size_t>(prow * k), 0);
  std::vector<WMeta> meta(static_cast<size_t>(prow * nb), WMeta{});
  alignas(64) float yb[kMaxPanelRows * kXLanes] = {};  // a panel's outputs for one group
  const bool stream = m * ldy * static_cast<int64_t>(sizeof(float)) > kStreamOutBytes;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t r0 = p * prow, rows = std::min(prow, n - r0);
    decode_panel<T>(w, rb, r0, rows, k, wq.data(), meta.data());
    // The next panel's blocks are fetched into L2 a few lines per tile while this panel's tiles run:
    // decode_panel's own look-ahead alone left each panel's first reads waiting on DRAM (the 262k-row
    // head ran at 0.68x its in-cache rate at 32 rows).
    const char* ahead = reinterpret_cast<const char*>(w + (r0 + rows) * rb);
    const int64_t ahead_lines = p + 1 < p1 ? (std::min(prow, n - r0 - rows) * rb + 63) / 64 : 0;
    const int64_t tiles = (g1 - g0) * ((rows + kI8Rows - 1) / kI8Rows);
    const int64_t per_tile = (ahead_lines + tiles - 1) / tiles;
    int64_t fetched = 0;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t lanes = std::min<int64_t>(kXLanes, m - g * kXLanes);
      for (int64_t j0 = 0; j0 < rows; j0 += kI8Rows) {  // rows past `rows` hold stale or zero data: not stored
        for (int64_t c = 0; c < per_tile && fetched < ahead_lines; ++c, ++fetched)
          _mm_prefetch(ahead + 64 * fetched, _MM_HINT_T1);
        V out[kI8Rows];
        int8_tile<T, kI8Rows>(&wq[j0 * k], k, &meta[j0 * nb], xp, g, out);
        for (int j = 0; j < kI8Rows; ++j) vstore(yb + (j0 + j) * kXLanes, out[j]);
      }
      store_panel(yb, rows, lanes, y, ldy, g, r0, stream);
    }
  }
  if (stream) _mm_sfence();  // the non-temporal stores are visible before the parallel region joins
}

// Rows per W panel (a panel of decoded rows stays in L1/L2 while every group of x passes over it): at
// most 32 KiB of them, and of the multiples of the tile up to that, the one that splits the n rows most
// evenly over the threads (at::parallel_for gives each ceil(panels / threads) panels). The fixed 48 rows
// of a 640-wide matrix left one of two threads 144 of the k projection's 256 rows, the other 112.
inline int64_t panel_rows(int64_t n, int64_t k, int64_t threads) {
  const int64_t most = std::max<int64_t>(kI8Rows, std::min<int64_t>(kMaxPanelRows, 32768 / k) / kI8Rows * kI8Rows);
  int64_t best = most, best_rows = n + 1;
  for (int64_t prow = most; prow >= kI8Rows; prow -= kI8Rows) {
    const int64_t panels = (n + prow - 1) / prow;
    const int64_t busiest = std::min(n, (panels + threads - 1) / threads * prow);
    if (busiest < best_rows) best = prow, best_rows = busiest;
  }
  return best;
}

// ---------------------------------------------------------------- a few rows of x: W blocks as stored
// At M up to row_lanes' limit the x-in-lanes tiles above would leave most lanes empty and cost a decoded
// panel per call. Here every W block is decoded in registers straight from the GGUF's bytes (nothing
// repacked, nothing written) and dotted with each x row's block: 8 int32 lanes, lane l the elements
// 4l..4l+3. The lanes of 8 W rows are then summed by one horizontal-add tree (exact integers: the same
// sums as any order), which leaves lane j = W row j's block sum, so the float steps run with W rows in
// the lanes of V/IV, 16 rows at a time: the same integers and float steps per output element as the
// other paths, so the same bits.
// Up to that limit (small decode batches) x goes over each 16-row W tile in chunks of kRowChunk
// rows: the tile's blocks come from memory once and stay in L1/L2 for the later chunks (a tile of the
// default GGUF's widest rows, 16 x 2048 Q6_K, is 27 KiB), where a chunk re-decodes them in registers.
// Measured on AVX2 (docs/benchmarks.md, one thread): at 5 rows 0.7x the x-in-lanes panels' time on the
// 262k head, 0.78x at 9 (a verify pass of 8 drafts) and 0.86x at 10; the layers' narrower matrices
// turn to the panels (a fixed cost up to 16 rows) a little sooner, the head at 12: 10 is a whole step's
// crossover on AVX2. On AVX-512 (Zen 4, one thread, benchmarks/int8_kernel_rows.py) the panels' VNNI
// tiles win sooner: the 262k head's rows path took 20.9 ms at 3 rows and 37.1 at 4 against the
// panels' ~31.7 at any M up to 16; the layers' crossover is between 4 and 6 rows (at 6, Q5_0 gate
// 0.33 vs 0.25 ms, Q4_K down 0.44 vs 0.35). So there the limit depends on the matrix's width.
constexpr int64_t kRowChunk = 4;
#ifdef LOCKSTEP_AVX512
constexpr int64_t kRowLanesMaxM = 5, kRowLanesMaxMWide = 3;
#else
constexpr int64_t kRowLanesMaxM = 10, kRowLanesMaxMWide = 10;
#endif
constexpr int64_t kWideN = 65536;  // output columns from which a matrix counts as wide (an LM head)
inline bool row_lanes(int64_t m, int64_t n) { return m <= (n >= kWideN ? kRowLanesMaxMWide : kRowLanesMaxM); }

// the 8 lanes of w . x over one block of 32 (w decoded quants, x int8)
template <bool kSignedW>
I8_TARGET inline __m256i dot32(__m256i w, __m256i x) {
#ifdef LOCKSTEP_AVX512
  static_assert(!kSignedW, "the VNNI path takes unsigned weights");
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return widen16(pairs16<kSignedW>(w, x));
#endif
}

// v[j] (8 lanes each, j < 8) -> lo: lane j = sum of v[j]'s lanes 0-3 (elements 0-15), hi: lanes 4-7
inline void sum_lanes8(const __m256i* v, __m256i& lo, __m256i& hi) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  // inserts and an extract, not two vperm2i128 (8 uops each on first-generation Zen, 1 on Intel)
  lo = _mm256_inserti128_si256(u0, _mm256_castsi256_si128(u1), 1);
  hi = _mm256_inserti128_si256(u1, _mm256_extracti128_si256(u0, 1), 0);
}

// PairsAdd (AVX2): how many of a block's maddubs pair sums (w0 x0 + w1 x1, unsigned w) the lane tree adds
// in int16 before one madd widens them, as kI16Group bounds it: 4 for weights <= 31 (4 x 7874: a
// quarter of the madds of widening each leaf first), 2 for Q6_K's <= 63 (2 x 16002: half), 0 for
// signed Q8_0 (its leaves are widened at once).
#ifdef LOCKSTEP_AVX512
template <class Q>
constexpr int PairsAdd = 0;
#else
template <class Q>
constexpr int PairsAdd = Q::kSignedW ? 0 : Q::kI16Group >= 4 ? 4 : Q::kI16Group >= 2 ? 2 : 0;
#endif

// a leaf of the lane tree: w . x over one block of 32, as int16 pairs (PairsAdd) or 8 int32 lanes
template <class Q>
I8_TARGET inline __m256i tree_leaf(__m256i w, __m256i x) {
#ifndef LOCKSTEP_AVX512
  if constexpr (PairsAdd<Q> > 0) return pairs16<false>(w, x);
#endif
  return dot32<Q::kSignedW>(w, x);
}

// p[j] (PairsAdd >= 2 leaves of W rows j < 8) -> lo: lane j = sum of row j's elements 0-15, hi: 16-31
inline void sum_pairs8_halves(const __m256i* p, __m256i& lo, __m256i& hi) {
  __m256i c[4];  // per 128-bit half (elements 0-15 | 16-31): rows 2i, 2i+1 as two int32 sums each
  UNROLL for (int i = 0; i < 4; ++i) c[i] = widen16(_mm256_hadd_epi16(p[2 * i], p[2 * i + 1]));
  const __m256i d0 = _mm256_hadd_epi32(c[0], c[1]), d1 = _mm256_hadd_epi32(c[2], c[3]);  // rows 0-3 | 4-7
  lo = _mm256_inserti128_si256(d0, _mm256_castsi256_si128(d1), 1);
  hi = _mm256_inserti128_si256(d1, _mm256_extracti128_si256(d0, 1), 0);
}

// p[j] (PairsAdd 4 leaves of W rows j < 8) -> lane j = W row j's whole block sum
inline __m256i sum_pairs8(const __m256i* p) {
  const __m256i b0 = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
  const __m256i b1 = _mm256_hadd_epi16(_mm256_hadd_epi16(p[4], p[5]), _mm256_hadd_epi16(p[6], p[7]));
  const __m256i c0 = widen16(b0), c1 = widen16(b1);  // per 128-bit half: rows 0-3 | rows 4-7
  return _mm256_add_epi32(_mm256_inserti128_si256(c0, _mm256_castsi256_si128(c1), 1),
                          _mm256_inserti128_si256(c1, _mm256_extracti128_si256(c0, 1), 0));
}

inline IV iv_from(__m256i a, __m256i b) {
#ifdef LOCKSTEP_AVX512
  return {_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)};
#else
  return {a, b};
#endif
}

// kHeadHalves<T>: how many float16 scales open each block of T (d, and Q4_1's / Q5_1's m), which
// rows_tile fetches for its 16 rows with one gather per block on AVX-512 instead of 16 scalar loads
// and conversions per scale (those, not the integer dots, were the larger part of a Q4_1 block's
// instructions). The same float16 values, converted exactly: the arithmetic is unchanged.
template <class T>
constexpr int kHeadHalves = 0;
template <>
constexpr int kHeadHalves<Q8_0> = 1;
template <>
constexpr int kHeadHalves<Q4_0> = 1;
template <>
constexpr int kHeadHalves<Q5_0> = 1;
template <>
constexpr int kHeadHalves<Q4_1> = 2;
template <>
constexpr int kHeadHalves<Q5_1> = 2;

#ifdef LOCKSTEP_AVX512
// d (and m) of block b of the 16 rows whose byte offsets from `base` are `off`
template <class T>
I8_TARGET inline void gather_head(const uint8_t* base, __m512i off, int64_t b, V& d, V& m) {
  const __m512i g = _mm512_i32gather_epi32(off, base + T::kBytes * b, 1);
  d = {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(g))};
  if constexpr (kHeadHalves<T> == 2) m = {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)))};
}
#endif

// out[i] (lane j) = the output of x row i and W row r0 + j, j < 16 (rows past n repeat row n - 1 and
// are not stored); x row-major int8 [MR][k], dx [MR][nb], bs [MR][nb][2]
template <class T, int MR>
I8_TARGET void rows_tile(const uint8_t* w, int64_t rb, int64_t r0, int64_t n, const int8_t* xq, const float* dx,
                         const int32_t* bs, int64_t k, V* out) {
  using Q = I8<T>;
  constexpr int S = Q::kSplit ? 2 : 1;
  const int64_t nb = k / 32;
  const uint8_t *row[16], *next[16];
  for (int j = 0; j < 16; ++j) {
    row[j] = w + std::min<int64_t>(r0 + j, n - 1) * rb;
    next[j] = w + std::min<int64_t>(r0 + 16 + j, n - 1) * rb;
  }
  // This tile reads its 16 rows a block at a time: 16 short strides, which the hardware prefetchers
  // follow poorly from DRAM (measured: the 262k-row head ran 1.5x slower than the exact kernel's
  // row-after-row reads, while 2x faster from cache). So the next tile is fetched here line after
  // line, in address order, spread over this tile's blocks.
  const int64_t row_lines = (nb * T::kBytes + 63) / 64, per_block = (16 * row_lines + nb - 1) / nb;
  int pj = 0;
  int64_t pl = 0;
  V acc[MR];
  UNROLL for (int i = 0; i < MR; ++i) acc[i] = vzero();
  alignas(64) float md[16] = {}, mdmin[16] = {};  // the fields a type does not use stay zero
  alignas(64) int32_t ms0[16] = {}, ms1[16] = {}, mm0[16] = {}, mm1[16] = {};
#ifdef LOCKSTEP_AVX512
  constexpr bool kGather = kHeadHalves<T> > 0;
  alignas(64) int32_t offs[16];
  for (int j = 0; j < 16; ++j) offs[j] = static_cast<int32_t>(row[j] - row[0]);  // < 16 rows apart
  const __m512i off = _mm512_load_si512(offs);
#else
  constexpr bool kGather = false;
#endif
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t c = 0; c < per_block && pj < 16; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(next[pj] + 64 * pl), _MM_HINT_T0);
      if (++pl == row_lines) pl = 0, ++pj;
    }
    constexpr bool kPairs4 = PairsAdd<Q> == 4 && S == 1;  // whole-block sums from the int16 tree
    __m256i sums[MR][2][2];  // [x row][8-row half][elements 0-15 | 16-31]
    __m256i whole[MR][2];    // kPairs4: [x row][8-row half]
    for (int h = 0; h < 2; ++h) {
      __m256i v[MR][8];
      UNROLL for (int jj = 0; jj < 8; ++jj) {
        const int j = 8 * h + jj;
        WMeta mt;
        const __m256i q = Q::quants(row[j], b, mt);
        if constexpr (!kGather) {
          md[j] = mt.d;
          if constexpr (Q::kMin) mdmin[j] = mt.dmin;
        }
        if constexpr (Q::kIntScales) ms0[j] = mt.s0, ms1[j] = mt.s1;
        if constexpr (Q::kMins) mm0[j] = mt.m0, mm1[j] = mt.m1;
        UNROLL for (int i = 0; i < MR; ++i) {
          v[i][jj] = tree_leaf<Q>(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * k + 32 * b)));
        }
      }
      UNROLL for (int i = 0; i < MR; ++i) {
        if constexpr (kPairs4) whole[i][h] = sum_pairs8(v[i]);
        else if constexpr (PairsAdd<Q> >= 2) sum_pairs8_halves(v[i], sums[i][h][0], sums[i][h][1]);
        else sum_lanes8(v[i], sums[i][h][0], sums[i][h][1]);
      }
    }
    WScales ws{vload(md), vload(mdmin), iload(ms0), iload(ms1), iload(mm0), iload(mm1)};
#ifdef LOCKSTEP_AVX512
    if constexpr (kGather) gather_head<T>(row[0], off, b, ws.d, ws.dmin);
#endif
    UNROLL for (int i = 0; i < MR; ++i) {
      IV r[2];
      if constexpr (kPairs4) {
        r[0] = iv_from(whole[i][0], whole[i][1]);
      } else if constexpr (S == 2) {
        r[0] = iv_from(sums[i][0][0], sums[i][1][0]);
        r[1] = iv_from(sums[i][0][1], sums[i][1][1]);
      } else {
        r[0] = iv_from(_mm256_add_epi32(sums[i][0][0], sums[i][0][1]), _mm256_add_epi32(sums[i][1][0], sums[i][1][1]));
      }
      const XSums xs = Q::xsums(iset1(bs[(i * nb + b) * 2]), iset1(bs[(i * nb + b) * 2 + 1]));
      less_xterms<Q, S>(r, xs);
      acc[i] = vadd(acc[i], Q::value(r, xs, vset1(dx[i * nb + b]), ws));
    }
  }
  UNROLL for (int i = 0; i < MR; ++i) out[i] = acc[i];
}

// 16-row W tiles [t0, t1) against all m (row_lanes) rows of x; y's rows ldy apart
template <class T>
I8_TARGET void int8_rows(const uint8_t* w, int64_t rb, const int8_t* xq, const float* dx, const int32_t* bs,
                         float* y, int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t t0, int64_t t1) {
  alignas(64) float t[kXLanes];
  V out[kRowChunk];
  const int64_t nb = k / 32;
  for (int64_t tt = t0; tt < t1; ++tt) {
    const int64_t r0 = tt * 16, rows = std::min<int64_t>(16, n - r0);
    for (int64_t i0 = 0; i0 < m; i0 += kRowChunk) {
      const int64_t c = std::min(kRowChunk, m - i0);
      const int8_t* xc = xq + i0 * k;
      const float* dc = dx + i0 * nb;
      const int32_t* bc = bs + i0 * nb * 2;
      if (c == 1) rows_tile<T, 1>(w, rb, r0, n, xc, dc, bc, k, out);
      else if (c == 2) rows_tile<T, 2>(w, rb, r0, n, xc, dc, bc, k, out);
      else if (c == 3) rows_tile<T, 3>(w, rb, r0, n, xc, dc, bc, k, out);
      else rows_tile<T, 4>(w, rb, r0, n, xc, dc, bc, k, out);
      for (int64_t i = 0; i < c; ++i) {
        vstore(t, out[i]);
        std::memcpy(y + (i0 + i) * ldy + r0, t, static_cast<size_t>(rows) * sizeof(float));
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

// The parts of a fused layer (qkv, gate/up), each of its own block type, side by side in y: x quantized
// once, and on the rows path (row_lanes) one parallel region over every part's tiles (the narrow k and v
// projections alone would not fill two threads, and each region is a fork and a join).
at::Tensor linear_int8_parts_lora(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                                  const std::vector<int64_t>& types, int64_t k, const LoraOperands* lora) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == types.size(), "one block type per part");
  for (const auto& b : blocks) check_blocks(b, k);
  check_x_f32(x, k);
  TORCH_CHECK(int8_supported(), "the int8 kernels of this variant need AVX-512 VNNI");
  const int64_t m = x.size(0), nb = k / 32, parts = static_cast<int64_t>(blocks.size());
  std::vector<int64_t> col(static_cast<size_t>(parts) + 1, 0);  // part p's first output column
  for (int64_t p = 0; p < parts; ++p) col[p + 1] = col[p] + blocks[p].size(0);
  const int64_t n_total = col[parts];
  at::Tensor y = at::empty({m, n_total}, x.options());
  if (m == 0 || n_total == 0) return y;
  float* yp = y.data_ptr<float>();
  if (row_lanes(m, n_total)) {
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
    std::vector<int64_t> first_tile(static_cast<size_t>(parts) + 1, 0);
    for (int64_t p = 0; p < parts; ++p) first_tile[p + 1] = first_tile[p] + (blocks[p].size(0) + 15) / 16;
    const int64_t tiles = first_tile[parts];
    auto base = [&](int64_t t0, int64_t t1) {
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t lo = std::max(t0, first_tile[p]), hi = std::min(t1, first_tile[p + 1]);
        if (lo >= hi) continue;
        const at::Tensor& b = blocks[p];
        dispatch_int8(types[p], [&](auto tag) {
          int8_rows<decltype(tag)>(b.data_ptr<uint8_t>(), b.stride(0), xq.data(), dx.data(), bs.data(), yp + col[p],
                                   n_total, m, b.size(0), k, lo - first_tile[p], hi - first_tile[p]);
        });
      }
    };
    if (!lora) {
      at::parallel_for(0, tiles, 8, base);
      return y;
    }
    // the adapters' products in the same region: the shrink beside the base's tiles, the expand after
    // a barrier (one fork a linear instead of two)
    LoraPlan plan(x, lora->w, lora->slots);
    for (int64_t p = 0; p < parts; ++p) dispatch_int8(types[p], [](auto) {});  // throws here, not in the region
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max((tiles + 7) / 8, plan.items()));
    plan.run(threads, [&](int64_t part, int64_t n_parts) {
      const int64_t chunk = (tiles + n_parts - 1) / n_parts;
      base(std::min(tiles, part * chunk), std::min(tiles, (part + 1) * chunk));
    }, yp, n_total);
    return y;
  }
  XInt8 xp;
  pack_x_int8(x.data_ptr<float>(), m, k, xp);
  // x in passes of kPassGroups groups (256 rows): a pass's packed blocks stay in L2 while every W panel
  // goes over them; W panels are decoded once per pass (cheap next to 256 rows of dot products)
  constexpr int64_t kPassGroups = 16;
  for (int64_t g0 = 0; g0 < xp.groups; g0 += kPassGroups) {
    const int64_t g1 = std::min(xp.groups, g0 + kPassGroups);
    for (int64_t p = 0; p < parts; ++p) {
      const at::Tensor& b = blocks[p];
      const int64_t n = b.size(0), prow = panel_rows(n, k, at::get_num_threads());
      dispatch_int8(types[p], [&](auto tag) {
        at::parallel_for(0, (n + prow - 1) / prow, 1, [&](int64_t p0, int64_t p1) {
          int8_panels<decltype(tag)>(b.data_ptr<uint8_t>(), b.stride(0), xp, yp + col[p], n_total, m, n, k, prow,
                                     p0, p1, g0, g1);
        });
      });
    }
  }
  if (lora) lora_add(y, x, *lora);
  return y;
}

at::Tensor linear_int8_parts(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                             const std::vector<int64_t>& types, int64_t k) {
  return linear_int8_parts_lora(x, blocks, types, k, nullptr);
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t k) {
  return linear_int8_parts(x, {blocks}, {type}, k);
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

}  // namespace lockstep
