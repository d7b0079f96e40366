// bf16 linear on AMX tiles for decode-sized row counts: y = x @ w.T (+ bias), bf16 in and out, fp32
// accumulation in the tiles' C registers.
//
// Why: a decode step of up to ~76 rows is bound by reading the weights on the Intel Xeon with AMX-BF16
// (family 6 model 207: ~965 GFLOP/s of AMX against ~12.8 GB/s read by one thread), so the kernel's job is
// to stream every weight byte once, sequentially, while the tiles multiply. oneDNN's AMX brgemm reached
// 62-83 % of the read bandwidth there (docs/benchmarks.md, twelfth session).
//
// Layout (`amx_pack`): the weight [N, K] is padded to whole groups of G = 2 tiles of 16 output columns and
// to whole 32-wide K blocks, and stored as [groups, K / 32, G, 16, 16, 2]: for each group, for each K block,
// G tiles of 1 KiB in the VNNI layout AMX's B operand reads (16 rows of k pairs x 16 columns x 2). The
// kernel walks groups, and K blocks within a group, in that order, so the whole weight is one sequential
// stream, prefetched `prefetch` bytes ahead.
//
// Blocking: per group, the rows in chunks of up to 32 (two A tiles of 16 rows x 32 k, so 2 A + 2 B + 4 C
// of the 8 tile registers). Above 32 rows the group's K blocks go in slices of `kslice` (16: 32 KiB of
// weights), every chunk per slice, its C tiles stored to and reloaded from an fp32 buffer between slices,
// so the chunks after the first read the slice's weights from L1 rather than L2. Rows past a multiple of
// 16 are copied into a zeroed 16-row block. Each C element is a sum over the K blocks in a fixed order,
// started from zero (a stored and reloaded fp32 C is exact), and a tile row depends only on its own A
// row: every output row is computed exactly as it would be alone, whatever the row count (what
// speculative verify steps need).
//
// Prefetch: the weight stream 32 KiB ahead into L2 (`_MM_HINT_T1`), spread over every chunk's K blocks.
// Measured on SmolLM2's step (fourteenth session, one thread, a busy host): at 64 rows 0.86 of oneDNN's
// time against 0.88 for 16 KiB and 1.15 for 4 KiB into L1; at 8 and 32 rows every setting within 0.51-0.55.
//
// Linux hands out AMX's tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`, once per
// process); the tile configuration is per thread and is loaded by every call on every worker thread.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AMX_GEMM 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t TILE_N = 16;   // output columns per B tile
constexpr int64_t TILE_K = 32;   // k per tile row (16 bf16 pairs)
constexpr int64_t TILE_M = 16;   // rows per A / C tile
constexpr int64_t GROUP = 2;     // B tiles side by side, read together
constexpr int64_t TILE_ELEMS = TILE_K * TILE_N;  // bf16 per B tile (1 KiB)
// Defaults: bytes of the weight stream prefetched ahead, into which cache, K blocks per slice above 32
// rows (see the top; the sweep is in docs/benchmarks.md, fourteenth session).
constexpr int64_t DEFAULT_PREFETCH = 32768;
constexpr int64_t DEFAULT_HINT = 1;    // into L2
constexpr int64_t DEFAULT_KSLICE = 16;

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

#if defined(AMX_GEMM)

bool request_tiles() {
  // Linux 5.16+: the tile data state must be requested once per process before the first tile instruction
  // (torch/oneDNN may have done it already; asking again is harmless).
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
    constexpr int XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (fp32 16 x 16), 4-5: A (16 rows x 32 bf16), 6-7: B (16 k pairs x 16 columns x 2): all 16 x 64 B.
void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // GCC does not model ldtilecfg as reading the struct: inlined into a caller that reuses the stack slot,
  // it dropped the colsb / rows stores as dead (a development variant: every tile had 0 rows, SIGILL at
  // the first tile instruction). The barrier makes the stores happen before the load.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

struct Call {
  // A row blocks (16 rows each): K block kb's tile at a[b] + kb * astep[b], its rows lda[b] bytes apart
  // (x itself: astep 32, lda K * 2; a block packed as tiles: astep 512, lda 64).
  const c10::BFloat16* a[16];
  int64_t astep[16];
  int64_t lda[16];
  int64_t KB;                   // K blocks
  const c10::BFloat16* w;       // packed weights
  const c10::BFloat16* bias;    // [N] or null
  c10::BFloat16* y;             // [M, N]
  int64_t M, N;
  int64_t prefetch;             // bytes ahead
  int hint;                     // prefetch into L1 (0), L2 (1), L3 (2)
  int64_t kslice;               // K blocks per slice when the rows take more than one chunk
  const char* w_end;            // end of this thread's weight range (never prefetched past)
};

// Rows [m0, m0 + 16 * MT) of one group against its G = 2 B tiles over K blocks [k0, k1), the C tiles
// started from zero (`resume` false) or from `acc` (the same rows' sums over the K blocks before k0), and
// stored back to `acc` ([16 * MT rows][32 columns] fp32; tile (i, j) at rows 16 i, columns 16 j).
template <int MT>
inline void chunk(const Call& c, int64_t blk, const c10::BFloat16* wg,
                  int64_t k0, int64_t k1, bool resume, const char*& ahead, int lines, float (*acc)[GROUP * TILE_N]) {
  constexpr int64_t ld = GROUP * TILE_N * 4;
  if (resume) {
    _tile_loadd(0, &acc[0][0], ld);
    _tile_loadd(1, &acc[0][TILE_N], ld);
    if (MT == 2) {
      _tile_loadd(2, &acc[TILE_M][0], ld);
      _tile_loadd(3, &acc[TILE_M][TILE_N], ld);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if (MT == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  const c10::BFloat16* a0 = c.a[blk];
  const c10::BFloat16* a1 = c.a[MT == 2 ? blk + 1 : blk];
  const int64_t s0 = c.astep[blk], s1 = c.astep[MT == 2 ? blk + 1 : blk];
  const int64_t ld0 = c.lda[blk], ld1 = c.lda[MT == 2 ? blk + 1 : blk];
  for (int64_t kb = k0; kb < k1; ++kb) {
    const c10::BFloat16* b = wg + kb * GROUP * TILE_ELEMS;
    if (lines > 0 && ahead + 64 * lines <= c.w_end) {
      if (c.hint == 0) {
        for (int l = 0; l < lines; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
      } else if (c.hint == 1) {
        for (int l = 0; l < lines; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
      } else {
        for (int l = 0; l < lines; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T2);
      }
      ahead += 64 * lines;
    }
    _tile_loadd(4, a0 + kb * s0, ld0);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (MT == 2) {
      _tile_loadd(5, a1 + kb * s1, ld1);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, &acc[0][0], ld);
  _tile_stored(1, &acc[0][TILE_N], ld);
  if (MT == 2) {
    _tile_stored(2, &acc[TILE_M][0], ld);
    _tile_stored(3, &acc[TILE_M][TILE_N], ld);
  }
}

// Rows [m0, m0 + rows) of acc -> y's columns [n0, n0 + 32) (fewer at the right edge), bias added in fp32,
// rounded to nearest even as c10::BFloat16 and oneDNN do.
inline void write(const Call& c, const float (*acc)[GROUP * TILE_N], int64_t m0, int64_t rows, int64_t n0) {
  const int64_t cols = std::min<int64_t>(GROUP * TILE_N, c.N - n0);
  const __mmask32 mask = cols >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << cols) - 1u);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (c.bias != nullptr) {
    const __m256i lo = _mm256_maskz_loadu_epi16(static_cast<__mmask16>(mask), c.bias + n0);
    const __m256i hi = _mm256_maskz_loadu_epi16(static_cast<__mmask16>(mask >> 16), c.bias + n0 + 16);
    b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(lo), 16));
    b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v0 = _mm512_add_ps(_mm512_load_ps(&acc[r][0]), b0);
    const __m512 v1 = _mm512_add_ps(_mm512_load_ps(&acc[r][TILE_N]), b1);
    const __m512i out = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
    _mm512_mask_storeu_epi16(c.y + (m0 + r) * c.N + n0, mask, out);
  }
}

void run(const Call& c, int64_t groups) {
  const int64_t blocks = (c.M + TILE_M - 1) / TILE_M, chunks = (blocks + 1) / 2;
  // One chunk: every K block in one pass. More: K slices of `kslice` blocks, every chunk per slice, so the
  // group's slice of weights is read from L1 by the chunks after the first (not from L2).
  const int64_t slice = chunks == 1 ? c.KB : std::max<int64_t>(1, c.kslice);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    configure();
    Call local = c;
    local.w_end = reinterpret_cast<const char*>(c.w + end * c.KB * GROUP * TILE_ELEMS);
    alignas(64) float acc[16 * TILE_M][GROUP * TILE_N];
    for (int64_t g = begin; g < end; ++g) {
      const c10::BFloat16* wg = c.w + g * c.KB * GROUP * TILE_ELEMS;
      // The stream `prefetch` bytes ahead of this group's start, spread over every chunk's K blocks.
      const char* ahead = reinterpret_cast<const char*>(wg) + c.prefetch;
      const int lines = c.prefetch > 0 ? static_cast<int>((GROUP * TILE_ELEMS * 2 / 64 + chunks - 1) / chunks) : 0;
      for (int64_t k0 = 0; k0 < c.KB; k0 += slice) {
        const int64_t k1 = std::min(c.KB, k0 + slice);
        for (int64_t blk = 0; blk < blocks; blk += 2) {
          if (blk + 1 < blocks) {
            chunk<2>(local, blk, wg, k0, k1, k0 > 0, ahead, lines, acc + blk * TILE_M);
          } else {
            chunk<1>(local, blk, wg, k0, k1, k0 > 0, ahead, lines, acc + blk * TILE_M);
          }
        }
      }
      write(local, acc, 0, c.M, g * GROUP * TILE_N);
    }
    _tile_release();
  });
}

#endif  // AMX_GEMM

void check_packed(const torch::Tensor& packed, int64_t K, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() && packed.dim() == 6 &&
                  packed.size(1) == round_up(K, TILE_K) / TILE_K && packed.size(2) == GROUP &&
                  packed.size(0) * GROUP * TILE_N >= N && packed.size(0) * GROUP * TILE_N < N + GROUP * TILE_N,
              "amx_linear: the packed weight does not match x's width and n (use amx_pack)");
}

}  // namespace

bool amx_available() {
#if defined(AMX_GEMM)
  return request_tiles();
#else
  return false;
#endif
}

// [N, K] bf16 -> [ceil(N / 32), ceil(K / 32), 2, 16, 16, 2]: per group of 32 output columns, per K block,
// two 1 KiB B tiles in the VNNI layout (k pairs x columns x 2), zero-padded in N and K.
torch::Tensor amx_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "amx_pack: expects a 2-D bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t Np = round_up(N, GROUP * TILE_N), Kp = round_up(K, TILE_K);
  auto w = torch::constant_pad_nd(weight.contiguous(), {0, Kp - K, 0, Np - N}, 0);
  // [groups, G, 16 n, KB, 16 pairs, 2] -> [groups, KB, G, 16 pairs, 16 n, 2]
  return w.view({Np / (GROUP * TILE_N), GROUP, TILE_N, Kp / TILE_K, TILE_K / 2, 2})
      .permute({0, 3, 1, 4, 2, 5})
      .contiguous();
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                         int64_t prefetch, int64_t hint, int64_t kslice) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "amx_linear: expects a 2-D bf16 x");
  const int64_t K = x.size(1);
  check_packed(packed, K, N);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kBFloat16 && bias->numel() == N,
                "amx_linear: bias");
#if defined(AMX_GEMM)
  TORCH_CHECK(request_tiles(), "amx_linear: the kernel refused AMX tile state (arch_prctl)");
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int64_t KB = packed.size(1), Kp = KB * TILE_K;
  const int64_t blocks = (M + TILE_M - 1) / TILE_M;
  // A row blocks: x itself where its rows are whole 16-row blocks of whole K blocks; a zeroed copy of the
  // rest (the tail block, or all of x when K is not a multiple of 32: a tile row reads 64 bytes), in a
  // per-thread buffer (a torch tensor per call cost ~10 us, a few % of a 1-row step's projections).
  // Copying every block into contiguous 1 KiB tiles was measured too and was no faster (0.86-1.07x the
  // time of reading x in place at 8-128 rows).
  const int64_t full = K == Kp ? M / TILE_M : 0;
  std::vector<const c10::BFloat16*> a(blocks);
  std::vector<int64_t> astep(blocks, TILE_K), lda(blocks);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  for (int64_t b = 0; b < full; ++b) {
    a[b] = xp + b * TILE_M * K;
    lda[b] = K * 2;
  }
  if (full < blocks) {
    thread_local std::vector<c10::BFloat16> scratch;
    const size_t need = static_cast<size_t>((blocks - full) * TILE_M * Kp);
    if (scratch.size() < need) scratch.resize(need);
    for (int64_t b = full; b < blocks; ++b) {
      c10::BFloat16* dst = scratch.data() + (b - full) * TILE_M * Kp;
      const int64_t rows = std::min<int64_t>(TILE_M, M - b * TILE_M);
      for (int64_t r = 0; r < TILE_M; ++r) {
        const int64_t copied = r < rows ? K : 0;
        if (copied > 0) std::memcpy(dst + r * Kp, xp + (b * TILE_M + r) * K, K * 2);
        std::memset(static_cast<void*>(dst + r * Kp + copied), 0, (Kp - copied) * 2);
      }
      a[b] = dst;
      lda[b] = Kp * 2;
    }
  }
  // Chunks index a[] by 16-row block; Call holds them by value for up to 16 blocks, so larger inputs go
  // through in slices of 256 rows (each its own pass over the weights: prefill chunks, not decode).
  const int64_t groups = packed.size(0);
  for (int64_t s = 0; s < blocks; s += 16) {
    Call c{};
    const int64_t nb = std::min<int64_t>(16, blocks - s);
    for (int64_t b = 0; b < nb; ++b) {
      c.a[b] = a[s + b];
      c.astep[b] = astep[s + b];
      c.lda[b] = lda[s + b];
    }
    c.KB = KB;
    c.w = packed.data_ptr<c10::BFloat16>();
    c.bias = has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
    c.y = y.data_ptr<c10::BFloat16>() + s * TILE_M * N;
    c.M = std::min<int64_t>(M - s * TILE_M, 16 * TILE_M);
    c.N = N;
    c.prefetch = prefetch < 0 ? DEFAULT_PREFETCH : prefetch;
    c.hint = static_cast<int>(hint < 0 ? DEFAULT_HINT : hint);
    c.kslice = kslice < 0 ? DEFAULT_KSLICE : kslice;
    run(c, groups);
  }
  return y;
#else
  (void)prefetch;
  (void)hint;
  (void)kslice;
  TORCH_CHECK(false, "amx_linear: this build has no AMX kernel (the compiler did not target AMX-BF16)");
#endif
}
