// fp32 linear for the CPU: y = x @ w.T (+ bias) with w packed once into panels of 16 output columns
// ([panels, K, 16]), register-blocked for both decode-sized and prefill-sized row counts.
//
// Why: measured on an AVX2-only AMD EPYC (one thread, SmolLM2's projections incl. the 49152-column LM
// head), oneDNN's prepacked fp32 kernel ran an 8-row decode step's projections in 42-46 ms (~13 GB/s of
// weights, 48 GFLOPS); this kernel in 33-34 ms, 16 rows 72 vs 61 ms, 64 rows 229-237 vs 213-220 ms,
// 256 rows 870 vs 790 ms. Up to 16 rows, each half panel (8 columns) is read once per 8 rows with 8
// accumulators of 8 columns in registers; above, 6 rows x 16 columns (12 accumulators) per pass, the
// classic GEMM micro-tile. Each output is a sequential fp32 FMA sum over k, as oneDNN's is: outputs
// agree with F.linear to float rounding.
//
// That 8-wide kernel is the AVX2 build's. A build for AVX-512 runs fp32 on panel_gemm512.cpp's 16-wide
// kernel instead, and one for AVX512-BF16 also has bf16 panels ([panels, ceil(K / 2), 16, 2], each
// column's k pairs adjacent, `vdpbf16ps`); there panels go in pairs interleaved step by step (one stream
// per pair, see panel_gemm512.cpp). This file packs, checks the arguments and dispatches.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "panel_gemm.h"

namespace {

constexpr int64_t NR = 16;           // output columns per panel
constexpr int64_t SMALL_ROWS = 16;   // up to this many rows: half-panel tiles of 8 rows

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

// Writes `cols` (<= 8 * NV) columns of MR accumulator rows, adding the bias.
template <int MR, int NV>
inline void store(const v8 (&acc)[MR][NV], const float* bias, float* y, int64_t N, int64_t n0, int64_t m0,
                  int64_t cols) {
  for (int i = 0; i < MR; ++i) {
    float out[8 * NV];
    for (int v = 0; v < NV; ++v) std::memcpy(out + 8 * v, &acc[i][v], sizeof(v8));
    if (bias != nullptr)
      for (int64_t j = 0; j < cols; ++j) out[j] += bias[n0 + j];
    std::memcpy(y + (m0 + i) * N + n0, out, cols * sizeof(float));
  }
}

// MR rows x (8 * NV) columns starting at `w` (a panel or its second half; rows of the panel are NR apart).
// `next`, when given, is the panel after this one: one of its 64-byte rows is prefetched per k, so the
// weights stream from memory while this panel computes (~10 % on SmolLM2's 8-row projections with the
// weights out of cache).
template <int MR, int NV>
void tile(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t N, int64_t n0, int64_t m0,
          int64_t cols, const float* next) {
  v8 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = v8{};
  const float* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = x + (m0 + i) * K;
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr) __builtin_prefetch(next + k * NR);
    v8 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load8(w + k * NR + 8 * v);
    for (int i = 0; i < MR; ++i) {
      const float xv = xr[i][k];
      for (int v = 0; v < NV; ++v) acc[i][v] += wv[v] * xv;
    }
  }
  store<MR, NV>(acc, bias, y, N, n0, m0, cols);
}

// `rows` (< MR) remaining rows: the tile instantiated for exactly that many.
template <int MR, int NV>
void tail(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t N, int64_t n0, int64_t m0,
          int64_t cols, int64_t rows, const float* next) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<MR, NV>(x, K, w, bias, y, N, n0, m0, cols, next);
    tail<MR - 1, NV>(x, K, w, bias, y, N, n0, m0, cols, rows, next);
  }
}

// All M rows against one panel (or half panel); the first pass prefetches `next`.
template <int MR, int NV>
void rows_of(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y, int64_t N, int64_t n0,
             int64_t cols, const float* next) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR, next = nullptr) tile<MR, NV>(x, K, w, bias, y, N, n0, m, cols, next);
  if (m < M) tail<MR - 1, NV>(x, K, w, bias, y, N, n0, m, cols, M - m, next);
}

}  // namespace

std::vector<std::string> panel_variants() {
#if defined(__AVX512F__)
  std::vector<std::string> out{"float32x16"};
#else
  std::vector<std::string> out{"float32x8"};
#endif
#if defined(PANEL_GEMM_BF16)
  out.emplace_back("bfloat16");
#endif
  return out;
}

torch::Tensor pack_panels(torch::Tensor weight) {
  const bool bf16 = weight.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == torch::kFloat32 || bf16),
              "pack_panels: expects a float32 or bfloat16 [out_features, in_features] weight");
#if !defined(PANEL_GEMM_BF16)
  TORCH_CHECK(!bf16, "pack_panels: bfloat16 panels need AVX512-BF16 (this build has no bf16 panel kernel)");
#endif
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR;
  // [P, steps, 16, KSTEP] zero-padded: fp32 one k per step, bf16 a pair of k (what vdpbf16ps multiplies).
  const int64_t kstep = bf16 ? 2 : 1, steps = (K + kstep - 1) / kstep;
  auto padded = torch::zeros({P * NR, steps * kstep}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  auto panels = padded.view({P, NR, steps, kstep}).permute({0, 2, 1, 3}).contiguous();
#if defined(__AVX512F__)
  // The AVX-512 kernel's order (panel_gemm512.cpp): pairs of panels interleaved step by step, an odd last
  // panel alone after them; the tensor keeps the [P, steps, 16, KSTEP] shape (the checks read P from it).
  const int64_t paired = P / 2 * 2;
  if (paired > 0) {
    auto pairs = panels.narrow(0, 0, paired).view({P / 2, 2, steps, NR, kstep}).permute({0, 2, 1, 3, 4});
    panels.narrow(0, 0, paired).view({P / 2, steps, 2, NR, kstep}).copy_(pairs.contiguous());
  }
#endif
  return bf16 ? panels : panels.view({P, K, NR});
}

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias) {
  const auto dtype = panels.scalar_type();
  const bool bf16 = dtype == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dtype && (bf16 || dtype == torch::kFloat32),
              "panel_linear: expects a contiguous [rows, in_features] input of the panels' dtype (float32 or bfloat16)");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.dim() == (bf16 ? 4 : 3) && panels.is_contiguous() && N > (P - 1) * NR && N <= P * NR &&
                  (bf16 ? panels.size(1) == (K + 1) / 2 && panels.size(2) == NR && panels.size(3) == 2
                        : panels.size(1) == K && panels.size(2) == NR),
              "panel_linear: panels do not match the input (pack_panels of an [N, in_features] weight)");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == dtype,
                "panel_linear: bias must be a [N] tensor of the panels' dtype");
  }
  const bool has_bias = bias.has_value() && bias->defined();
  auto y = torch::empty({M, N}, x.options());
  if (bf16) {
#if defined(PANEL_GEMM_BF16)
    using T = c10::BFloat16;
    panel_linear_bf16(x.data_ptr<T>(), M, K, panels.data_ptr<T>(), P, N, has_bias ? bias->data_ptr<T>() : nullptr,
                      y.data_ptr<T>());
    return y;
#else
    TORCH_CHECK(false, "panel_linear: bfloat16 panels need AVX512-BF16 (this build has no bf16 panel kernel)");
#endif
  }
  const float* b = has_bias ? bias->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(__AVX512F__)
  panel_linear_avx512(xp, M, K, wp, P, N, b, yp);
#else
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * NR;
      const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
      const float* next = p + 1 < end ? panel + K * NR : nullptr;
      if (M <= SMALL_ROWS) {
        rows_of<8, 1>(xp, M, K, panel, b, yp, N, n0, std::min<int64_t>(8, cols), next);
        if (cols > 8) rows_of<8, 1>(xp, M, K, panel + 8, b, yp, N, n0 + 8, cols - 8, nullptr);
      } else {
        rows_of<6, 2>(xp, M, K, panel, b, yp, N, n0, cols, next);
      }
    }
  });
#endif
  return y;
}
