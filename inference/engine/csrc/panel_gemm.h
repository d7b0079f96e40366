// The panel GEMM's entry points shared by panel_gemm.cpp (packing, checks, the AVX2 kernel, dispatch) and
// panel_gemm512.cpp (the AVX-512 kernels, compiled where the build targets AVX-512 / AVX512-BF16).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX512F__)
// y[M, N] = x[M, K] @ w.T (+ bias): w packed as P fp32 panels of [K, 16], pairs interleaved (pack_panels).
void panel_linear_avx512(const float* x, int64_t M, int64_t K, const float* w, int64_t P, int64_t N,
                         const float* bias, float* y);
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The same in bf16 with fp32 accumulation: w packed as P panels of [ceil(K / 2), 16, 2] bf16 (pairs of k
// adjacent), pairs of panels interleaved (pack_panels).
void panel_linear_bf16(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w, int64_t P, int64_t N,
                       const c10::BFloat16* bias, c10::BFloat16* y);
#define PANEL_GEMM_BF16 1
#endif
