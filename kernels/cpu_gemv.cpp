// Weight-only matmuls for AVX2 CPUs, registered as the torch operators mfs::int8_gemv and mfs::w4a8_gemv
// (the latter further down)
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
// block does, made the prefetchers lose the stream: ~9 GB/s.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
  return _mm_cvtss_f32(t);
}

inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

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
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scales.device().is_cpu(),
              "mfs::int8_gemv: CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "mfs::int8_gemv: x must be fp32 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "mfs::int8_gemv: q must be contiguous int8 [N, K], got ", q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(x.size(1) == q.size(1), "mfs::int8_gemv: x has ", x.size(1), " columns, q ", q.size(1));
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == q.size(0) &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16),
              "mfs::int8_gemv: scales must be fp32 or bf16 [N], got ", scales.scalar_type(), " ", scales.sizes());
  const at::Tensor xc = x.contiguous();
  const at::Tensor sc = scales.contiguous();
  const bool bf16 = sc.scalar_type() == at::kBFloat16;
  const int64_t M = xc.size(0), N = q.size(0), K = q.size(1), ldx = K;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.const_data_ptr<float>();
  const int8_t* qp = q.const_data_ptr<int8_t>();
  const float* sf = bf16 ? nullptr : sc.const_data_ptr<float>();
  const c10::BFloat16* sb = bf16 ? sc.const_data_ptr<c10::BFloat16>() : nullptr;
  float* yp = y.mutable_data_ptr<float>();
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (N + 15) / 16));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n++) row(qp, xp, ldx, yp, M, N, K, n, bf16 ? float(sb[n]) : sf[n]);
  return y;
}

// ---- w4a8: 4-bit weight blocks (GGUF's Q4_1) times activations quantized to 8 bits per 32 ----
//   y[m, n] = sum_b d[n, b] * dx[m, b] * sum_{j<32} u[n, 32b + j] * xq[m, 32b + j] + mn[n, b] * xs[m, b]
// u in 0..15: q uint8 [N, K / 2], per 32 inputs 16 bytes, byte j holding input j in its low nibble
// and input j + 16 in its high one (Q4_1's order); dm fp16 [N, K / 32, 2] = (d, m), the weight being
// d * u + m. Each activation row is quantized per 32 values as llama.cpp's Q8_1 does: dx = amax / 127,
// xq = round-half-even(x / dx) in [-127, 127], xs = dx * sum(xq). The 32 products u * xq are summed
// exactly in integers (vpmaddubsw, vpmaddwd); a row's quantization depends on that row alone, and the
// float sums run in one order (blocks alternately into two 8-lane accumulators, (a0 + a1), hsum, plus
// the mins' terms summed block by block), so a row's output is the same bit for bit at any batch size.

struct QuantRow {
  const int8_t* q;
  const float* d;
  const float* s;
};

inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs) {
  const int64_t B = K / 32;
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < B; b++) {
      const float* xb = x + m * K + b * 32;
      float amax = 0.f;
      for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      int8_t* qb = xq + m * K + b * 32;
      for (int j = 0; j < 32; j++) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
        qb[j] = static_cast<int8_t>(v);
        sum += v;
      }
      dx[m * B + b] = d;
      xs[m * B + b] = d * static_cast<float>(sum);
    }
  }
}

inline __m256i nibbles(const uint8_t* w) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}

inline __m256 block_dot(__m256i u, const int8_t* xq) {
  const __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

template <int MB>
inline void row_w4a8(const uint8_t* w, const at::Half* dm, int64_t B, const QuantRow* xr, float out[MB]) {
  __m256 a0[MB], a1[MB];
  float zs[MB];
  for (int i = 0; i < MB; i++) {
    a0[i] = a1[i] = _mm256_setzero_ps();
    zs[i] = 0.f;
  }
  int64_t b = 0;
  for (; b + 2 <= B; b += 2) {  // blocks in pairs: the even one into a0, the odd one into a1
    _mm_prefetch(reinterpret_cast<const char*>(w + b * 16 + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(dm + b * 2 + 256), _MM_HINT_T0);
    const __m256i u0 = nibbles(w + b * 16), u1 = nibbles(w + b * 16 + 16);
    const __m128 dmv = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dm + b * 2)));  // d0 m0 d1 m1
    const float d0 = _mm_cvtss_f32(dmv), m0 = _mm_cvtss_f32(_mm_shuffle_ps(dmv, dmv, 1));
    const float d1 = _mm_cvtss_f32(_mm_shuffle_ps(dmv, dmv, 2)), m1 = _mm_cvtss_f32(_mm_shuffle_ps(dmv, dmv, 3));
    for (int i = 0; i < MB; i++) {
      a0[i] = _mm256_fmadd_ps(block_dot(u0, xr[i].q + b * 32), _mm256_set1_ps(d0 * xr[i].d[b]), a0[i]);
      a1[i] = _mm256_fmadd_ps(block_dot(u1, xr[i].q + b * 32 + 32), _mm256_set1_ps(d1 * xr[i].d[b + 1]), a1[i]);
      zs[i] += m0 * xr[i].s[b];
      zs[i] += m1 * xr[i].s[b + 1];
    }
  }
  if (b < B) {  // an odd count: the last block is even
    const __m256i u0 = nibbles(w + b * 16);
    const float d0 = static_cast<float>(dm[2 * b]), m0 = static_cast<float>(dm[2 * b + 1]);
    for (int i = 0; i < MB; i++) {
      a0[i] = _mm256_fmadd_ps(block_dot(u0, xr[i].q + b * 32), _mm256_set1_ps(d0 * xr[i].d[b]), a0[i]);
      zs[i] += m0 * xr[i].s[b];
    }
  }
  for (int i = 0; i < MB; i++) out[i] = hsum(_mm256_add_ps(a0[i], a1[i])) + zs[i];
}

at::Tensor w4a8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& dm) {
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && dm.device().is_cpu(),
              "mfs::w4a8_gemv: CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "mfs::w4a8_gemv: x must be fp32 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "mfs::w4a8_gemv: K must be a multiple of 32, got ", K);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous() && q.size(1) * 2 == K,
              "mfs::w4a8_gemv: q must be contiguous uint8 [N, K / 2] = [N, ", K / 2, "], got ", q.scalar_type(),
              " ", q.sizes());
  const int64_t N = q.size(0), B = K / 32;
  TORCH_CHECK(dm.dim() == 3 && dm.size(0) == N && dm.size(1) == B && dm.size(2) == 2 &&
                  dm.scalar_type() == at::kHalf && dm.is_contiguous(),
              "mfs::w4a8_gemv: dm must be contiguous fp16 [N, K / 32, 2] = [", N, ", ", B, ", 2], got ",
              dm.scalar_type(), " ", dm.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * B), xs(M * B);
  quantize_rows(xc.const_data_ptr<float>(), M, K, xq.data(), dx.data(), xs.data());
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const at::Half* dp = dm.const_data_ptr<at::Half>();
  float* yp = y.mutable_data_ptr<float>();
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (N + 15) / 16));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n++) {
    const uint8_t* w = qp + n * (K / 2);
    const at::Half* d = dp + n * B * 2;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
      const QuantRow xr[2] = {{xq.data() + m * K, dx.data() + m * B, xs.data() + m * B},
                              {xq.data() + (m + 1) * K, dx.data() + (m + 1) * B, xs.data() + (m + 1) * B}};
      float out[2];
      row_w4a8<2>(w, d, B, xr, out);
      yp[m * N + n] = out[0];
      yp[(m + 1) * N + n] = out[1];
    }
    if (m < M) {
      const QuantRow xr[1] = {{xq.data() + m * K, dx.data() + m * B, xs.data() + m * B}};
      float out[1];
      row_w4a8<1>(w, d, B, xr, out);
      yp[m * N + n] = out[0];
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(mfs, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("w4a8_gemv(Tensor x, Tensor q, Tensor dm) -> Tensor");
}

TORCH_LIBRARY_IMPL(mfs, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
  m.impl("w4a8_gemv", &w4a8_gemv);
}
