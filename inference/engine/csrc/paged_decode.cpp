// Paged decode attention for the CPU: one query token per sequence attends to the keys and values in
// its own KV blocks, read in place from the paged cache (no gather into a padded batch, no mask, no
// batched-matmul launch per sequence and head). The new token's K/V is written into its slot first.
//
// Layout (see kv_cache.py): `rows` is the cache as `[rows, kv_heads, head_dim]`; `slots[i, t]` is the
// layer-0 K row of sequence i's token t; layer l adds `layer_offset`, the V row is `v_offset` further.
// Scores, softmax and the weighted sum are computed in fp32 whatever the storage dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  // bf16 is the upper half of an fp32: a shift, which the compiler vectorizes (c10's conversion is not).
  return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16);
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Each of `rows` rows of `len` scores becomes its softmax, in place.
inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t h = 0; h < rows; ++h) {
    float* s = scores + h * len;
    float mx = s[0];
    for (int64_t t = 1; t < len; ++t) mx = s[t] > mx ? s[t] : mx;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - mx);
      sum += s[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
}

// Rows this many tokens ahead are prefetched: a sequence's blocks are scattered over the pool, so the
// hardware prefetchers only see short runs of 16 tokens (measured on SmolLM2's shapes: the loads were
// most of the kernel's time before).
constexpr int64_t PREFETCH_AHEAD = 8;

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 on a CPU with AVX512-BF16, one sequence (all its heads): q·k as `vdpbf16ps` on bf16 pairs (q is
// rounded to bf16 after scaling, as the torch path's bf16 matmul does); each token's K row of all KV
// heads is one contiguous read; values are widened to fp32 and accumulated in registers, per KV head.
template <int HD>
void decode_seq_bf16(const c10::BFloat16* q, int64_t q1, const c10::BFloat16* cache, const int64_t* srow,
                     int64_t len, int64_t layer_offset, int64_t v_offset, int64_t kv_heads, int64_t heads,
                     float scale, float* scores, c10::BFloat16* out) {
  constexpr int C = HD / 32;  // 32 bf16 per 512-bit register
  constexpr int F = HD / 16;  // 16 fp32 per register
  constexpr int G_MAX = 8;
  const int64_t group = heads / kv_heads, row_elems = kv_heads * HD, row_bytes = row_elems * 2;
  alignas(64) uint16_t qb[64 * HD];  // heads <= 64 (checked by the caller)
  for (int64_t h = 0; h < heads; ++h)
    for (int d = 0; d < HD; ++d) qb[h * HD + d] = c10::BFloat16(to_float(q[h * q1 + d]) * scale).x;
  auto k_row = [&](int64_t t) { return cache + (srow[t] + layer_offset) * row_elems; };
  auto v_row = [&](int64_t t) { return cache + (srow[t] + layer_offset + v_offset) * row_elems; };
  for (int64_t t = 0; t < len; ++t) {
    if (t + PREFETCH_AHEAD < len) prefetch_row(k_row(t + PREFETCH_AHEAD), row_bytes);
    const uint16_t* k = reinterpret_cast<const uint16_t*>(k_row(t));
    for (int64_t g = 0; g < kv_heads; ++g) {
      __m512i kv[C];
      for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_si512(k + g * HD + 32 * c);
      for (int64_t j = 0; j < group; ++j) {
        const int64_t h = g * group + j;
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)kv[0], (__m512bh)_mm512_load_si512(qb + h * HD));
        for (int c = 1; c < C; ++c)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)kv[c], (__m512bh)_mm512_load_si512(qb + h * HD + 32 * c));
        scores[h * len + t] = _mm512_reduce_add_ps(acc);
      }
    }
  }
  softmax_rows(scores, heads, len);
  for (int64_t g = 0; g < kv_heads; ++g) {
    __m512 acc[G_MAX][F];
    for (int64_t j = 0; j < group; ++j)
      for (int f = 0; f < F; ++f) acc[j][f] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      if (g == 0 && t + PREFETCH_AHEAD < len) prefetch_row(v_row(t + PREFETCH_AHEAD), row_bytes);
      const uint16_t* v = reinterpret_cast<const uint16_t*>(v_row(t)) + g * HD;
      __m512 vf[F];
      for (int f = 0; f < F; ++f)
        vf[f] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * f))), 16));
      for (int64_t j = 0; j < group; ++j) {
        const __m512 p = _mm512_set1_ps(scores[(g * group + j) * len + t]);
        for (int f = 0; f < F; ++f) acc[j][f] = _mm512_fmadd_ps(p, vf[f], acc[j][f]);
      }
    }
    for (int64_t j = 0; j < group; ++j)
      for (int f = 0; f < F; ++f) {
        // fp32 -> bf16 with round-to-nearest-even, as c10::BFloat16 does.
        __m256bh r = _mm512_cvtneps_pbh(acc[j][f]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g * group + j) * HD + 16 * f), (__m256i)r);
      }
  }
}
#define PAGED_DECODE_BF16_SIMD 1

#endif


// fp32, one sequence (all its heads) per task: fp32 FMAs for q·k (no rounding of q: fp32 is the mode that
// matches transformers), each token's K row of all KV heads one contiguous read, values accumulated in
// registers per KV head. On GCC vectors as wide as the CPU's (16 floats with AVX-512, else 8): on an
// AVX2-only EPYC this replaced the generic loops below, which copied every K/V row to a buffer (116 ->
// 64 us per call at SmolLM2's shapes, 8 sequences).
#if defined(__AVX512F__)
constexpr int F32_LANES = 16;
#else
constexpr int F32_LANES = 8;
#endif
typedef float vecf __attribute__((vector_size(4 * F32_LANES)));

inline vecf load_vec(const float* p) {
  vecf r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline float sum_vec(vecf v) {
  float s = 0.f;
  for (int i = 0; i < F32_LANES; ++i) s += v[i];
  return s;
}

template <int HD>
void decode_seq_f32(const float* q, int64_t q1, const float* cache, const int64_t* srow, int64_t len,
                    int64_t layer_offset, int64_t v_offset, int64_t kv_heads, int64_t heads, float scale,
                    float* scores, float* out) {
  constexpr int F = HD / F32_LANES;
  constexpr int G_MAX = 8;
  const int64_t group = heads / kv_heads, row_elems = kv_heads * HD, row_bytes = row_elems * 4;
  alignas(64) float qs[64 * HD];
  for (int64_t h = 0; h < heads; ++h)
    for (int d = 0; d < HD; ++d) qs[h * HD + d] = q[h * q1 + d] * scale;
  auto k_row = [&](int64_t t) { return cache + (srow[t] + layer_offset) * row_elems; };
  auto v_row = [&](int64_t t) { return cache + (srow[t] + layer_offset + v_offset) * row_elems; };
  for (int64_t t = 0; t < len; ++t) {
    if (t + PREFETCH_AHEAD < len) prefetch_row(k_row(t + PREFETCH_AHEAD), row_bytes);
    const float* k = k_row(t);
    for (int64_t g = 0; g < kv_heads; ++g) {
      vecf kv[F];
      for (int f = 0; f < F; ++f) kv[f] = load_vec(k + g * HD + F32_LANES * f);
      for (int64_t j = 0; j < group; ++j) {
        const float* qh = qs + (g * group + j) * HD;
        vecf acc = kv[0] * load_vec(qh);
        for (int f = 1; f < F; ++f) acc += kv[f] * load_vec(qh + F32_LANES * f);
        scores[(g * group + j) * len + t] = sum_vec(acc);
      }
    }
  }
  softmax_rows(scores, heads, len);
  for (int64_t g = 0; g < kv_heads; ++g) {
    vecf acc[G_MAX][F];
    for (int64_t j = 0; j < group; ++j)
      for (int f = 0; f < F; ++f) acc[j][f] = vecf{};
    for (int64_t t = 0; t < len; ++t) {
      if (g == 0 && t + PREFETCH_AHEAD < len) prefetch_row(v_row(t + PREFETCH_AHEAD), row_bytes);
      const float* v = v_row(t) + g * HD;
      vecf vf[F];
      for (int f = 0; f < F; ++f) vf[f] = load_vec(v + F32_LANES * f);
      for (int64_t j = 0; j < group; ++j) {
        const float p = scores[(g * group + j) * len + t];
        for (int f = 0; f < F; ++f) acc[j][f] += vf[f] * p;
      }
    }
    for (int64_t j = 0; j < group; ++j)
      for (int f = 0; f < F; ++f) std::memcpy(out + (g * group + j) * HD + F32_LANES * f, &acc[j][f], sizeof(vecf));
  }
}

// Any dtype, any head_dim: plain loops the compiler vectorizes.
template <typename T>
void decode_task(const T* q, int64_t q1, const T* cache, const int64_t* srow, int64_t len, int64_t layer_offset,
                 int64_t v_offset, int64_t row_elems, int64_t head_off, int64_t group, int64_t hd, float scale,
                 float* scores, float* qf, float* acc, float* row, T* out) {
  for (int64_t h = 0; h < group; ++h)
    for (int64_t d = 0; d < hd; ++d) qf[h * hd + d] = to_float(q[h * q1 + d]) * scale;
  for (int64_t t = 0; t < len; ++t) {
    load_row(cache + (srow[t] + layer_offset) * row_elems + head_off, row, hd);
    for (int64_t h = 0; h < group; ++h) scores[h * len + t] = dot(qf + h * hd, row, hd);
  }
  softmax_rows(scores, group, len);
  std::fill(acc, acc + group * hd, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    load_row(cache + (srow[t] + layer_offset + v_offset) * row_elems + head_off, row, hd);
    for (int64_t h = 0; h < group; ++h) {
      const float p = scores[h * len + t];
      float* a = acc + h * hd;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) a[d] += p * row[d];
    }
  }
  for (int64_t h = 0; h < group; ++h)
    for (int64_t d = 0; d < hd; ++d) out[h * hd + d] = static_cast<T>(acc[h * hd + d]);
}

template <typename T>
void decode_impl(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                 torch::Tensor& rows, const torch::Tensor& slots, const torch::Tensor& ctx_lens,
                 int64_t layer_offset, int64_t v_offset, double scale, torch::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), hd = q.size(2), kv_heads = k_new.size(1);
  const int64_t group = heads / kv_heads, row_elems = kv_heads * hd;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_new.data_ptr<T>();
  const T* vp = v_new.data_ptr<T>();
  T* cache = rows.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t q0 = q.stride(0), q1 = q.stride(1), k0 = k_new.stride(0), k1 = k_new.stride(1);
  const int64_t v0 = v_new.stride(0), v1 = v_new.stride(1), s0 = slots.stride(0);
  const float fscale = static_cast<float>(scale);
  int64_t max_len = 0;
  for (int64_t i = 0; i < n; ++i) max_len = std::max(max_len, lens[i]);

  // One sequence (all its heads) per task, K/V rows read in place: fp32 on the vector kernel, bf16 on the
  // AVX512-BF16 one where compiled; anything else takes the generic per-(sequence, KV head) loops below.
  auto per_sequence = [&](auto&& kernel) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(heads * max_len);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t len = lens[i];
        const int64_t* srow = sp + i * s0;
        T* k_dst = cache + (srow[len - 1] + layer_offset) * row_elems;
        for (int64_t g = 0; g < kv_heads; ++g) {
          std::memcpy(k_dst + g * hd, kp + i * k0 + g * k1, hd * sizeof(T));
          std::memcpy(k_dst + v_offset * row_elems + g * hd, vp + i * v0 + g * v1, hd * sizeof(T));
        }
        kernel(qp + i * q0, srow, len, scores.data(), op + i * heads * hd);
      }
    });
  };
  const bool vector_shape = group <= 8 && heads <= 64 && (hd == 64 || hd == 128);
  if constexpr (std::is_same_v<T, float>) {
    if (vector_shape) {
      per_sequence([&](const T* qi, const int64_t* srow, int64_t len, float* scores, T* oi) {
        auto fn = hd == 64 ? decode_seq_f32<64> : decode_seq_f32<128>;
        fn(qi, q1, cache, srow, len, layer_offset, v_offset, kv_heads, heads, fscale, scores, oi);
      });
      return;
    }
  }
#ifdef PAGED_DECODE_BF16_SIMD
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (vector_shape) {
      per_sequence([&](const T* qi, const int64_t* srow, int64_t len, float* scores, T* oi) {
        auto fn = hd == 64 ? decode_seq_bf16<64> : decode_seq_bf16<128>;
        fn(qi, q1, cache, srow, len, layer_offset, v_offset, kv_heads, heads, fscale, scores, oi);
      });
      return;
    }
  }
#endif
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * max_len), qf(group * hd), acc(group * hd), row(hd);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kv_heads, g = task % kv_heads, len = lens[i];
      const int64_t* srow = sp + i * s0;
      const int64_t head_off = g * hd;
      T* k_dst = cache + (srow[len - 1] + layer_offset) * row_elems + head_off;
      std::memcpy(k_dst, kp + i * k0 + g * k1, hd * sizeof(T));
      std::memcpy(k_dst + v_offset * row_elems, vp + i * v0 + g * v1, hd * sizeof(T));
      decode_task<T>(qp + i * q0 + g * group * q1, q1, cache, srow, len, layer_offset, v_offset, row_elems,
                     head_off, group, hd, fscale, scores.data(), qf.data(), acc.data(), row.data(),
                     op + i * heads * hd + g * group * hd);
    }
  });
}

}  // namespace

// q `[n, heads, head_dim]`, k_new / v_new `[n, kv_heads, head_dim]` (rows may be strided views of the
// fused projection; the last dimension must be contiguous), rows the cache `[R, kv_heads, head_dim]`
// (contiguous, same dtype), slots `[n, width]` int64, ctx_lens `[n]` int64 (keys per sequence, the new
// token included). Returns `[n, heads * head_dim]`.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new, torch::Tensor rows,
                           torch::Tensor slots, torch::Tensor ctx_lens, int64_t layer_offset, int64_t v_offset,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3, "q, k_new, v_new must be 3-d");
  TORCH_CHECK(q.stride(2) == 1 && k_new.stride(2) == 1 && v_new.stride(2) == 1, "last dim must be contiguous");
  TORCH_CHECK(rows.is_contiguous() && slots.stride(1) == 1 && ctx_lens.is_contiguous(), "layout");
  TORCH_CHECK(q.scalar_type() == rows.scalar_type() && k_new.scalar_type() == rows.scalar_type() &&
                  v_new.scalar_type() == rows.scalar_type(),
              "q, k, v and the cache must share a dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && ctx_lens.scalar_type() == torch::kInt64, "int64 indices");
  TORCH_CHECK(q.size(1) % k_new.size(1) == 0 && rows.size(2) == q.size(2), "head shapes");
  auto out = torch::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.scalar_type() == torch::kFloat32) {
    decode_impl<float>(q, k_new, v_new, rows, slots, ctx_lens, layer_offset, v_offset, scale, out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_impl<c10::BFloat16>(q, k_new, v_new, rows, slots, ctx_lens, layer_offset, v_offset, scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16");
  }
  return out;
}

