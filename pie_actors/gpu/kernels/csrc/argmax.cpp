// Greedy sampling's argmax over each row of the logits, vectorized (built with paged_decode.cpp).
//
// torch's max(dim) walks a 49,152-wide row an element at a time (~1.2 ms for a batch-32 step's
// fp32 logits here, 4% of the step); this keeps running maxima and their indices per vector
// lane, so a row costs about what reading it costs. The result matches torch.max(dim).indices:
// the first maximum, or the first NaN when a row has one.
#include "vec.h"

#include <algorithm>
#include <cmath>

namespace {

using Vec = at::vec::Vectorized<float>;
using IVec = at::vec::Vectorized<int32_t>;
constexpr int64_t kVec = Vec::size();

// Four running maxima per vector lane (the compare-and-blend chain of one would bound the loop), each
// with the index of its first occurrence; the answer is the largest of them, the earliest on ties.
int64_t row_argmax(const float* x, int64_t n) {
  constexpr int64_t kChains = 4, kStride = kChains * kVec;
  int64_t best = 0, i = 0;
  if (n >= kStride) {
    Vec max[kChains], nan(0.f);
    IVec at[kChains];
    for (int64_t c = 0; c < kChains; ++c) {
      max[c] = Vec::loadu(x + c * kVec);
      at[c] = IVec::arange(static_cast<int32_t>(c * kVec), 1);
      nan = nan | max[c].isnan();
    }
    const IVec step(static_cast<int32_t>(kStride));
    IVec idx[kChains];                     // the indices of the vectors just loaded
    std::copy(at, at + kChains, idx);
    for (i = kStride; i + kStride <= n; i += kStride) {
      for (int64_t c = 0; c < kChains; ++c) {
        const Vec v = Vec::loadu(x + i + c * kVec);
        idx[c] = idx[c] + step;
        const Vec greater = v > max[c];    // strict: a lane keeps its first maximum
        max[c] = Vec::blendv(max[c], v, greater);
        at[c] = IVec::blendv(at[c], idx[c], at::vec::cast<int32_t>(greater));
        nan = nan | v.isnan();
      }
    }
    float nan_lanes[kVec];
    nan.store(nan_lanes);                  // all-ones bits (a NaN) where a lane saw one
    for (int64_t l = 0; l < kVec; ++l)
      if (nan_lanes[l] != 0.f) i = 0;      // rare: rescan below, where the first NaN wins
    if (i > 0) {
      for (int64_t c = 0; c < kChains; ++c) {
        int32_t indices[kVec];
        at[c].store(indices);
        for (int64_t l = 0; l < kVec; ++l)
          if (x[indices[l]] > x[best] || (x[indices[l]] == x[best] && indices[l] < best)) best = indices[l];
      }
    }
  }
  for (; i < n; ++i) {                     // the tail, short rows, rows with a NaN
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: logits must be non-empty float32 [rows, vocab]");
  TORCH_CHECK(logits.size(1) < (int64_t(1) << 31), "argmax_rows: rows wider than int32");
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.const_data_ptr<float>();
  int64_t* result = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = row_argmax(data + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pie_cpu, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }
TORCH_LIBRARY_IMPL(pie_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
