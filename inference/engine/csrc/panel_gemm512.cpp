// The panel GEMM on AVX-512 (see panel_gemm.cpp for the packing and the AVX2 kernel): y = x @ w.T (+ bias)
// with 16-column panels, each a single 512-bit vector wide, in fp32 (fp32 FMAs) and in bf16 (`vdpbf16ps`
// with AVX512-BF16: bf16 pairs multiplied and summed into fp32 accumulators).
//
// Layout (`pack_panels` in an AVX-512 build): panels in pairs, the pair's two panels interleaved step by
// step, [P / 2, steps, 2, 16, KSTEP] (KSTEP = 1 fp32, 2 bf16: each column's k pairs adjacent, what
// `vdpbf16ps` multiplies; steps = ceil(K / KSTEP)); an odd last panel alone after them, [steps, 16, KSTEP].
// A step of a pair is two 64-byte lines, so a tile of a pair's 2 panels reads one sequential stream, and a
// linear's whole weight is one stream for the 2-panel tiles.
//
// Blocking: a tile is MR rows x NV panels of accumulators (MR * NV <= 24 of the 32 vector registers).
// Decode row counts read each weight vector once per MR rows: up to 4 rows, 4 panels side by side (so
// that even one row has 4 independent dependency chains); up to 8 rows, one pair of M rows; up to 16,
// 8 rows x 2 panels (the second pass reads the pair from L2), except 9-12 rows in one pass of 12 x 2 (Zen 5
// EPYC, a step's projections: 12 rows 0.78x / 0.62x the time of 8 x 2 in bf16 / fp32, 9 rows 1.23x / 0.88x,
// load 6-9); above, 12 rows x 2 panels, the micro-tile of a compute-bound GEMM.
//
// Prefetch: the first pass over a tile's panels prefetches one line per panel and step, so the weights
// stream from memory while the dot products run: a pair's stream PREFETCH_BYTES ahead of where it reads,
// into L2 (`_MM_HINT_T1`); with 4 panels (two streams, 1-4 rows) the next group's same step, into L1 (into
// L2 it was 10 % slower at 1 row in fp32). Measured on an AMD EPYC Zen 4 whose core reads ~25 GB/s and
// computes ~220 bf16 GFLOP/s (fifteenth session, one SmolLM2 step's projections at 8 rows, 30 distinct layers, a `/tmp` dev
// bench): the earlier kernel (one panel per pass, contiguous panels, the next panel prefetched into L1)
// 17.7-18.1 ms bf16 / 35.5 fp32; the same prefetched into L2 13.4 / 22.3; pairs interleaved with the
// 16 KiB L2 prefetch 11.7-11.8 / 21.6, against 10.7 / 20.1 ms for a bare read of the same bytes; L1
// prefetches (any distance) 16-24 ms, 8-64 KiB into L2 within 3 %.
// More rows than one tile holds (13 and up) take several passes over a pair, and only the first reads
// memory: so every pass also prefetches an equal share of the next group's stream into L2, keeping the
// memory busy while the later passes compute from the cache. On the Zen 5 EPYC (sixteenth session, the
// same kind of step, best of 6, load 3.0-6.3): 16 rows 0.75x / 0.79x the time in bf16 / fp32, fp32 24-128
// rows 0.90-0.95x, bf16 24-512 rows 0.95-0.99x (compute-bound there); 1-12 rows (one pass) unchanged.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "panel_gemm.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t NR = 16;  // columns per panel = fp32 lanes of a vector
constexpr int64_t PREFETCH_BYTES = 16384;  // how far ahead of its reads a pair's stream is prefetched

inline __mmask16 column_mask(int64_t cols) {
  return cols >= NR ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1u);
}

// fp32 weights and activations: one k per step.
struct F32 {
  using T = float;
  static constexpr int64_t KSTEP = 1;
  static __m512 weights(const float* w) { return _mm512_loadu_ps(w); }
  static __m512 broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 last(const float* x) { return broadcast(x); }  // never used: K is a whole number of steps
  static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
  static void store(__m512 acc, const float* bias, float* y, __mmask16 mask) {
    if (bias != nullptr) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, bias));
    _mm512_mask_storeu_ps(y, mask, acc);
  }
};

#if defined(__AVX512BF16__)
// bf16 weights and activations: a pair of k per step, products summed in fp32 by `vdpbf16ps`.
struct BF16 {
  using T = c10::BFloat16;
  static constexpr int64_t KSTEP = 2;
  static __m512 weights(const T* w) { return _mm512_castsi512_ps(_mm512_loadu_si512(w)); }
  static __m512 broadcast(const T* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  // The last k of an odd K: its pair is (x[K - 1], 0) (the packed weight's pad is 0 too; x[K] is not read).
  static __m512 last(const T* x) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(x->x))); }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(w), (__m512bh)_mm512_castps_si512(x));
  }
  static __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static void store(__m512 acc, const T* bias, T* y, __mmask16 mask) {
    if (bias != nullptr) acc = _mm512_add_ps(acc, widen(_mm256_maskz_loadu_epi16(mask, bias)));
    // fp32 -> bf16 with round-to-nearest-even, as c10::BFloat16 (and oneDNN's bf16 output) does.
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(acc));
  }
};
#endif

// Where one call's operands are: x [M, K], P panels (each `pstride` elements, in pairs), y [M, N].
template <class E>
struct Args {
  const typename E::T* x;
  int64_t K;
  const typename E::T* w;
  int64_t pstride;
  const typename E::T* bias;
  typename E::T* y;
  int64_t N;
  int64_t P;

  static constexpr int64_t STEP = NR * E::KSTEP;  // elements of one panel per step (one 64-byte line)
  // Panel p's first step, and the elements between its steps: 2 lines in a pair, 1 for an odd last panel.
  const typename E::T* panel(int64_t p) const { return w + p / 2 * 2 * pstride + p % 2 * STEP; }
  int64_t step_stride(int64_t p) const { return p < P / 2 * 2 ? 2 * STEP : STEP; }
};

// What one pass over a tile's panels prefetches besides (or instead of) its own stream: `lines` 64-byte
// lines from `from` (the next group's stream), one a step, into L2.
template <class T>
struct Ahead {
  const T* from = nullptr;
  int64_t lines = 0;
};

// MR rows from m0 x NV panels from p0 (all paired, or one panel); `prefetch`: the first pass over them;
// `next`: its share of the next group's stream (passes of more rows than one tile holds).
template <class E, int MR, int NV>
void tile(const Args<E>& a, int64_t m0, int64_t p0, bool prefetch, Ahead<typename E::T> next = {}) {
  using T = typename E::T;
  __m512 acc[MR][NV];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  const T* xr[MR];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i) xr[i] = a.x + (m0 + i) * a.K;
  const T* w[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) w[v] = a.panel(p0 + v);
  const int64_t steps = a.K / E::KSTEP, stride = a.step_stride(p0);
  // 2 panels (one pair, one stream): PREFETCH_BYTES ahead; 4 (two pairs, two streams): the next group's
  // same step, so that both of its pairs are on their way before it starts.
  const int64_t ahead = NV >= 4 ? NV * a.pstride : PREFETCH_BYTES / static_cast<int64_t>(sizeof(T));
  const T* end = a.w + a.P * a.pstride;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t off = s * stride, k = s * E::KSTEP;
    if (s < next.lines) _mm_prefetch(reinterpret_cast<const char*>(next.from + s * Args<E>::STEP), _MM_HINT_T1);
    if (prefetch) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const T* line = w[v] + off + ahead;
        if (line < end) _mm_prefetch(reinterpret_cast<const char*>(line), NV >= 4 ? _MM_HINT_T0 : _MM_HINT_T1);
      }
    }
    __m512 wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = E::weights(w[v] + off);
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = E::broadcast(xr[i] + k);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = E::fma(acc[i][v], wv[v], xv);
    }
  }
  if (steps * E::KSTEP < a.K) {  // bf16 with an odd K
    const int64_t off = steps * stride;
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = E::last(xr[i] + steps * E::KSTEP);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = E::fma(acc[i][v], E::weights(w[v] + off), xv);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int64_t n0 = (p0 + v) * NR;
    const __mmask16 mask = column_mask(a.N - n0);
    const T* b = a.bias != nullptr ? a.bias + n0 : nullptr;
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) E::store(acc[i][v], b, a.y + (m0 + i) * a.N + n0, mask);
  }
}

// `rows` (< MR) remaining rows: the tile instantiated for exactly that many.
template <class E, int MR, int NV>
void tail(const Args<E>& a, int64_t m0, int64_t p0, int64_t rows, bool prefetch, Ahead<typename E::T> next) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<E, MR, NV>(a, m0, p0, prefetch, next);
    tail<E, MR - 1, NV>(a, m0, p0, rows, prefetch, next);
  }
}

// All M rows against NV panels from p0; the first pass prefetches its own stream. With more than one
// pass, every pass also prefetches an equal share of the next group's stream into L2, so that the memory
// streams while the later passes compute from the cache (otherwise it idles through them: the first pass
// alone read the weights, and the reads and the dot products overlapped only there).
template <class E, int MR, int NV>
void rows_of(const Args<E>& a, int64_t M, int64_t p0) {
  using T = typename E::T;
  const int64_t passes = (M + MR - 1) / MR;
  Ahead<T> next;
  const T* end = a.w + a.P * a.pstride;
  if (passes > 1 && p0 + NV < a.P) {
    next.from = a.panel(p0 + NV);
    const int64_t lines = (std::min<const T*>(next.from + NV * a.pstride, end) - next.from) / Args<E>::STEP;
    next.lines = (lines + passes - 1) / passes;
  }
  const int64_t share = next.lines;
  int64_t m = 0;
  bool prefetch = true;
  for (; m + MR <= M; m += MR, prefetch = false) {
    tile<E, MR, NV>(a, m, p0, prefetch, next);
    next.from += share * Args<E>::STEP;
    next.lines = std::max<int64_t>(0, std::min(share, (end - next.from) / Args<E>::STEP));
  }
  if (m < M) tail<E, MR - 1, NV>(a, m, p0, M - m, prefetch, next);
}

// Every panel in groups of NV (even: whole pairs; the last panels, fewer than NV, one at a time), in
// parallel over groups.
template <class E, int MR, int NV>
void run_groups(const Args<E>& a, int64_t M) {
  static_assert(NV % 2 == 0, "a group is whole pairs of panels");
  const int64_t groups = a.P / NV;
  at::parallel_for(0, groups, std::max<int64_t>(1, 16 / NV), [&](int64_t begin, int64_t stop) {
    for (int64_t g = begin; g < stop; ++g) rows_of<E, MR, NV>(a, M, g * NV);
  });
  for (int64_t p = groups * NV; p < a.P; ++p) rows_of<E, MR, 1>(a, M, p);
}

template <class E>
void run(const Args<E>& a, int64_t M) {
  if (M <= 4) return run_groups<E, 4, 4>(a, M);
  // 5-8 rows: one pass over each pair (one stream), 16 accumulators.
  if (M <= 8) return run_groups<E, 8, 2>(a, M);
  // 9-12 rows (a verify step of 8 sequences, a batch just over 8) in one pass of up to 12 x 2 panels,
  // each weight vector read once, instead of 8 rows and a second pass for the rest.
  if (M <= 12) return run_groups<E, 12, 2>(a, M);
  if (M <= 16) return run_groups<E, 8, 2>(a, M);
  // Prefill-sized inputs too (blocks of rows held in L2 while every panel passes were no faster on the
  // Zen 5 EPYC at 512-2048 rows: 0.96-1.03x).
  run_groups<E, 12, 2>(a, M);
}

}  // namespace

void panel_linear_avx512(const float* x, int64_t M, int64_t K, const float* w, int64_t P, int64_t N,
                         const float* bias, float* y) {
  run<F32>(Args<F32>{x, K, w, K * NR, bias, y, N, P}, M);
}

#if defined(__AVX512BF16__)
void panel_linear_bf16(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w, int64_t P, int64_t N,
                       const c10::BFloat16* bias, c10::BFloat16* y) {
  run<BF16>(Args<BF16>{x, K, w, (K + 1) / 2 * 2 * NR, bias, y, N, P}, M);
}
#endif

#endif  // __AVX512F__
