// Shared by the CPU matmul operators (kernels/cpu_gemv*.cpp, built together by kernels/cpu_gemv.py into
// one library): the includes, the ISA switch, the operators' declarations (registered in cpu_gemv.cpp)
// and the helpers more than one of them uses.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// w4a8 in 512-bit registers where the build has AVX-512 VNNI (see row_w4a8_zmm)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define W4A8_ZMM 1
constexpr int W4A8_ROWS = 6;
#else
#define W4A8_ZMM 0
#endif

namespace mfs_cpu {

// The operators (each file's header comment says what it computes and in what order)
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);
at::Tensor w4a8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& dm);
at::Tensor w4a8_tile_gemv(const at::Tensor& x, const at::Tensor& qt, const at::Tensor& dmt);
at::Tensor int8_a8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);
at::Tensor int8_a8_tile_gemv(const at::Tensor& x, const at::Tensor& qt, const at::Tensor& scales);

// f(std::integral_constant<int, r>{}) for a run-time r in 1 .. N: a kernel templated on its row count
template <int N, class F>
inline void with_rows(int r, F&& f) {
  if constexpr (N == 1) {
    f(std::integral_constant<int, 1>{});
  } else if (r == N) {
    f(std::integral_constant<int, N>{});
  } else {
    with_rows<N - 1>(r, f);
  }
}

// Activation rows 0 .. M in passes of up to MAXR over one weight row: kernel(rows, xr, out) with rows an
// integral_constant, xr[i] = row(m + i); then store(m + i, out[i]).
template <int MAXR, class RowT, class RowFn, class Kernel, class Store>
inline void row_passes(int64_t M, RowFn&& row, Kernel&& kernel, Store&& store) {
  for (int64_t m = 0; m < M; m += MAXR) {
    RowT xr[MAXR];
    float out[MAXR];
    const int r = static_cast<int>(std::min<int64_t>(MAXR, M - m));
    for (int i = 0; i < r; i++) xr[i] = row(m + i);
    with_rows<MAXR>(r, [&](auto rows) { kernel(rows, xr, out); });
    for (int i = 0; i < r; i++) store(m + i, out[i]);
  }
}

inline float hsum(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
  return _mm_cvtss_f32(t);
}

inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The checks every operator starts with: CPU tensors, x fp32 [M, K] (K a multiple of 32 for the
// ops that quantize activations per 32)
inline void check_x(const char* op, const at::Tensor& x, const at::Tensor& q, const at::Tensor& t, bool blocks) {
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && t.device().is_cpu(), op, ": CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be fp32 [M, K], got ", x.scalar_type(),
              " ", x.sizes());
  TORCH_CHECK(!blocks || x.size(1) % 32 == 0, op, ": K must be a multiple of 32, got ", x.size(1));
}

// One scale per weight row, fp32 or bf16 (checked, made contiguous; kept alive by `t`)
struct RowScales {
  at::Tensor t;
  const float* f = nullptr;
  const c10::BFloat16* b = nullptr;
  RowScales(const char* op, const at::Tensor& scales, int64_t N) {
    TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N &&
                    (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16),
                op, ": scales must be fp32 or bf16 [N], got ", scales.scalar_type(), " ", scales.sizes());
    t = scales.contiguous();
    if (t.scalar_type() == at::kBFloat16) b = t.const_data_ptr<c10::BFloat16>();
    else f = t.const_data_ptr<float>();
  }
  float operator[](int64_t n) const { return b ? float(b[n]) : f[n]; }
};

// One block of 32 activations quantized as llama.cpp's Q8_1 does: dx = amax / 127, xq =
// round-half-even(x / dx) (vcvtps2dq's default rounding, as nearbyint and torch.round); returns the 32
// values in order, sets dx and, if sum is given, sum(xq).
inline __m256i quantize_block(const float* xb, float* dx, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16),
               x3 = _mm256_loadu_ps(xb + 24);
  const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  t = _mm_max_ss(t, _mm_shuffle_ps(t, t, 1));
  const float d = _mm_cvtss_f32(t) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  const __m256 iv = _mm256_set1_ps(inv);
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, iv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, iv)),
                i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, iv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, iv));
  if (sum) {
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    *sum = _mm_cvtsi128_si32(s4);
  }
  *dx = d;
  // values 0..31 in order (the packs work per 128-bit lane; the permute puts them back in order)
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)),
                                     order);
}

// x [M, K] -> per row xq (plain order) and dx, row m's block b at i = m * RB + b (RB: row_blocks, K / 32
// where 0; a larger stride leaves each row's tail as the caller filled it); side(i, dx, sum of the
// block's xq) for what else an operator keeps per block (w4a8: xs; the int8 head: its correction)
template <class Side>
inline void quantize_rows_plain(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, Side&& side,
                                int64_t row_blocks = 0) {
  const int64_t B = K / 32, RB = row_blocks ? row_blocks : B;
#pragma omp parallel for schedule(static) if (M >= 8)
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < B; b++) {
      float d;
      int32_t sum;
      const __m256i p = quantize_block(x + m * K + b * 32, &d, &sum);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + (m * RB + b) * 32), p);
      dx[m * RB + b] = d;
      side(m * RB + b, d, sum);
    }
  }
}

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace mfs_cpu
