// y = x W^T (+ b) for a few rows of x, with W row-major [out, in] as checkpoints store it, float32.
//
// Decode batches of 2-32 lanes and short prefills are matrix products of a few rows against weights
// far larger than the caches, so their cost is reading the weights once. MKL's GEMM does that for one
// or two rows, but from four rows on its transposed-B path falls off a cliff here (qkv at 4 rows:
// 509 µs against 124 at one; bench/RESULTS.md, "Linear layers: a few rows"). This kernel streams W
// once in the order it lies: each task takes kN consecutive weight rows and dots them with every row
// of x, kM rows at a time, so the weight rows stay in L1 while x (a few KB per row) stays in L1 or
// L2. The first kM
// rows, which read the weight rows from memory, ask for the next task's rows ahead: without that,
// 2-8 rows ran 1.1-1.3x slower. Past a few dozen rows the product is bound by arithmetic, where the
// BLAS's packed GEMM is better (cpu_kernels.LINEAR_MAX_ROWS).
//
// Built at first use by pie_actors/gpu/kernels/cpu_kernels.py (with paged_decode.cpp).
#include "vec.h"

#include <ATen/cpu/vec/functional.h>

#include <optional>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
// A tile: kM rows of x against kN rows of W, kM * kN accumulators in vector registers, of which AVX-512
// has 32 and AVX2 16 (4 x 4 and 4 x 3 measured best of 2-6 x 3-8 on each).
constexpr int64_t kM = 4, kN = kVec >= 16 ? 4 : 3;

// The M x N (kM x kN, or fewer at the edges) dot products of rows x[0..M) and w[0..N), each `k` long;
// with Prefetch, the same columns of the next N weight rows are asked for as these are read (past the
// last rows too: a prefetch never faults).
template <int M, int N, bool Prefetch>
inline void tile(const float* x, const float* w, int64_t k, float (&out)[kM][kN]) {
  Vec acc[M][N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) acc[i][j] = Vec(0.f);
  int64_t c = 0;
  for (; c + kVec <= k; c += kVec) {
    Vec wv[N];
    if constexpr (Prefetch)
      for (int j = 0; j < N; ++j) __builtin_prefetch(w + (j + N) * k + c);
    for (int j = 0; j < N; ++j) wv[j] = Vec::loadu(w + j * k + c);
    for (int i = 0; i < M; ++i) {
      const Vec xv = Vec::loadu(x + i * k + c);
      for (int j = 0; j < N; ++j) acc[i][j] = at::vec::fmadd(xv, wv[j], acc[i][j]);
    }
  }
  if (c < k) {                      // a row length that is not a whole number of vectors
    const int64_t tail = k - c;
    Vec wv[N];
    for (int j = 0; j < N; ++j) wv[j] = Vec::loadu(w + j * k + c, tail);
    for (int i = 0; i < M; ++i) {
      const Vec xv = Vec::loadu(x + i * k + c, tail);
      for (int j = 0; j < N; ++j) acc[i][j] = at::vec::fmadd(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j)
      out[i][j] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[i][j]);
}

// Picks the tile's compiled size for the rows left at an edge.
template <int M, bool Prefetch>
inline void tile_n(int n, const float* x, const float* w, int64_t k, float (&out)[kM][kN]) {
  switch (n) {
    case 4: if constexpr (kN >= 4) tile<M, 4, Prefetch>(x, w, k, out); break;
    case 3: tile<M, 3, Prefetch>(x, w, k, out); break;
    case 2: tile<M, 2, Prefetch>(x, w, k, out); break;
    default: tile<M, 1, Prefetch>(x, w, k, out); break;
  }
}

template <bool Prefetch>
inline void tile_mn(int m, int n, const float* x, const float* w, int64_t k, float (&out)[kM][kN]) {
  switch (m) {
    case 4: tile_n<4, Prefetch>(n, x, w, k, out); break;
    case 3: tile_n<3, Prefetch>(n, x, w, k, out); break;
    case 2: tile_n<2, Prefetch>(n, x, w, k, out); break;
    default: tile_n<1, Prefetch>(n, x, w, k, out); break;
  }
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "linear_rows: x and weight must be float32");
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
              "linear_rows: x [..., in] and weight [out, in] do not match: ", x.sizes(), " and ", weight.sizes());
  const int64_t k = weight.size(1), n = weight.size(0);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n),
              "linear_rows: bias must be float32 [out]");
  const auto xc = x.reshape({-1, k}).contiguous();
  const auto wc = weight.contiguous();
  const int64_t m = xc.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  auto y = at::empty({m, n}, x.options());
  const float* xp = xc.const_data_ptr<float>();
  const float* wp = wc.const_data_ptr<float>();
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  const float* bp = bias ? bc.const_data_ptr<float>() : nullptr;
  float* yp = y.mutable_data_ptr<float>();
  // One task is kN weight rows against all of x; the weight rows are what is read from memory, so
  // tasks split W into contiguous runs, one per thread.
  const int64_t tasks = (n + kN - 1) / kN;
  at::parallel_for(0, tasks, 16, [&](int64_t begin, int64_t end) {
    float out[kM][kN];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kN;
      const int nn = static_cast<int>(std::min(kN, n - n0));
      for (int64_t m0 = 0; m0 < m; m0 += kM) {
        const int mm = static_cast<int>(std::min(kM, m - m0));
        if (m0 == 0)        // the weight rows come from memory: ask for the next task's
          tile_mn<true>(mm, nn, xp + m0 * k, wp + n0 * k, k, out);
        else
          tile_mn<false>(mm, nn, xp + m0 * k, wp + n0 * k, k, out);
        for (int i = 0; i < mm; ++i)
          for (int j = 0; j < nn; ++j) yp[(m0 + i) * n + n0 + j] = out[i][j] + (bp ? bp[n0 + j] : 0.f);
      }
    }
  });
  return y.view(out_sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pie_cpu, m) { m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(pie_cpu, CPU, m) { m.impl("linear_rows", &linear_rows); }
