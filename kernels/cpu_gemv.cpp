// Weight-only matmuls for AVX2 CPUs: the torch operator mfs::int8_gemv (this file, which also registers
// the others: mfs::w4a8_gemv and the tile and a8 variants, each in a file of its own)
// (kernels/cpu_gemv.py builds this with the machine's C++ compiler against the installed torch and
// loads it with torch.ops.load_library; a compiled decode graph calls it from C++ like any aten op).
//
//   y[m, n] = scale[n] * sum_k q[n, k] * x[m, k]
//   x fp32 [M, K], q int8 [N, K] contiguous, scale bf16 or fp32 [N], y fp32 [M, N].
//
// Why: torch's _weight_int8pack_mm streams int8 weights at ~8-9 GB/s on the AVX2 machine (it reads
// four weight rows side by side, and rounds the activations to bf16), where the memory reads ~20 GB/s
// with two threads. Here each weight value is widened to fp32 once per pair of activation rows
// (vpmovsxbd + vcvtdq2ps) and multiplied in fp32 with fused multiply-adds; the products are exact and
// the activations are not rounded.
//
// Summation order, the same for every element (m, n) whatever M is and whichever thread computes it:
// four 8-lane accumulators take the K/8 chunks in turn (chunk c into accumulator c % 4), are added
// as (a0 + a1) + (a2 + a3), summed across lanes by hsum, then the K % 8 tail is added in order, then
// the scale multiplies. So a row's output is the same bit for bit at any batch size.
//
// Access pattern: one weight row at a time, front to back, with a software prefetch 2 KB ahead (each
// thread takes a contiguous range of rows). On the Zen 2 machine (two threads, a 28 MB matrix, one
// activation row) that streams at ~19.6 GB/s; reading four rows side by side, as a 4-row register
//
// The other operators: cpu_gemv_w4a8.cpp, cpu_gemv_w4a8_tile.cpp, cpu_gemv_a8.cpp; what they share:
// cpu_gemv.h. This file registers them all (TORCH_LIBRARY mfs).
#include "cpu_gemv.h"

#include <torch/library.h>

namespace mfs_cpu {

// One weight row w [K] against activation rows x[0..MB) (MB <= 2, stride ldx): out[i] = the
// (unscaled) dot product, in the order the header states.
template <int MB>
inline void row_dot(const int8_t* w, int64_t K, const float* x, int64_t ldx, float out[MB]) {
  __m256 a[MB][4];
  for (int i = 0; i < MB; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm256_setzero_ps();
  const int64_t K32 = K & ~int64_t(31), K8 = K & ~int64_t(7);
  int64_t k = 0;
  for (; k < K32; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k + 2048), _MM_HINT_T0);
    const __m256 w0 = widen8(w + k), w1 = widen8(w + k + 8), w2 = widen8(w + k + 16), w3 = widen8(w + k + 24);
    for (int i = 0; i < MB; i++) {
      const float* xi = x + i * ldx + k;
      a[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xi), a[i][0]);
      a[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi + 8), a[i][1]);
      a[i][2] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xi + 16), a[i][2]);
      a[i][3] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xi + 24), a[i][3]);
    }
  }
  for (int c = 0; k < K8; k += 8, c++) {  // fewer than four chunks left: accumulators 0, 1, 2 in turn
    const __m256 wc = widen8(w + k);
    for (int i = 0; i < MB; i++) a[i][c] = _mm256_fmadd_ps(wc, _mm256_loadu_ps(x + i * ldx + k), a[i][c]);
  }
  for (int i = 0; i < MB; i++) {
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a[i][0], a[i][1]), _mm256_add_ps(a[i][2], a[i][3])));
    for (int64_t t = k; t < K; t++) s += float(w[t]) * x[i * ldx + t];
    out[i] = s;
  }
}

// Weight row n against every activation row, two at a time (the row stays in L1 between pairs).
inline void row(const int8_t* q, const float* x, int64_t ldx, float* y, int64_t M, int64_t N, int64_t K,
                int64_t n, const float sc) {
  const int8_t* w = q + n * K;
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) {
    float out[2];
    row_dot<2>(w, K, x + m * ldx, ldx, out);
    y[m * N + n] = out[0] * sc;
    y[(m + 1) * N + n] = out[1] * sc;
  }
  if (m < M) {
    float out[1];
    row_dot<1>(w, K, x + m * ldx, ldx, out);
    y[m * N + n] = out[0] * sc;
  }
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  check_x("mfs::int8_gemv", x, q, scales, false);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "mfs::int8_gemv: q must be contiguous int8 [N, K], got ", q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(x.size(1) == q.size(1), "mfs::int8_gemv: x has ", x.size(1), " columns, q ", q.size(1));
  const RowScales sc("mfs::int8_gemv", scales, q.size(0));
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), N = q.size(0), K = q.size(1), ldx = K;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.const_data_ptr<float>();
  const int8_t* qp = q.const_data_ptr<int8_t>();
  float* yp = y.mutable_data_ptr<float>();
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (N + 15) / 16));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n++) row(qp, xp, ldx, yp, M, N, K, n, sc[n]);
  return y;
}

}  // namespace mfs_cpu

TORCH_LIBRARY(mfs, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("w4a8_gemv(Tensor x, Tensor q, Tensor dm) -> Tensor");
  m.def("int8_a8_gemv(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("w4a8_tile_gemv(Tensor x, Tensor qt, Tensor dmt) -> Tensor");
  m.def("int8_a8_tile_gemv(Tensor x, Tensor qt, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(mfs, CPU, m) {
  m.impl("int8_gemv", &mfs_cpu::int8_gemv);
  m.impl("w4a8_gemv", &mfs_cpu::w4a8_gemv);
  m.impl("int8_a8_gemv", &mfs_cpu::int8_a8_gemv);
  m.impl("w4a8_tile_gemv", &mfs_cpu::w4a8_tile_gemv);
  m.impl("int8_a8_tile_gemv", &mfs_cpu::int8_a8_tile_gemv);
}
