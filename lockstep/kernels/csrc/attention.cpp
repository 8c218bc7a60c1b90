#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <type_traits>
#include <vector>

#include "blocks.h"
#include "ops.h"

namespace lockstep {
// ---------------------------------------------------------------- decode attention over the KV pool
// One query per request against that request's keys, read in place from the pool by slot (no gather
// copy). Work item = (request, KV head, chunk of kChunk keys): the query heads sharing the KV head are
// computed together, so each K and V row comes from memory once. Chunks are cut from the request's own visible
// key range, so how a request's numbers are summed depends only on its keys, never on the batch,
// the thread count or the variant:
//   score = reduce32 of a 32-lane fma dot product (the linear kernels' lane order), * scaling,
//           then softcap * tanh(score / softcap) when softcapped;
//   per chunk: m = max score, e = exp(score - m) (exp8 below), l = sum of e (8 lanes, in key
//           order, then a fixed tree), acc = sum of e * v in increasing key order (fma);
//   combined over chunks in chunk order: out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c.
// exp8 and the lane trees are the same instructions in both builds, so AVX2 and AVX-512 agree bitwise.
// K/V are float32, float16 or bfloat16 in the pool (--kv-cache-dtype); a 16-bit element widens to float32
// exactly on load, so the arithmetic above runs on the stored values, and a 16-bit pool gives the bits of
// a float32 pool holding the same (rounded) values.

// one K/V element row's 16 lanes from the pool as float32 (exact for every stored type)
inline V kv_load(const float* p) { return vload(p); }
inline V kv_load(const at::Half* p) { return from_f16(reinterpret_cast<const uint8_t*>(p)); }
inline V kv_load(const at::BFloat16* p) { return from_bf16(reinterpret_cast<const uint8_t*>(p)); }

constexpr int64_t kChunk = 256;  // keys per work item: long contexts split across threads
constexpr int64_t kRowsPerThread = 16;  // from this many query rows per thread, tasks are whole rows
constexpr int64_t kTasksPerThread = 8;  // ... cut this many per thread, for balance

// exp(x) for x <= 0 on 8 lanes (Cephes' expf: exponent split with a two-part ln 2, degree-6
// polynomial); x below -87 gives about 1e-38 rather than 0, which no softmax can tell apart.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

inline float sum8(__m256 h) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

#ifdef LOCKSTEP_AVX512
constexpr int kDotHeads = 4;  // query heads dotted with one key row at a time (accumulators in registers)
#else
constexpr int kDotHeads = 2;
#endif

// s[h * stride] = dot(q_h, k) for NH heads whose rows are qd apart; d is a multiple of 16 (element i
// goes to lane i % 32)
template <int NH, class E>
inline void dot_heads(const float* q, int64_t qd, const E* k, int64_t d, float* s, int64_t stride) {
  V acc[NH][2];
  UNROLL for (int h = 0; h < NH; ++h) acc[h][0] = acc[h][1] = vzero();
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    const V k0 = kv_load(k + i), k1 = kv_load(k + i + 16);
    UNROLL for (int h = 0; h < NH; ++h) {
      acc[h][0] = vfma(vload(q + h * qd + i), k0, acc[h][0]);
      acc[h][1] = vfma(vload(q + h * qd + i + 16), k1, acc[h][1]);
    }
  }
  if (i < d) {
    const V k0 = kv_load(k + i);
    UNROLL for (int h = 0; h < NH; ++h) acc[h][0] = vfma(vload(q + h * qd + i), k0, acc[h][0]);
  }
  UNROLL for (int h = 0; h < NH; ++h) s[h * stride] = reduce32(acc[h][0], acc[h][1]);
}

// K/V rows are scattered over the pool by slot, where the hardware prefetcher cannot follow: ask for
// the row kAhead keys on while working on this one. Where the slots run on in order (a prompt's
// keys, allocated together) the prefetcher does follow, and the 16 extra instructions per key only
// cost: a 2,048-row prefill layer took 0.78-0.96x the time without them on Zen 4 (three A/B pairs).
constexpr int64_t kAhead = 2;
template <class E>
inline void prefetch_row(const E* p, int64_t d) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < d * static_cast<int64_t>(sizeof(E)); i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}
// the row of key j + kAhead (at base + slot * row) while key j's is read, unless its slot follows in order
template <class E>
inline void fetch_ahead(const E* base, const int64_t* slots, int64_t j, int64_t n, int64_t row, int64_t d) {
  if (j + kAhead < n && slots[j + kAhead] != slots[j] + kAhead) prefetch_row(base + slots[j + kAhead] * row, d);
}

struct DecodeShape {
  int64_t heads, kv_heads, group, dim;  // group = heads / kv_heads
  float scaling, softcap;               // softcap 0: off
};

#ifdef LOCKSTEP_AVX512
constexpr int kPvHeads = 4;  // query heads whose sums share each V load (accumulators in registers)
#else
constexpr int kPvHeads = 2;
#endif

// acc[h][c .. c + 16 W) = sum_j p[h][j] * v_j[c ..] for NH heads (p rows np apart, acc rows d apart),
// keys in increasing order
template <int NH, int W, class E>
inline void pv_heads(const float* p, int64_t np, const E* vrow0, int64_t row, const int64_t* slots,
                     int64_t n, int64_t c, int64_t d, float* o, bool fetch) {
  V a[NH][W];
  UNROLL for (int h = 0; h < NH; ++h) UNROLL for (int w = 0; w < W; ++w) a[h][w] = vzero();
  for (int64_t j = 0; j < n; ++j) {
    if (fetch) fetch_ahead(vrow0, slots, j, n, row, d);
    const E* v = vrow0 + slots[j] * row + c;
    V vv[W];
    UNROLL for (int w = 0; w < W; ++w) vv[w] = kv_load(v + 16 * w);
    UNROLL for (int h = 0; h < NH; ++h) {
      const V s = vset1(p[h * np + j]);
      UNROLL for (int w = 0; w < W; ++w) a[h][w] = vfma(s, vv[w], a[h][w]);
    }
  }
  UNROLL for (int h = 0; h < NH; ++h) UNROLL for (int w = 0; w < W; ++w) vstore(o + h * d + c + 16 * w, a[h][w]);
}

template <int W, class E>
inline void pv_slice(const DecodeShape& sh, const float* scores, int64_t np, const E* vbuf,
                     const int64_t* slots, int64_t n, int64_t kvh, int64_t c, float* acc, bool fetch) {
  const int64_t d = sh.dim, g = sh.group, row = sh.kv_heads * d;
  const E* vrow0 = vbuf + kvh * d;
  int64_t h = 0;
  // fours (AVX-512), then pairs, then one: a group of 2 or 6 heads keeps sharing its V loads by pairs
  for (; h + kPvHeads <= g; h += kPvHeads)
    pv_heads<kPvHeads, W>(scores + h * np, np, vrow0, row, slots, n, c, d, acc + h * d, fetch && h == 0);
  for (; h + 2 <= g; h += 2)
    pv_heads<2, W>(scores + h * np, np, vrow0, row, slots, n, c, d, acc + h * d, fetch && h == 0);
  if (h < g) pv_heads<1, W>(scores + h * np, np, vrow0, row, slots, n, c, d, acc + h * d, fetch && h == 0);
}

// One work item: keys kv_slots[first .. first + n) (n <= kChunk) for query heads [g0, g0 + group) of KV
// head `kvh`. Writes m[h], l[h] and acc[h][dim] (unnormalized) for each head of the group.
template <class E>
void attend_chunk(const DecodeShape& sh, const float* q, const E* kbuf, const E* vbuf,
                  const int64_t* slots, int64_t n, int64_t kvh, float* scores, float* m, float* l,
                  float* acc) {
  const int64_t d = sh.dim, g = sh.group, row = sh.kv_heads * d, np = (n + 7) / 8 * 8;
  for (int64_t j = 0; j < n; ++j) {
    fetch_ahead(kbuf + kvh * d, slots, j, n, row, d);
    const E* k = kbuf + slots[j] * row + kvh * d;
    int64_t h = 0;
    for (; h + kDotHeads <= g; h += kDotHeads) dot_heads<kDotHeads>(q + h * d, d, k, d, scores + h * np + j, np);
    for (; h < g; ++h) dot_heads<1>(q + h * d, d, k, d, scores + h * np + j, np);
  }
  for (int64_t h = 0; h < g; ++h) {
    float* s = scores + h * np;
    float mx = -INFINITY;
    int64_t j = 0;
    if (sh.softcap == 0.0f) {  // 16 lanes at once: the same products, and a maximum is a maximum in any order
      V m16 = vset1(-INFINITY);
      for (; j + 16 <= n; j += 16) {
        const V x = vmul(vload(s + j), vset1(sh.scaling));
        vstore(s + j, x);
        m16 = vmax(x, m16);  // (x > m) ? x : m, as std::max(m, x) below
      }
      alignas(64) float lanes[16];
      vstore(lanes, m16);
      for (float x : lanes) mx = std::max(mx, x);
    }
    for (; j < n; ++j) {
      float x = s[j] * sh.scaling;
      if (sh.softcap > 0.0f) x = sh.softcap * std::tanh(x / sh.softcap);
      s[j] = x;
      mx = std::max(mx, x);
    }
    __m256 sum = _mm256_setzero_ps();
    const __m256 vmx = _mm256_set1_ps(mx);
    for (j = 0; j < np; j += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
      if (j + 8 > n) {  // the padding lanes past n count as 0
        const __m256 idx = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(j)),
                                         _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
        e = _mm256_and_ps(e, _mm256_cmp_ps(idx, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ));
      }
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    m[h] = mx;
    l[h] = sum8(sum);
  }
  // acc[h] = sum_j e[h][j] * v_j, keys in increasing order, one fma per key and element. Elements go in
  // slices of 64 or 32 (heads in fours or pairs) whose sums stay in registers over all the chunk's
  // keys: the same fmas in the same order per element as a pass per key over whole rows, without
  // storing every element's sum back per key (which bound prefill's attention). The first slice's
  // pass fetches each V row ahead; the later slices find it in L1/L2 (a chunk's rows: at most kChunk x
  // Hkv x D floats).
  int64_t c = 0;
#ifdef LOCKSTEP_AVX512
  for (; c + 64 <= d; c += 64) pv_slice<4, E>(sh, scores, np, vbuf, slots, n, kvh, c, acc, c == 0);
#endif
  for (; c + 32 <= d; c += 32) pv_slice<2, E>(sh, scores, np, vbuf, slots, n, kvh, c, acc, c == 0);
  if (c < d) pv_slice<1, E>(sh, scores, np, vbuf, slots, n, kvh, c, acc, c == 0);
}

// q [R, H, D]; k/v buffers [S, Hkv, D]; request r reads slots kv_slots[start[r] .. start[r] + len[r]),
// the last `window` of them when window > 0 -> out [R, H * D]
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& kv_slots, const at::Tensor& start, const at::Tensor& len,
                            double scaling, double softcap, int64_t window) {
  // q may be a row-strided view (the q part of a fused qkv output): each row's heads contiguous
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  q.device().is_cpu(),
              "q must be float32 [R, H, D] on the CPU, each row's H x D contiguous");
  const at::ScalarType kv_type = k_buf.scalar_type();
  TORCH_CHECK((kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16) &&
                  v_buf.scalar_type() == kv_type && k_buf.dim() == 3 && k_buf.is_contiguous() &&
                  v_buf.is_contiguous() && k_buf.sizes() == v_buf.sizes() && k_buf.device().is_cpu() &&
                  v_buf.device().is_cpu(),
              "K and V buffers must be contiguous [S, Hkv, D] of one shape and one type (float32, float16 or "
              "bfloat16) on the CPU");
  for (const at::Tensor* t : {&kv_slots, &start, &len})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "slots, starts and lengths must be contiguous int64 vectors");
  const int64_t r_n = q.size(0), h_n = q.size(1), d = q.size(2), kvh_n = k_buf.size(1), s_n = k_buf.size(0);
  TORCH_CHECK(k_buf.size(2) == d && d % 16 == 0, "head dim must match and be a multiple of 16, got ", d);
  TORCH_CHECK(kvh_n > 0 && h_n % kvh_n == 0, "query heads ", h_n, " not a multiple of KV heads ", kvh_n);
  TORCH_CHECK(start.size(0) == r_n && len.size(0) == r_n, "one start and length per query row");
  const int64_t* sp = start.data_ptr<int64_t>();
  const int64_t* lp = len.data_ptr<int64_t>();
  const int64_t* slots = kv_slots.data_ptr<int64_t>();
  const int64_t n_slots = kv_slots.size(0);
  // per request: first visible key (its window) and first work item
  std::vector<int64_t> lo(r_n), item0(r_n + 1, 0);
  for (int64_t r = 0; r < r_n; ++r) {
    TORCH_CHECK(lp[r] > 0 && sp[r] >= 0 && sp[r] + lp[r] <= n_slots, "request ", r, " keys out of range");
    lo[r] = window > 0 ? std::max<int64_t>(0, lp[r] - window) : 0;
    for (int64_t j = sp[r] + lo[r]; j < sp[r] + lp[r]; ++j)
      TORCH_CHECK(slots[j] >= 0 && slots[j] < s_n, "KV slot ", slots[j], " out of range [0, ", s_n, ")");
    item0[r + 1] = item0[r] + (lp[r] - lo[r] + kChunk - 1) / kChunk * kvh_n;
  }
  const DecodeShape sh{h_n, kvh_n, h_n / kvh_n, d, static_cast<float>(scaling), static_cast<float>(softcap)};
  at::Tensor out = at::empty({r_n, h_n * d}, q.options());
  if (r_n == 0) return out;
  const int64_t items = item0[r_n], g = sh.group, item_floats = g * (d + 2);
  const float* qp = q.data_ptr<float>();
  const int64_t q_rs = q.stride(0);
  const void* kb = k_buf.data_ptr();
  const void* vb = v_buf.data_ptr();
  float* op = out.data_ptr<float>();
  // item `local` of row r: KV head local % kvh_n, chunk local / kvh_n; its m, l, acc go to `pp`
  auto attend = [&](int64_t r, int64_t local, float* scores, float* pp) {
    const int64_t kvh = local % kvh_n, c = local / kvh_n;
    const int64_t first = sp[r] + lo[r] + c * kChunk;
    const int64_t n = std::min(kChunk, sp[r] + lp[r] - first);
    const float* qr = qp + r * q_rs + kvh * g * d;
    auto go = [&](auto* e) {  // e: a null pointer of the pool's element type
      using E = std::remove_const_t<std::remove_pointer_t<decltype(e)>>;
      attend_chunk(sh, qr, static_cast<const E*>(kb), static_cast<const E*>(vb), slots + first, n, kvh, scores, pp,
                   pp + g, pp + 2 * g);
    };
    if (kv_type == at::kHalf) go(static_cast<const at::Half*>(nullptr));
    else if (kv_type == at::kBFloat16) go(static_cast<const at::BFloat16*>(nullptr));
    else go(static_cast<const float*>(nullptr));
  };
  // row r's output from its items at `rp` (in item order), chunks combined in chunk order
  auto merge = [&](int64_t r, const float* rp) {
    const int64_t chunks = (item0[r + 1] - item0[r]) / kvh_n;
    for (int64_t kvh = 0; kvh < kvh_n; ++kvh)
      for (int64_t h = 0; h < g; ++h) {
        float* o = op + (r * h_n + kvh * g + h) * d;
        float mx = -INFINITY;
        for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, rp[(c * kvh_n + kvh) * item_floats + h]);
        float l = 0.0f;
        for (int64_t x = 0; x < d; ++x) o[x] = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) {
          const float* pp = rp + (c * kvh_n + kvh) * item_floats;
          const float f = chunks == 1 ? 1.0f : exp1(pp[h] - mx);
          l += f * pp[g + h];
          const float* a = pp + 2 * g + h * d;
          for (int64_t x = 0; x < d; x += 16) vstore(o + x, vfma(vset1(f), vload(a + x), vload(o + x)));
        }
        const V inv = vset1(1.0f / l);
        for (int64_t x = 0; x < d; x += 16) vstore(o + x, vmul(vload(o + x), inv));
      }
  };
  const int64_t threads = at::get_num_threads();
  if (r_n >= kRowsPerThread * threads) {
    // Many rows (prefill, large batches): a task is a run of whole rows, each row's items computed
    // and merged at once in a small buffer (a shared one is tens of MB at 2,048 prefill rows: its
    // writes and the merge's reads went to DRAM, and the merge ran on one thread). Tasks are cut by
    // item count, so a causal prefill's long rows do not all land on the last thread. Each row's
    // items and merge are the same arithmetic as below: the same bits.
    const int64_t tasks = std::min(r_n, threads * kTasksPerThread);
    std::vector<int64_t> row0(tasks + 1, r_n);
    row0[0] = 0;
    for (int64_t t = 1; t < tasks; ++t)
      row0[t] = std::lower_bound(item0.begin(), item0.end(), items * t / tasks) - item0.begin();
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> scores(static_cast<size_t>(g * kChunk)), rowpart;
      for (int64_t r = row0[t0]; r < row0[t1]; ++r) {
        const int64_t n_items = item0[r + 1] - item0[r];
        rowpart.resize(static_cast<size_t>(n_items * item_floats));
        for (int64_t local = 0; local < n_items; ++local)
          attend(r, local, scores.data(), rowpart.data() + local * item_floats);
        merge(r, rowpart.data());
      }
    });
    return out;
  }
  // Few rows (decode): work items are (row, KV head, chunk), so one long row splits across threads
  std::vector<float> part(static_cast<size_t>(items * item_floats));
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(static_cast<size_t>(g * kChunk));
    int64_t r = std::upper_bound(item0.begin(), item0.end(), i0) - item0.begin() - 1;
    for (int64_t i = i0; i < i1; ++i) {
      while (i >= item0[r + 1]) ++r;
      attend(r, i - item0[r], scores.data(), part.data() + i * item_floats);
    }
  });
  // the merge is ~g * d flops per chunk: on the calling thread, a fork-join would cost more
  for (int64_t r = 0; r < r_n; ++r) merge(r, part.data() + item0[r] * item_floats);
  return out;
}

}  // namespace lockstep
