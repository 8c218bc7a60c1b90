#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "blocks.h"
#include "ops.h"

namespace lockstep {
// ---------------------------------------------------------------- row argmax (greedy sampling)
// ids[r] = index of the first maximum of row r, as torch's max(dim) and argmax give it: a NaN counts
// as the maximum (the first NaN wins). Exact whatever the split, so rows are cut into segments that
// threads scan independently, then merged in segment order (an earlier segment wins a tie).

constexpr int64_t kArgmaxSegment = 32768;

struct ArgmaxPart {
  float value;
  int64_t index;
  bool nan;
};

ArgmaxPart argmax_segment(const float* x, int64_t n) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  __m256 unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    mx = _mm256_max_ps(mx, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  bool nan = _mm256_movemask_ps(unordered) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float best = -INFINITY;
  for (float f : lanes) best = std::max(best, f);
  for (int64_t t = i; t < n; ++t) {
    nan = nan || std::isnan(x[t]);
    best = std::max(best, x[t]);
  }
  if (nan) {
    for (int64_t t = 0; t < n; ++t)
      if (std::isnan(x[t])) return {x[t], t, true};
  }
  const __m256 target = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (mask) return {best, i + __builtin_ctz(static_cast<unsigned>(mask)), false};
  }
  for (int64_t t = i; t < n; ++t)
    if (x[t] == best) return {best, t, false};
  return {best, 0, false};  // every element -inf: torch answers 0 as well
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(),
              "argmax takes float32 [B, V] rows, contiguous within a row, on the CPU");
  const int64_t b = x.size(0), v = x.size(1), rs = x.stride(0);
  TORCH_CHECK(v > 0, "argmax of an empty row");
  at::Tensor ids = at::empty({b}, x.options().dtype(at::kLong));
  const int64_t segs = (v + kArgmaxSegment - 1) / kArgmaxSegment;
  std::vector<ArgmaxPart> parts(static_cast<size_t>(b * segs));
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, b * segs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / segs, s0 = p % segs * kArgmaxSegment;
      ArgmaxPart part = argmax_segment(xp + r * rs + s0, std::min(kArgmaxSegment, v - s0));
      part.index += s0;
      parts[p] = part;
    }
  });
  int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    ArgmaxPart best = parts[r * segs];
    for (int64_t s = 1; s < segs && !best.nan; ++s) {
      const ArgmaxPart& p = parts[r * segs + s];
      if (p.nan || p.value > best.value) best = p;
    }
    ip[r] = best.index;
  }
  return ids;
}

}  // namespace lockstep
