// Paged decode attention on the CPU: one query row per lane, K and V read in place from their pages.
//
// The torch forms of decode attention gather every lane's pages into a padded copy first and then
// either run ~100 tiny batched matmuls a layer or let inductor fuse multiply-sums that it vectorizes
// poorly for this shape; this kernel reads each page once where it lies. One task per (lane, KV
// head): the lane's query heads of that group are scored against each K row, softmaxed, and their
// outputs accumulated from each V row, all in fp32 (vLLM's CPU paged attention has the same shape).
//
// Built at first use by pie_actors/gpu/cpu_kernels.py.
#include "vec.h"

#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

// Asks for one KV page of one head (`rows` rows of D values) to be brought into cache.
template <typename T, int64_t D>
inline void prefetch(const T* page, int64_t rows) {
  const char* p = reinterpret_cast<const char*>(page);
  for (int64_t i = 0; i < rows * D * int64_t(sizeof(T)); i += 64) __builtin_prefetch(p + i);
}

// D values of one row as fp32 vectors.
template <typename T, int64_t D>
inline void load_row(const T* row, Vec (&out)[D / kVec]) {
  for (int64_t c = 0; c < D / kVec; ++c) {
    if constexpr (std::is_same_v<T, float>) {
      out[c] = Vec::loadu(row + c * kVec);
    } else {
      at::vec::load_to_float<T>(row + c * kVec, out[c]);
    }
  }
}

template <typename T, int64_t D>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& pages, const at::Tensor& lengths, int64_t page_size, double scale,
            at::Tensor& out) {
  constexpr int64_t C = D / kVec;
  const int64_t batch = q.size(0), q_heads = q.size(1), kv_heads = k_cache.size(0);
  const int64_t group = q_heads / kv_heads, head_stride = k_cache.size(1) * D, max_pages = pages.size(1);
  const T* q_ptr = q.const_data_ptr<T>();
  const T* k_ptr = k_cache.const_data_ptr<T>();
  const T* v_ptr = v_cache.const_data_ptr<T>();
  const int64_t* page_ptr = pages.const_data_ptr<int64_t>();
  const int32_t* length_ptr = lengths.const_data_ptr<int32_t>();
  T* out_ptr = out.mutable_data_ptr<T>();

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<Vec> qs(group * C), acc(group * C);
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, n = length_ptr[b];
      const int64_t* table = page_ptr + b * max_pages;
      const T* k_head = k_ptr + h * head_stride;
      const T* v_head = v_ptr + h * head_stride;
      const int64_t first_row = (b * q_heads + h * group) * D;   // this group's query heads
      for (int64_t g = 0; g < group; ++g) {
        Vec row[C];
        load_row<T, D>(q_ptr + first_row + g * D, row);
        for (int64_t c = 0; c < C; ++c) qs[g * C + c] = row[c] * Vec(static_cast<float>(scale));
      }
      // scores[g * n + s] = q_g . k_s, reading K page by page
      scores.resize(group * n);
      for (int64_t s0 = 0; s0 < n; s0 += page_size) {
        const T* k = k_head + table[s0 / page_size] * page_size * D;
        // while this K page is scored, the next K page and this V page are on their way
        if (s0 + page_size < n)
          prefetch<T, D>(k_head + table[s0 / page_size + 1] * page_size * D, std::min(page_size, n - s0 - page_size));
        prefetch<T, D>(v_head + table[s0 / page_size] * page_size * D, std::min(page_size, n - s0));
        for (int64_t s = s0; s < std::min(s0 + page_size, n); ++s, k += D) {
          Vec row[C];
          load_row<T, D>(k, row);
          for (int64_t g = 0; g < group; ++g) {
            Vec dot = qs[g * C] * row[0];
            for (int64_t c = 1; c < C; ++c) dot = at::vec::fmadd(qs[g * C + c], row[c], dot);
            scores[g * n + s] = at::vec::vec_reduce_all<float>(std::plus<Vec>(), dot);
          }
        }
      }
      // softmax over each head's n scores
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        const float max = at::vec::reduce_all<float>(
            [](Vec a, Vec b) { return at::vec::maximum(a, b); }, sg, n);
        at::vec::map([max](Vec x) { return (x - Vec(max)).exp_u20(); }, sg, sg, n);
        const float inv_sum = 1.f / at::vec::reduce_all<float>(std::plus<Vec>(), sg, n);
        at::vec::map([inv_sum](Vec x) { return x * Vec(inv_sum); }, sg, sg, n);
      }
      // out_g = sum_s p[g, s] * v_s, reading V page by page
      std::fill(acc.begin(), acc.end(), Vec(0.f));
      for (int64_t s0 = 0; s0 < n; s0 += page_size) {
        const T* v = v_head + table[s0 / page_size] * page_size * D;
        for (int64_t s = s0; s < std::min(s0 + page_size, n); ++s, v += D) {
          Vec row[C];
          load_row<T, D>(v, row);
          for (int64_t g = 0; g < group; ++g) {
            const Vec p(scores[g * n + s]);
            for (int64_t c = 0; c < C; ++c) acc[g * C + c] = at::vec::fmadd(p, row[c], acc[g * C + c]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out_ptr + first_row + g * D;
        for (int64_t c = 0; c < C; ++c) {
          float values[kVec];
          acc[g * C + c].store(values);
          for (int64_t i = 0; i < kVec; ++i) o[c * kVec + i] = static_cast<T>(values[i]);
        }
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& pages, const at::Tensor& lengths, int64_t page_size,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "q must be [batch, q_heads, head_dim] and the caches [kv_heads, slots, head_dim]");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(2) == k_cache.size(2),
              "q heads must be a multiple of the KV heads, with the same head_dim");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(pages.scalar_type() == at::kLong && lengths.scalar_type() == at::kInt &&
                  pages.dim() == 2 && pages.size(0) == q.size(0) && lengths.numel() == q.size(0),
              "pages must be int64 [batch, max_pages] and lengths int32 [batch]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  const auto qc = q.contiguous(), pc = pages.contiguous(), lc = lengths.contiguous();
  // The kernel reads raw memory: every page it will read must lie in the pool.
  const int64_t pool_pages = k_cache.size(1) / page_size, max_pages = pc.size(1);
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t n = lc.const_data_ptr<int32_t>()[b], used = (n + page_size - 1) / page_size;
    TORCH_CHECK(n > 0 && used <= max_pages, "paged_decode_attention: lane ", b, " attends ", n,
                " slots, its page table covers ", max_pages * page_size);
    for (int64_t i = 0; i < used; ++i) {
      const int64_t page = pc.const_data_ptr<int64_t>()[b * max_pages + i];
      TORCH_CHECK(page >= 0 && page < pool_pages, "paged_decode_attention: lane ", b, " reads page ", page,
                  ", outside the pool of ", pool_pages, " pages");
    }
  }
  auto out = at::empty_like(qc);
  const int64_t head_dim = q.size(2);
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    if (head_dim == 64) {
      decode<T, 64>(qc, k_cache, v_cache, pc, lc, page_size, scale, out);
    } else {
      TORCH_CHECK(head_dim == 128, "paged_decode_attention: head_dim ", head_dim, " is not 64 or 128");
      decode<T, 128>(qc, k_cache, v_cache, pc, lc, page_size, scale, out);
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pie_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor pages, Tensor lengths, "
        "int page_size, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(pie_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
