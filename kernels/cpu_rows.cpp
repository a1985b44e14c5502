// The per-row elementwise and norm work of a decoder layer, registered as torch operators
// (kernels/cpu_rows.py builds them with kernels/cpu_gemv.py's builder and loads them):
//
//   mfs::add_rms_norm(x, residual, w, eps) -> (y, s):   s = x + residual,
//                                                       y = w * (s * (1 / sqrt(mean(s^2) + eps)))
//   mfs::rms_norm(x, w, eps) -> y:                      the same with s = x
//   mfs::silu_mul(g, u) -> g * sigmoid(g) * u
//   mfs::rotary(q, k, pos, cos_sin) -> (q', k'):       per head [x1 c - x2 s, x2 c + x1 s], (c, s) the
//                                                       halves of cos_sin[pos[t]] (neox "rotate half")
//
// fp32 CPU tensors, the last dim contiguous; outputs contiguous.
//
// Why: torch's reductions and inductor's fused loops sum a row in orders that depend on the build, the
// vector width chosen for the shape, and for the compiled graph on how the ops were fused; its
// elementwise code may contract a multiply and an add into one rounding where the eager ops round twice.
// The eager layers and the compiled decode graph both call these operators (opaque to inductor), so a
// row's values are the same bits on either path, at any batch size and thread count: each row is one
// thread's, summed in an order that depends on the row's length only (8 lanes across the row, then a
// fixed horizontal sum), and every elementwise value is one fixed instruction sequence.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using mfs_vec::exp_nonpos;
using mfs_vec::hsum;

constexpr int64_t GRAIN = 16384;  // values below which a range of rows runs inline (a decode step's few rows)

inline int64_t grain(int64_t per_row) { return std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, per_row)); }

// The first n (< 8) floats of p as a vector, the rest zero; and its store.
inline __m256 load_tail(const float* p, int64_t n) {
  alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t j = 0; j < n; j++) t[j] = p[j];
  return _mm256_load_ps(t);
}

inline void store_tail(float* p, __m256 v, int64_t n) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int64_t j = 0; j < n; j++) p[j] = t[j];
}

void check_rows(const char* op, const char* what, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, op, ": ",
              what, " must be fp32 CPU [M, N] with contiguous rows, got ", t.scalar_type(), " ", t.sizes(), " strides ",
              t.strides());
}

// ---- RMSNorm, with the residual add ----
// y (and s = x + residual where residual is given) of rows x
std::tuple<at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& w_,
                                             double eps) {
  check_rows("mfs::add_rms_norm", "x", x);
  const int64_t M = x.size(0), H = x.size(1);
  const bool has_r = residual != nullptr;
  if (has_r) {
    check_rows("mfs::add_rms_norm", "residual", *residual);
    TORCH_CHECK(residual->sizes() == x.sizes(), "mfs::add_rms_norm: residual ", residual->sizes(), " for x ", x.sizes());
  }
  TORCH_CHECK(w_.dim() == 1 && w_.size(0) == H && w_.scalar_type() == at::kFloat,
              "mfs::add_rms_norm: w must be fp32 [", H, "], got ", w_.scalar_type(), " ", w_.sizes());
  const at::Tensor w = w_.contiguous();
  at::Tensor y = at::empty({M, H}, x.options());
  at::Tensor s = has_r ? at::empty({M, H}, x.options()) : at::Tensor();
  const float* xp = x.const_data_ptr<float>();
  const float* rp = has_r ? residual->const_data_ptr<float>() : nullptr;
  const float* wp = w.const_data_ptr<float>();
  const int64_t xs = x.stride(0), rs = has_r ? residual->stride(0) : 0;
  const float e = static_cast<float>(eps), invH = 1.0f / static_cast<float>(H);
  at::parallel_for(0, M, grain(H), [&](int64_t b, int64_t end) {
    for (int64_t m = b; m < end; m++) {
      const float* xr = xp + m * xs;
      float* sr = has_r ? s.data_ptr<float>() + m * H : nullptr;
      float* yr = y.data_ptr<float>() + m * H;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= H; i += 8) {
        __m256 v = _mm256_loadu_ps(xr + i);
        if (has_r) {
          v = _mm256_add_ps(v, _mm256_loadu_ps(rp + m * rs + i));
          _mm256_storeu_ps(sr + i, v);
        }
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      if (i < H) {
        __m256 v = load_tail(xr + i, H - i);
        if (has_r) {
          v = _mm256_add_ps(v, load_tail(rp + m * rs + i, H - i));
          store_tail(sr + i, v, H - i);
        }
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      const float inv = 1.0f / std::sqrt(hsum(acc) * invH + e);
      const __m256 inv8 = _mm256_set1_ps(inv);
      const float* src = has_r ? sr : xr;
      for (i = 0; i + 8 <= H; i += 8)
        _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(wp + i), _mm256_mul_ps(_mm256_loadu_ps(src + i), inv8)));
      if (i < H)
        store_tail(yr + i, _mm256_mul_ps(load_tail(wp + i, H - i), _mm256_mul_ps(load_tail(src + i, H - i), inv8)),
                   H - i);
    }
  });
  return {y, s};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  return norm_rows(x, &residual, w, eps);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return std::get<0>(norm_rows(x, nullptr, w, eps)); }

// ---- SiLU(g) * u ----
// sigmoid(g) from e = e^-|g| (never overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 e = exp_nonpos(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));  // -|g|
  const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, neg);
  const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  check_rows("mfs::silu_mul", "g", g);
  check_rows("mfs::silu_mul", "u", u);
  TORCH_CHECK(g.sizes() == u.sizes(), "mfs::silu_mul: g ", g.sizes(), " and u ", u.sizes());
  const int64_t M = g.size(0), N = g.size(1), gs = g.stride(0), us = u.stride(0);
  at::Tensor y = at::empty({M, N}, g.options());
  const float* gp = g.const_data_ptr<float>();
  const float* up = u.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, grain(N), [&](int64_t b, int64_t end) {
    for (int64_t m = b; m < end; m++) {
      const float *gr = gp + m * gs, *ur = up + m * us;
      float* yr = yp + m * N;
      int64_t i = 0;
      for (; i + 8 <= N; i += 8) _mm256_storeu_ps(yr + i, silu_mul8(_mm256_loadu_ps(gr + i), _mm256_loadu_ps(ur + i)));
      if (i < N) store_tail(yr + i, silu_mul8(load_tail(gr + i, N - i), load_tail(ur + i, N - i)), N - i);
    }
  });
  return y;
}

// ---- rotary ----
// One head's D values x (strided source) rotated into o: [x1 c - x2 s, x2 c + x1 s], half = D / 2.
inline void rotate(const float* x, const float* c, const float* s, int64_t half, float* o) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    const __m256 cc = _mm256_loadu_ps(c + i), ss = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(o + i, _mm256_fmsub_ps(x1, cc, _mm256_mul_ps(x2, ss)));
    _mm256_storeu_ps(o + half + i, _mm256_fmadd_ps(x2, cc, _mm256_mul_ps(x1, ss)));
  }
  for (; i < half; i++) {
    o[i] = std::fma(x[i], c[i], -(x[half + i] * s[i]));
    o[half + i] = std::fma(x[half + i], c[i], x[i] * s[i]);
  }
}

at::Tensor rotate_heads(const char* what, const at::Tensor& x, const int64_t* pos, const float* cs, int64_t P) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 &&
                  x.size(2) % 2 == 0,
              "mfs::rotary: ", what, " must be fp32 CPU [T, H, D] (D even, last dim contiguous), got ", x.scalar_type(),
              " ", x.sizes(), " strides ", x.strides());
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, ts = x.stride(0), hs = x.stride(1);
  at::Tensor o = at::empty({T, H, D}, x.options());
  const float* xp = x.const_data_ptr<float>();
  float* op = o.data_ptr<float>();
  at::parallel_for(0, T, grain(H * D), [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; t++) {
      const float* row = cs + pos[t] * D;
      for (int64_t h = 0; h < H; h++) rotate(xp + t * ts + h * hs, row, row + half, half, op + (t * H + h) * D);
    }
  });
  return o;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& pos_,
                                          const at::Tensor& cos_sin_) {
  TORCH_CHECK(pos_.dim() == 1 && pos_.scalar_type() == at::kLong && pos_.size(0) == q.size(0) &&
                  k.size(0) == q.size(0),
              "mfs::rotary: pos must be int64 [T] for q ", q.sizes(), " and k ", k.sizes(), ", got ", pos_.sizes());
  TORCH_CHECK(cos_sin_.dim() == 2 && cos_sin_.scalar_type() == at::kFloat && cos_sin_.size(1) == q.size(2) &&
                  k.size(2) == q.size(2),
              "mfs::rotary: cos_sin must be fp32 [P, D] for head_dim ", q.size(2), ", got ", cos_sin_.sizes());
  const at::Tensor pos = pos_.contiguous(), cos_sin = cos_sin_.contiguous();
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  const int64_t P = cos_sin.size(0);
  for (int64_t t = 0; t < pos.size(0); t++)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < P, "mfs::rotary: position ", pp[t], " outside the table's ", P);
  const float* cs = cos_sin.const_data_ptr<float>();
  return {rotate_heads("q", q, pp, cs, P), rotate_heads("k", k, pp, cs, P)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mfs, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor pos, Tensor cos_sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mfs, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
}
