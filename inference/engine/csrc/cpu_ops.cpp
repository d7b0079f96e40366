// Fused element-wise ops of the Llama block for the CPU, each one pass over its rows in fp32 with a
// single rounding to the storage dtype (torch runs each of them as 3-8 kernels, with bf16 casts in
// between): RMSNorm, residual add + RMSNorm, RoPE in place, SiLU(gate) * up. Python bindings of these
// and of paged_decode.cpp's, panel_gemm.cpp's and amx_gemm.cpp's kernels.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

std::vector<torch::Tensor> row_lse_topk(torch::Tensor logits, int64_t k);  // row_logprobs.cpp
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new, torch::Tensor rows,
                           torch::Tensor slots, torch::Tensor ctx_lens, int64_t layer_offset, int64_t v_offset,
                           double scale);
torch::Tensor pack_panels(torch::Tensor weight);
std::vector<std::string> panel_variants();
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias);
bool amx_available();  // amx_gemm.cpp
torch::Tensor amx_pack(torch::Tensor weight);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                         int64_t prefetch, int64_t hint, int64_t kslice);

namespace {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16); }

template <typename T>
inline T store(float f);
template <>
inline float store<float>(float f) {
  return f;
}
template <>
inline c10::BFloat16 store<c10::BFloat16>(float f) {
  // Round to nearest even, as c10::BFloat16(float) does for finite values, in a form that vectorizes.
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  u += 0x7FFFu + ((u >> 16) & 1u);
  c10::BFloat16 r;
  r.x = static_cast<uint16_t>(u >> 16);
  return r;
}

template <typename F>
void dispatch(const torch::Tensor& t, const char* name, F&& fn) {
  if (t.scalar_type() == torch::kFloat32) {
    fn(float{});
  } else if (t.scalar_type() == torch::kBFloat16) {
    fn(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, name, " supports float32 and bfloat16");
  }
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": expects [rows, dim] with a contiguous last dim");
}

// out[i] = x[i] / rms(x[i]) * w; with `residual`, first residual[i] = x[i] + residual[i] (rounded to the
// dtype, as a separate add would) and the norm is of that sum, written back into x.
template <typename T>
void norm_rows(const T* x, int64_t xs, T* res, int64_t rs, const T* w, T* out, int64_t os, int64_t n, int64_t d,
               float eps) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xi = x + i * xs;
      T* oi = out + i * os;
      float ss = 0.f;
      if (res != nullptr) {
        // Separate loops: with the rounding store inside the reduction gcc leaves it scalar (10x slower).
        T* ri = res + i * rs;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) ri[j] = store<T>(load(xi[j]) + load(ri[j]));
        xi = ri;
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < d; ++j) {
        const float f = load(xi[j]);
        ss += f * f;
      }
      const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) oi[j] = store<T>(load(xi[j]) * r * load(w[j]));
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "rms_norm: weight");
  auto out = torch::empty_like(x, torch::MemoryFormat::Contiguous);
  dispatch(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(x.data_ptr<T>(), x.stride(0), nullptr, 0, weight.data_ptr<T>(), out.data_ptr<T>(), out.stride(0),
                 x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place), x = rms_norm(residual) (in place): the step between two sublayers.
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "fused_add_rms_norm");
  check_rows(residual, "fused_add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type() &&
                  weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: shapes or dtypes differ");
  dispatch(x, "fused_add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(x.data_ptr<T>(), x.stride(0), residual.data_ptr<T>(), residual.stride(0), weight.data_ptr<T>(),
                 x.data_ptr<T>(), x.stride(0), x.size(0), x.size(1), static_cast<float>(eps));
  });
}

// Rotates the first `heads` head_dim-wide slices of each row of `x` `[n, width]` in place, HF's "rotate
// half" form: x * cos + (x2, x1) * signed_sin, with cos / signed_sin `[n, head_dim]` (sin's first half
// negated, see model.py).
void rope_inplace(torch::Tensor x, int64_t heads, torch::Tensor cos, torch::Tensor sin) {
  check_rows(x, "rope_inplace");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type() && cos.size(0) == x.size(0),
              "rope_inplace: cos/sin");
  const int64_t hd = cos.size(-1), half = hd / 2, n = x.size(0), xs = x.stride(0);
  TORCH_CHECK(heads * hd <= x.size(1) && hd % 2 == 0, "rope_inplace: heads * head_dim exceeds the row");
  dispatch(x, "rope_inplace", [&](auto tag) {
    using T = decltype(tag);
    T* xp = x.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const T* c = cp + i * hd;
        const T* s = sp + i * hd;
        for (int64_t h = 0; h < heads; ++h) {
          T* v = xp + i * xs + h * hd;
#pragma omp simd
          for (int64_t j = 0; j < half; ++j) {
            const float a = load(v[j]), b = load(v[j + half]);
            v[j] = store<T>(a * load(c[j]) + b * load(s[j]));
            v[j + half] = store<T>(b * load(c[j + half]) + a * load(s[j + half]));
          }
        }
      }
    });
  });
}

// [n, 2 * inter] (gate then up) -> [n, inter]: silu(gate) * up.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = torch::empty({n, inter}, gate_up.options());
  dispatch(gate_up, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const T* g = gp + i * gs;
        T* o = op + i * inter;
#pragma omp simd
        for (int64_t j = 0; j < inter; ++j) {
          const float a = load(g[j]);
          // Clamped: exp(88) is finite, and a / (1 + 1.6e38) is already 0 (the build assumes finite math).
          o[j] = store<T>(a / (1.f + std::exp(std::min(-a, 88.f))) * load(g[j + inter]));
        }
      }
    });
  });
  return out;
}

// Index of each row's largest value, the first one on ties (torch.argmax's rule), as int64 `[n]`. Two
// vectorized passes instead of a search with an early exit: the maximum of every 64-value chunk, then
// the first chunk holding the row's maximum is scanned. torch's CPU max/argmax over a bf16 row is not
// vectorized (SmolLM2's [32, 49152] logits: ~1 ms, a few % of a decode step).
torch::Tensor argmax_rows(torch::Tensor x) {
  check_rows(x, "argmax_rows");
  const int64_t n = x.size(0), d = x.size(1), xs = x.stride(0);
  TORCH_CHECK(d > 0, "argmax_rows: empty rows");
  auto out = torch::empty({n}, x.options().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  constexpr int64_t CH = 64;
  dispatch(x, "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> chunk_max((d + CH - 1) / CH);
      for (int64_t i = begin; i < end; ++i) {
        const T* row = xp + i * xs;
        const int64_t full = d / CH;
        for (int64_t c = 0; c < full; ++c) {
          float m = std::numeric_limits<float>::lowest();
#pragma omp simd reduction(max : m)
          for (int64_t j = 0; j < CH; ++j) m = std::max(m, load(row[c * CH + j]));
          chunk_max[c] = m;
        }
        if (full * CH < d) {
          float m = std::numeric_limits<float>::lowest();
          for (int64_t j = full * CH; j < d; ++j) m = std::max(m, load(row[j]));
          chunk_max[full] = m;
        }
        const int64_t chunks = static_cast<int64_t>(chunk_max.size());
        int64_t best_c = 0;
        for (int64_t c = 1; c < chunks; ++c)
          if (chunk_max[c] > chunk_max[best_c]) best_c = c;
        const float best = chunk_max[best_c];
        int64_t idx = best_c * CH;
        const int64_t stop = std::min(d, idx + CH);
        while (idx < stop && load(row[idx]) != best) ++idx;
        op[i] = idx < stop ? idx : best_c * CH;  // a NaN row: no value compares equal
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a kernel runs (as torch's own ops do), so a server's other threads (HTTP
  // streaming, the KV receiver) keep running during a decode step's attention and norms.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode", &paged_decode, "paged decode attention over the KV cache (CPU)", release());
  m.def("rms_norm", &rms_norm, "RMSNorm of [rows, dim] (CPU)", release());
  m.def("row_lse_topk", &row_lse_topk, "each row's log-sum-exp and k largest values with their indices (CPU)",
        release());
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = rms_norm(residual), in place (CPU)",
        release());
  m.def("rope_inplace", &rope_inplace, "rotary embedding of the first heads of each row, in place (CPU)", release());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [rows, 2 * inter] (CPU)", release());
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (CPU)", release());
  m.def("pack_panels", &pack_panels,
        "a [N, K] weight packed for panel_linear: fp32 [ceil(N / 16), K, 16], bf16 [ceil(N / 16), ceil(K / 2), 16, 2]");
  m.def("panel_linear", &panel_linear, "x @ w.T + bias from pack_panels(w), fp32 or bf16 (CPU)", py::arg("x"),
        py::arg("panels"), py::arg("n"), py::arg("bias") = py::none(), release());
  m.def("panel_variants", &panel_variants, "the panel kernels of this build: float32x16 or float32x8, bfloat16");
  m.def("amx_available", &amx_available, "whether this build has the AMX GEMM and the process may use AMX tiles");
  m.def("amx_pack", &amx_pack, "a [N, K] bf16 weight packed for amx_linear: [ceil(N / 32), ceil(K / 32), 2, 16, 16, 2]");
  // prefetch (bytes ahead), hint (0: L1, 1: L2, 2: L3) and kslice (K blocks per slice above 32 rows): -1
  // takes the kernel's defaults; the others are for bench sweeps.
  m.def("amx_linear", &amx_linear, "x @ w.T + bias from amx_pack(w) on AMX tiles, bf16 (CPU)", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::arg("prefetch") = -1,
        py::arg("hint") = -1, py::arg("kslice") = -1, release());
}
