// What raw log-probabilities need of a batch of logits rows, without writing a [rows, vocab] log-softmax:
// per row its log-sum-exp and its k largest logits (the log-probabilities are logit - lse). Two passes
// over a row: the maximum of every 64-value chunk (the row's maximum is theirs), then the sum of
// exp(x - max) (vectorized: -ffast-math lets GCC call glibc's vector expf); the k largest values lie in
// the k chunks with the largest maxima, so only those k * 64 values are sorted. torch's log_softmax +
// chunked top-k took 1.54 ms for SmolLM2's [32, 49152] fp32 logits, this 0.65 ms (one thread, AMD EPYC
// with AVX-512; bench/sampler_cost.py measures it inside a sampling step). Bound in cpu_ops.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

constexpr int64_t CHUNK = 64;

inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16); }

template <typename T>
void one_row(const T* x, int64_t vocab, int64_t k, std::vector<float>& cmax, std::vector<int64_t>& order,
             std::vector<int64_t>& cand, float* lse, float* top_v, int64_t* top_i) {
  const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
  float row_max = std::numeric_limits<float>::lowest();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * CHUNK, hi = std::min(vocab, lo + CHUNK);
    float m = std::numeric_limits<float>::lowest();
#pragma omp simd reduction(max : m)
    for (int64_t j = lo; j < hi; ++j) m = std::max(m, as_float(x[j]));
    cmax[c] = m;
    row_max = std::max(row_max, m);
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < vocab; ++j) sum += std::exp(as_float(x[j]) - row_max);
  *lse = row_max + std::log(sum);
  if (k == 0) return;
  // Ties go to the lower index, in the chunk choice and among the values.
  std::iota(order.begin(), order.end(), 0);
  const int64_t kc = std::min(k, chunks);
  std::partial_sort(order.begin(), order.begin() + kc, order.end(),
                    [&](int64_t a, int64_t b) { return cmax[a] > cmax[b] || (cmax[a] == cmax[b] && a < b); });
  cand.clear();
  for (int64_t i = 0; i < kc; ++i) {
    const int64_t lo = order[i] * CHUNK, hi = std::min(vocab, lo + CHUNK);
    for (int64_t j = lo; j < hi; ++j) cand.push_back(j);
  }
  std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), [&](int64_t a, int64_t b) {
    const float va = as_float(x[a]), vb = as_float(x[b]);
    return va > vb || (va == vb && a < b);
  });
  for (int64_t i = 0; i < k; ++i) {
    top_i[i] = cand[i];
    top_v[i] = as_float(x[cand[i]]);
  }
}

}  // namespace

// (lse [rows] fp32, the k largest logits [rows, k] fp32 largest first, their indices [rows, k] int64) of
// float32 or bfloat16 logits [rows, vocab] (contiguous last dim).
std::vector<torch::Tensor> row_lse_topk(torch::Tensor logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "row_lse_topk: expects [rows, vocab] with a contiguous last dim");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(vocab > 0 && k >= 0 && k <= vocab, "row_lse_topk: k must be in [0, vocab]");
  auto lse = torch::empty({rows}, logits.options().dtype(torch::kFloat32));
  auto top_v = torch::empty({rows, k}, logits.options().dtype(torch::kFloat32));
  auto top_i = torch::empty({rows, k}, logits.options().dtype(torch::kInt64));
  float* lp = lse.data_ptr<float>();
  float* vp = top_v.data_ptr<float>();
  int64_t* ip = top_i.data_ptr<int64_t>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = logits.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
      std::vector<float> cmax(chunks);
      std::vector<int64_t> order(chunks);
      std::vector<int64_t> cand;
      cand.reserve(std::min(k, chunks) * CHUNK);
      for (int64_t r = begin; r < end; ++r)
        one_row<T>(xp + r * stride, vocab, k, cmax, order, cand, lp + r, vp + r * k, ip + r * k);
    });
  };
  if (logits.scalar_type() == torch::kFloat32) {
    run(float{});
  } else if (logits.scalar_type() == torch::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "row_lse_topk supports float32 and bfloat16");
  }
  return {lse, top_v, top_i};
}
