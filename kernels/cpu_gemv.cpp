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

namespace {

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

// ---- w4a8: 4-bit weight blocks (GGUF's Q4_1) times activations quantized to 8 bits per 32 ----
//   y[m, n] = sum_b d[n, b] * dx[m, b] * sum_{j<32} u[n, 32b + j] * xq[m, 32b + j] + mn[n, b] * xs[m, b]
// u in 0..15: q uint8 [N, K / 2], per 32 inputs 16 bytes, byte j holding input j in its low nibble
// and input j + 16 in its high one (Q4_1's order); dm fp16 [N, K / 32, 2] = (d, m), the weight being
// d * u + m. Each activation row is quantized per 32 values as llama.cpp's Q8_1 does: dx = amax / 127,
// xq = round-half-even(x / dx) in [-127, 127], xs = dx * sum(xq).
//
// Blocks go in pairs (A, B): one 32-byte load holds both blocks' codes, its low nibbles are inputs
// 0..15 of A and of B, its high nibbles inputs 16..31; the activations are quantized into the same
// order (per pair: A's and B's first 16 values, then their last 16), so two byte dot products --
// vpdpbusd where the CPU has AVX-512 VNNI (built for it by kernels/cpu_gemv.py), else vpmaddubsw on
// each half, one 16-bit add and vpmaddwd (u <= 15, |xq| <= 127: no sum can saturate) -- give A's
// integer sum split over lanes 0..3 and B's over lanes 4..7, exactly. Converted to fp32, they take one
// fused multiply-add with [d_A dx_A] x 4 | [d_B dx_B] x 4 (the d's spread from the fp16 pairs with one
// permute) into one of two accumulators (pairs alternately); the mins' terms m * xs go four blocks at
// a time into a third: the fp16 (d, m) pairs times (0, xs) pairs. Then hsum(acc0 + acc1) + hsum(zacc).
// That order depends on K only (a last short group is padded with zeros) and a row's quantization on
// that row only, so a row's output is the same bit for bit at any batch size. No horizontal work per
// block, no scalar chain: ~7 instructions a block at one activation row.
//
// Each thread takes a contiguous range of weight rows, front to back; each weight row meets the
// activation rows two at a time (its 4-block groups are loaded and spread once per pair) -- or, in an
// AVX-512 VNNI build, up to six at a time in 512-bit registers (row_w4a8_zmm).

// The activation side of one row: xq [pad4(B) * 32] in pair order, dx4 [pad4(B) * 4] (each block's
// dx four times), xsz [pad4(B) * 2] (0, xs per block); zeros past B.
struct QuantRow {
  const int8_t* q;
  const float* dx4;
  const float* xsz;
};

inline int64_t pad4(int64_t b) { return (b + 3) & ~int64_t(3); }

inline __m256i pair_idot(__m256i v, const int8_t* xq) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x0), hi, x1);
#else
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

// One pair of blocks (or a lone last block when Lone: its pair's B half is zero) of one weight row
// against MB activation rows into accumulator `which`: codes v, fp16 (d, m) spread to dmf.
template <int MB>
inline void pair_step(__m256i v, __m256 dmf, __m256 dd, int64_t b, const QuantRow* xr, __m256 (*acc)[3],
                      int which) {
  for (int i = 0; i < MB; i++)
    acc[i][which] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_idot(v, xr[i].q + b * 32)),
                                    _mm256_mul_ps(dd, _mm256_loadu_ps(xr[i].dx4 + b * 4)), acc[i][which]);
}

template <int MB>
inline void mins_step(__m256 dmf, int64_t b, const QuantRow* xr, __m256 (*acc)[3]) {
  for (int i = 0; i < MB; i++) acc[i][2] = _mm256_fmadd_ps(dmf, _mm256_loadu_ps(xr[i].xsz + b * 2), acc[i][2]);
}

inline __m256i load_codes(const uint8_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }

template <int MB>
inline void row_w4a8(const uint8_t* w, const at::Half* dm, int64_t B, const QuantRow* xr, float* out) {
  __m256 acc[MB][3];
  for (int i = 0; i < MB; i++) acc[i][0] = acc[i][1] = acc[i][2] = _mm256_setzero_ps();
  const __m256i lo2 = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), hi2 = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
  int64_t b = 0;
  for (; b + 4 <= B; b += 4) {  // four blocks: pairs into acc 0 and 1, the mins into acc 2
    _mm_prefetch(reinterpret_cast<const char*>(w + b * 16 + 1024), _MM_HINT_T0);
    const __m256 dmf = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + b * 2)));  // dA mA dB mB ..
    pair_step<MB>(load_codes(w + b * 16), dmf, _mm256_permutevar8x32_ps(dmf, lo2), b, xr, acc, 0);
    pair_step<MB>(load_codes(w + b * 16 + 32), dmf, _mm256_permutevar8x32_ps(dmf, hi2), b + 2, xr, acc, 1);
    mins_step<MB>(dmf, b, xr, acc);
  }
  if (b + 2 <= B) {  // a pair left (its four halves; the rest of dmf zero)
    const __m256 dmf = _mm256_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dm + b * 2)));
    pair_step<MB>(load_codes(w + b * 16), dmf, _mm256_permutevar8x32_ps(dmf, lo2), b, xr, acc, 0);
    mins_step<MB>(dmf, b, xr, acc);
    b += 2;
  }
  if (b < B) {  // a lone block: its 16 bytes, its pair's other half zero
    int32_t h2;
    std::memcpy(&h2, dm + b * 2, sizeof h2);
    const __m256 dmf = _mm256_cvtph_ps(_mm_cvtsi32_si128(h2));
    const __m256i v = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16)));
    pair_step<MB>(v, dmf, _mm256_permutevar8x32_ps(dmf, lo2), b, xr, acc, 1);
    mins_step<MB>(dmf, b, xr, acc);
  }
  for (int i = 0; i < MB; i++) out[i] = hsum(_mm256_add_ps(acc[i][0], acc[i][1])) + hsum(acc[i][2]);
}

#if W4A8_ZMM
// The 512-bit form (AVX-512 VNNI builds): four blocks (two pairs, 64 bytes of codes) per register and
// per pair of vpdpbusd, the activations quantized four blocks to 128 bytes to match (quantize_rows).
// Groups of four go alternately into two accumulators, the mins into a third (8 lanes), as above;
// a last short group loads only its blocks' codes and scales (masked), the rest zero. Its order
// depends on K only, like the 256-bit form's (a different order: the two builds' outputs differ in
// the last bits, each the same at any batch size). Up to W4A8_ROWS activation rows per pass (three
// accumulators each). On the Zen 5 machine (full-width 512-bit units), against the 256-bit form at
// the same rows: 10-40 % less time on cache-resident weights at 2-16 rows, ~20 % at 6 rows over the
// model's 30 layers streamed from memory, the same at one row; six rows per pass beat four and eight
// (docs/BENCHMARKS.md).
template <int MB>
inline void group_step(__m512i v, __m256 dmf, int64_t b, const QuantRow* xr, __m512 (*acc)[2], __m256* zacc,
                       int which) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  const __m512 dd = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6),
                                          _mm512_castps256_ps512(dmf));
  for (int i = 0; i < MB; i++) {
    const int8_t* xq = xr[i].q + b * 32;
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq)),
                                            hi, _mm512_loadu_si512(xq + 64));
    acc[i][which] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dd, _mm512_loadu_ps(xr[i].dx4 + b * 4)),
                                    acc[i][which]);
    zacc[i] = _mm256_fmadd_ps(dmf, _mm256_loadu_ps(xr[i].xsz + b * 2), zacc[i]);
  }
}

template <int MB>
inline void row_w4a8_zmm(const uint8_t* w, const at::Half* dm, int64_t B, const QuantRow* xr, float* out) {
  __m512 acc[MB][2];
  __m256 zacc[MB];
  for (int i = 0; i < MB; i++) {
    acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    zacc[i] = _mm256_setzero_ps();
  }
  auto group = [&](int64_t b, int which) {
    const __m256 dmf = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + b * 2)));
    group_step<MB>(_mm512_loadu_si512(w + b * 16), dmf, b, xr, acc, zacc, which);
  };
  int64_t b = 0;
  for (; b + 8 <= B; b += 8) {  // two groups: into accumulators 0 and 1
    _mm_prefetch(reinterpret_cast<const char*>(w + b * 16 + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + b * 16 + 1088), _MM_HINT_T0);
    group(b, 0);
    group(b + 4, 1);
  }
  if (b + 4 <= B) {
    group(b, 0);
    b += 4;
  }
  if (b < B) {  // a short group: its blocks' 16 bytes and 2 halves each, the rest zero
    const int64_t n = B - b;
    const __m256 dmf = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << (2 * n)) - 1), dm + b * 2));
    group_step<MB>(_mm512_maskz_loadu_epi8((1ull << (16 * n)) - 1, w + b * 16), dmf, b, xr, acc, zacc, 1);
  }
  for (int i = 0; i < MB; i++) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1])) + hsum(zacc[i]);
}
#endif

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

// x [M, K] -> per row xq (pair order), dx4, xsz as QuantRow describes, each row pad4(B) blocks long
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx4, float* xsz) {
  const int64_t B = K / 32, BP = pad4(B);
#pragma omp parallel for schedule(static) if (M >= 8)
  for (int64_t m = 0; m < M; m++) {
    int8_t* q = xq + m * BP * 32;
    if (BP != B) std::memset(q, 0, BP * 32);  // padding blocks' values interleave with real ones: zero all first
    for (int64_t b = B; b < BP; b++) {
      for (int j = 0; j < 4; j++) dx4[m * BP * 4 + b * 4 + j] = 0.f;
      xsz[m * BP * 2 + b * 2] = xsz[m * BP * 2 + b * 2 + 1] = 0.f;
    }
    for (int64_t b = 0; b < B; b++) {
      float d;
      int32_t sum;
      const __m256i p = quantize_block(x + m * K + b * 32, &d, &sum);
#if W4A8_ZMM
      // four blocks (two pairs P0, P1) per 128 bytes: P0's first halves, P1's, P0's last halves, P1's
      int8_t* first = q + (b / 4) * 128 + ((b % 4) / 2) * 32 + (b % 2) * 16;
      int8_t* last = first + 64;
#else
      int8_t* first = q + (b / 2) * 64 + (b % 2) * 16;  // A's values at 0..15 and 32..47, B's at 16..31, 48..63
      int8_t* last = first + 32;
#endif
      _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm256_castsi256_si128(p));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(last), _mm256_extracti128_si256(p, 1));
      for (int j = 0; j < 4; j++) dx4[m * BP * 4 + b * 4 + j] = d;
      xsz[m * BP * 2 + b * 2] = 0.f;
      xsz[m * BP * 2 + b * 2 + 1] = d * static_cast<float>(sum);
    }
  }
}

at::Tensor w4a8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& dm) {
  check_x("mfs::w4a8_gemv", x, q, dm, true);
  const int64_t K = x.size(1);
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
  const int64_t BP = pad4(B);
  std::vector<int8_t> xq(M * BP * 32);
  std::vector<float> dx4(M * BP * 4), xsz(M * BP * 2);
  quantize_rows(xc.const_data_ptr<float>(), M, K, xq.data(), dx4.data(), xsz.data());
  auto row = [&](int64_t m) { return QuantRow{xq.data() + m * BP * 32, dx4.data() + m * BP * 4, xsz.data() + m * BP * 2}; };
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const at::Half* dp = dm.const_data_ptr<at::Half>();
  float* yp = y.mutable_data_ptr<float>();
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (N + 15) / 16));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n++) {
    const uint8_t* w = qp + n * (K / 2);
    const at::Half* d = dp + n * B * 2;
#if W4A8_ZMM
    // up to W4A8_ROWS activation rows per pass over the weight row
    row_passes<W4A8_ROWS, QuantRow>(
        M, row, [&](auto rows, const QuantRow* xr, float* out) { row_w4a8_zmm<decltype(rows)::value>(w, d, B, xr, out); },
        [&](int64_t m, float v) { yp[m * N + n] = v; });
#else
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
      const QuantRow xr[2] = {row(m), row(m + 1)};
      float out[2];
      row_w4a8<2>(w, d, B, xr, out);
      yp[m * N + n] = out[0];
      yp[(m + 1) * N + n] = out[1];
    }
    if (m < M) {
      const QuantRow xr[1] = {row(m)};
      float out[1];
      row_w4a8<1>(w, d, B, xr, out);
      yp[m * N + n] = out[0];
    }
#endif
  }
  return y;
}

// ---- w4a8 in tiles of 16 weight rows: one register lane per output ----
//   y[m, n] = sum_b ( dx[m, b] * d[n, b] * sum_{j<32} u[n, 32b + j] * xq[m, 32b + j] + m[n, b] * xs[m, b] )
// the same sum as mfs::w4a8_gemv (xs[m, b] = dx[m, b] * sum_j xq[m, 32b + j]), the activations quantized
// the same way. mfs::w4a8_gemv spreads one weight row's block over a register's lanes, so every block
// of every activation row ends in a conversion, a multiply and two fused multiply-adds of partial
// lanes, and a horizontal sum per output: per 128 weights and activation row ~10 instructions for 2
// vpdpbusd. Here the weights are interleaved 16 rows to a tile (tile_q4_rows in cpu_gemv.py), so a
// lane is one output row: 8 vpdpbusd (four activation bytes broadcast to the 16 lanes) take one block
// of 16 rows, then one conversion, one multiply (d x dx) and two fused multiply-adds finish it for all
// 16 -- ~12 instructions per 512 weights and activation row, and the nibble unpacking is shared by
// the activation rows of a pass. The layout:
//   qt uint8 [N/16, B, 4, 16, 4]: qt[t, b, p, j, i] = the Q4_1 byte 4p + i of row 16t + j's block b
//     (low nibble input 32b + 4p + i, high nibble input 32b + 16 + 4p + i);
//   dmt fp16 [N/16, B, 2, 16]: the 16 rows' d, then their m.
// Order: per output one accumulator takes the blocks in turn (the product term, then the mins term):
// it depends on K only, so a row's output is the same bit for bit at any batch size. Without VNNI the
// block's integer sum is the same exact integer (eight vpmaddubsw summed in 16 bits: 8 * 2 * 15 * 127
// < 32768, then vpmaddwd), taken 8 rows to a register: the two builds agree bit for bit.

struct TileRow {
  const int8_t* q;   // [B * 32] plain order
  const float* dx;   // [B]
  const float* xs;   // [B]: dx * sum of the block's xq
};

// x [M, K] -> per row xq (plain order) and dx [M, B]; side(m * B + b, dx, sum of the block's xq) for
// what else a tile operator keeps per block (w4a8: xs; the int8 head: its correction)
template <class Side>
inline void quantize_rows_plain(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, Side&& side) {
  const int64_t B = K / 32;
#pragma omp parallel for schedule(static) if (M >= 8)
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < B; b++) {
      float d;
      int32_t sum;
      const __m256i p = quantize_block(x + m * K + b * 32, &d, &sum);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + b * 32), p);
      dx[m * B + b] = d;
      side(m * B + b, d, sum);
    }
  }
}

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if W4A8_ZMM
constexpr int TILE_ROWS = 8;  // activation rows per pass over a tile

// One tile (16 weight rows, B blocks) against MB activation rows: out[i * 16 + j] = y[row i, 16t + j]
template <int MB>
inline void tile_w4a8(const uint8_t* w, const at::Half* dm, int64_t B, const TileRow* xr, float* out) {
  __m512 acc[MB];
  for (int i = 0; i < MB; i++) acc[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < B; b++) {
    const uint8_t* wb = w + b * 256;
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4096), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4160), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4224), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4288), _MM_HINT_T0);
    __m512i lo[4], hi[4];
    for (int p = 0; p < 4; p++) {
      const __m512i v = _mm512_loadu_si512(wb + p * 64);
      lo[p] = _mm512_and_si512(v, low);
      hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + b * 32)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + b * 32 + 16)));
    for (int i = 0; i < MB; i++) {
      const int8_t* xq = xr[i].q + b * 32;
      __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], _mm512_set1_epi32(four_bytes(xq)));
      s = _mm512_dpbusd_epi32(s, lo[1], _mm512_set1_epi32(four_bytes(xq + 4)));
      s = _mm512_dpbusd_epi32(s, lo[2], _mm512_set1_epi32(four_bytes(xq + 8)));
      s = _mm512_dpbusd_epi32(s, lo[3], _mm512_set1_epi32(four_bytes(xq + 12)));
      s = _mm512_dpbusd_epi32(s, hi[0], _mm512_set1_epi32(four_bytes(xq + 16)));
      s = _mm512_dpbusd_epi32(s, hi[1], _mm512_set1_epi32(four_bytes(xq + 20)));
      s = _mm512_dpbusd_epi32(s, hi[2], _mm512_set1_epi32(four_bytes(xq + 24)));
      s = _mm512_dpbusd_epi32(s, hi[3], _mm512_set1_epi32(four_bytes(xq + 28)));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xr[i].dx[b])), acc[i]);
      acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xr[i].xs[b]), acc[i]);
    }
  }
  for (int i = 0; i < MB; i++) _mm512_storeu_ps(out + i * 16, acc[i]);
}
#else
constexpr int TILE_ROWS = 4;

// The half h (rows 8h .. 8h + 7) of one tile against MB activation rows: out[i * 16 + 8h + j]
template <int MB>
inline void tile_w4a8_half(const uint8_t* w, const at::Half* dm, int64_t B, int h, const TileRow* xr, float* out) {
  __m256 acc[MB];
  for (int i = 0; i < MB; i++) acc[i] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < B; b++) {
    const uint8_t* wb = w + b * 256 + h * 32;
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4096), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4224), _MM_HINT_T0);
    __m256i lo[4], hi[4];
    for (int p = 0; p < 4; p++) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64));
      lo[p] = _mm256_and_si256(v, low);
      hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + b * 32 + h * 8)));
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + b * 32 + 16 + h * 8)));
    for (int i = 0; i < MB; i++) {
      const int8_t* xq = xr[i].q + b * 32;
      __m256i s16 = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(four_bytes(xq)));
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[1], _mm256_set1_epi32(four_bytes(xq + 4))));
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[2], _mm256_set1_epi32(four_bytes(xq + 8))));
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[3], _mm256_set1_epi32(four_bytes(xq + 12))));
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(four_bytes(xq + 16))));
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[1], _mm256_set1_epi32(four_bytes(xq + 20))));
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[2], _mm256_set1_epi32(four_bytes(xq + 24))));
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[3], _mm256_set1_epi32(four_bytes(xq + 28))));
      const __m256i s = _mm256_madd_epi16(s16, ones);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(xr[i].dx[b])), acc[i]);
      acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xr[i].xs[b]), acc[i]);
    }
  }
  for (int i = 0; i < MB; i++) _mm256_storeu_ps(out + i * 16 + h * 8, acc[i]);
}

template <int MB>
inline void tile_w4a8(const uint8_t* w, const at::Half* dm, int64_t B, const TileRow* xr, float* out) {
  tile_w4a8_half<MB>(w, dm, B, 0, xr, out);
  tile_w4a8_half<MB>(w, dm, B, 1, xr, out);
}
#endif

at::Tensor w4a8_tile_gemv(const at::Tensor& x, const at::Tensor& qt, const at::Tensor& dmt) {
  check_x("mfs::w4a8_tile_gemv", x, qt, dmt, true);
  const int64_t K = x.size(1), B = K / 32;
  TORCH_CHECK(qt.dim() == 5 && qt.scalar_type() == at::kByte && qt.is_contiguous() && qt.size(1) == B &&
                  qt.size(2) == 4 && qt.size(3) == 16 && qt.size(4) == 4,
              "mfs::w4a8_tile_gemv: qt must be contiguous uint8 [N / 16, K / 32, 4, 16, 4] = [N / 16, ", B,
              ", 4, 16, 4], got ", qt.scalar_type(), " ", qt.sizes());
  const int64_t T = qt.size(0), N = T * 16;
  TORCH_CHECK(dmt.dim() == 4 && dmt.size(0) == T && dmt.size(1) == B && dmt.size(2) == 2 && dmt.size(3) == 16 &&
                  dmt.scalar_type() == at::kHalf && dmt.is_contiguous(),
              "mfs::w4a8_tile_gemv: dmt must be contiguous fp16 [N / 16, K / 32, 2, 16] = [", T, ", ", B,
              ", 2, 16], got ", dmt.scalar_type(), " ", dmt.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * B), xs(M * B);
  float* xsp = xs.data();
  quantize_rows_plain(xc.const_data_ptr<float>(), M, K, xq.data(), dx.data(),
                      [xsp](int64_t i, float d, int32_t sum) { xsp[i] = d * static_cast<float>(sum); });
  auto row = [&](int64_t m) { return TileRow{xq.data() + m * K, dx.data() + m * B, xs.data() + m * B}; };
  const uint8_t* qp = qt.const_data_ptr<uint8_t>();
  const at::Half* dp = dmt.const_data_ptr<at::Half>();
  float* yp = y.mutable_data_ptr<float>();
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), T));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < T; t++) {
    const uint8_t* w = qp + t * B * 256;
    const at::Half* d = dp + t * B * 32;
    for (int64_t m = 0; m < M; m += TILE_ROWS) {
      TileRow xr[TILE_ROWS];
      float out[TILE_ROWS * 16];
      const int r = static_cast<int>(std::min<int64_t>(TILE_ROWS, M - m));
      for (int i = 0; i < r; i++) xr[i] = row(m + i);
      with_rows<TILE_ROWS>(r, [&](auto rows) { tile_w4a8<decltype(rows)::value>(w, d, B, xr, out); });
      for (int i = 0; i < r; i++) std::memcpy(yp + (m + i) * N + t * 16, out + i * 16, 16 * sizeof(float));
    }
  }
  return y;
}

// ---- int8 a8: int8 weights (one scale per output row) times activations quantized per 32 to 8 bits ----
//   y[m, n] = scale[n] * sum_b dx[m, b] * sum_{j<32} q[n, 32b + j] * xq[m, 32b + j]
// the activations quantized as for w4a8 (dx = amax / 127 per 32 values, xq round-half-even), in
// plain order. For the int8 head of --weights w4a8, as llama.cpp runs a Q8_0 output matrix: each
// block's 32 products are summed exactly in integers, then scaled in fp32 once per block -- against
// mfs::int8_gemv's widening of every weight to fp32 once per pair of activation rows, which makes
// a 16-row head compute-bound.
//
// With AVX-512 VNNI, two blocks (64 bytes) at a time: vpdpbusd wants unsigned x signed bytes, so the
// activations are stored as xq + 128 (flipped once, at quantization) against the signed weights, and
// the accumulator starts from -128 times the sum of each lane's four weights (one vpdpbusd of 0x80
// bytes per pair of a weight row, shared by the activation rows), so its 16 lanes hold the exact
// integer sums; converted to fp32 they take one fused multiply-add with [dx_A x 8 | dx_B x 8]. Without VNNI, one block (32 bytes) at a time: vpmaddubsw of
// |q| and xq signed by q (|q|, |xq| <= 127: no pair sum saturates), vpmaddwd, then the same conversion
// and multiply-add with [dx x 8]. Pairs (blocks) go alternately into two accumulators; a row's
// output = hsum(acc0 + acc1) * scale, an order that depends on K only, so a row's output is the same
// bit for bit at any batch size (and each activation row is quantized on its own).

// activation rows per pass over a weight row (a short last pass takes the rest: 6 rows are 4 + 2, not
// 4 + 1 + 1). Eight in 512-bit registers measured slower than four on the Zen 5 machine (8 rows 1.4-1.7
// ms against 1.0-1.1 at the head's shape; docs/BENCHMARKS.md).
constexpr int A8_ROWS = 4;

struct A8Row {
  const int8_t* q;   // [pad2(B) * 32] plain order (with VNNI: xq + 128 as unsigned bytes), zeros past B
  const float* dx8;  // [pad2(B) * 8] each block's dx eight times, zeros past B
};

inline int64_t pad2(int64_t b) { return (b + 1) & ~int64_t(1); }

// x [M, K] -> per row xq, dx8 as A8Row describes, each row pad2(B) blocks long
inline void quantize_rows_a8(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx8) {
  const int64_t B = K / 32, BP = pad2(B);
#pragma omp parallel for schedule(static) if (M >= 8)
  for (int64_t m = 0; m < M; m++) {
    int8_t* q = xq + m * BP * 32;
    float* d8 = dx8 + m * BP * 8;
    std::memset(q + B * 32, 0, (BP - B) * 32);
    std::memset(d8 + B * 8, 0, (BP - B) * 8 * sizeof(float));
    for (int64_t b = 0; b < B; b++) {
      float d;
      __m256i p = quantize_block(x + m * K + b * 32, &d, nullptr);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      p = _mm256_xor_si256(p, _mm256_set1_epi8(static_cast<char>(0x80)));  // xq + 128, vpdpbusd's unsigned side
#endif
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), p);
      for (int j = 0; j < 8; j++) d8[b * 8 + j] = d;
    }
  }
}

// One pair of blocks (64 bytes from w + b * 32; `lone`: only the first block's 32 bytes are the row's)
// of one weight row against MB activation rows into accumulator `which`.
template <int MB>
inline void a8_pair(const int8_t* w, int64_t b, bool lone, const A8Row* xr, __m512 (*acc)[2], int which) {
  const __m512i q = lone ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, w + b * 32) : _mm512_loadu_si512(w + b * 32);
  // 128 * the sum of each 4 weights, negated: the accumulator the activation rows' sums start from
  const __m512i neg = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(
      _mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), q));
  for (int i = 0; i < MB; i++) {
    const __m512i dot = _mm512_dpbusd_epi32(neg, _mm512_loadu_si512(xr[i].q + b * 32), q);
    acc[i][which] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(xr[i].dx8 + b * 8), acc[i][which]);
  }
}

// One block (32 bytes from w + b * 32) against MB activation rows into accumulator `which`.
template <int MB>
inline void a8_block(const int8_t* w, int64_t b, const A8Row* xr, __m256 (*acc)[2], int which) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
  const __m256i aq = _mm256_abs_epi8(q);
  for (int i = 0; i < MB; i++) {
    const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[i].q + b * 32)), q);
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, xs), _mm256_set1_epi16(1));
    acc[i][which] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_loadu_ps(xr[i].dx8 + b * 8), acc[i][which]);
  }
}

template <int MB>
inline void row_a8(const int8_t* w, int64_t B, const A8Row* xr, float* out) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[MB][2];
  for (int i = 0; i < MB; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 4 <= B; b += 4) {
    a8_pair<MB>(w, b, false, xr, acc, 0);
    a8_pair<MB>(w, b + 2, false, xr, acc, 1);
  }
  if (b < B) a8_pair<MB>(w, b, b + 1 == B, xr, acc, 0);  // the last pair, or an odd B's lone block
  if (b + 2 < B) a8_pair<MB>(w, b + 2, b + 3 == B, xr, acc, 1);
  for (int i = 0; i < MB; i++) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
#else
  __m256 acc[MB][2];
  for (int i = 0; i < MB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= B; b += 2) {
    a8_block<MB>(w, b, xr, acc, 0);
    a8_block<MB>(w, b + 1, xr, acc, 1);
  }
  if (b < B) a8_block<MB>(w, b, xr, acc, 0);
  for (int i = 0; i < MB; i++) out[i] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
#endif
}

at::Tensor int8_a8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  check_x("mfs::int8_a8_gemv", x, q, scales, true);
  const int64_t K = x.size(1);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) == K,
              "mfs::int8_a8_gemv: q must be contiguous int8 [N, K] = [N, ", K, "], got ", q.scalar_type(), " ",
              q.sizes());
  const RowScales sc("mfs::int8_a8_gemv", scales, q.size(0));
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), N = q.size(0), B = K / 32, BP = pad2(B);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> xq(M * BP * 32);
  std::vector<float> dx8(M * BP * 8);
  quantize_rows_a8(xc.const_data_ptr<float>(), M, K, xq.data(), dx8.data());
  auto row = [&](int64_t m) { return A8Row{xq.data() + m * BP * 32, dx8.data() + m * BP * 8}; };
  const int8_t* qp = q.const_data_ptr<int8_t>();
  float* yp = y.mutable_data_ptr<float>();
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (N + 15) / 16));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n++) {
    const int8_t* w = qp + n * K;
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * K), _MM_HINT_T0);
    const float s = sc[n];
    // up to A8_ROWS activation rows per pass over the weight row
    row_passes<A8_ROWS, A8Row>(
        M, row, [&](auto rows, const A8Row* xr, float* out) { row_a8<decltype(rows)::value>(w, B, xr, out); },
        [&](int64_t m, float v) { yp[m * N + n] = v * s; });
  }
  return y;
}

// ---- int8 a8 in tiles of 16 weight rows: one register lane per output ----
// The head of --weights w4a8 as mfs::w4a8_tile_gemv takes its linears: y[m, n] = scale[n] * sum_b dx[m, b]
// * sum_j q[n, 32b + j] * xq[m, 32b + j], the weights interleaved 16 rows to a tile (tile_int8_rows in
// cpu_gemv.py):
//   qt int8 [N/16, B, 8, 16, 4]: qt[t, b, c, j, i] = q[16t + j, 32b + 4c + i].
// With VNNI a block of 16 rows is 8 vpdpbusd: the weights flipped to q + 128 (one xor per 64 bytes,
// shared by the activation rows) against the activation's four bytes broadcast, the accumulator
// starting from -128 * sum(xq) of the block (the activation side's correction, one broadcast): the
// exact integer sum; then one conversion and one fused multiply-add by dx. Without VNNI, 8 rows to a
// register: vpmaddubsw of |q| and xq signed by q, vpmaddwd, summed in 32 bits: the same integers.
// Order: per output one accumulator takes the blocks in turn, then the scale: it depends on K only
// (a row's output the same at any batch size), and the two builds agree bit for bit.

struct TileA8Row {
  const int8_t* q;      // [B * 32] plain order
  const float* dx;      // [B]
  const int32_t* corr;  // [B]: -128 * the sum of the block's xq
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int TILE_A8_ROWS = 8;

template <int MB>
inline void tile_a8(const int8_t* w, int64_t B, const TileA8Row* xr, float* out) {
  __m512 acc[MB];
  for (int i = 0; i < MB; i++) acc[i] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < B; b++) {
    const int8_t* wb = w + b * 512;
    __m512i wu[8];
    for (int c = 0; c < 8; c++) {
      _mm_prefetch(reinterpret_cast<const char*>(wb + 4096 + c * 64), _MM_HINT_T0);
      wu[c] = _mm512_xor_si512(_mm512_loadu_si512(wb + c * 64), flip);
    }
    for (int i = 0; i < MB; i++) {
      const int8_t* xq = xr[i].q + b * 32;
      __m512i s = _mm512_set1_epi32(xr[i].corr[b]);
      for (int c = 0; c < 8; c++) s = _mm512_dpbusd_epi32(s, wu[c], _mm512_set1_epi32(four_bytes(xq + 4 * c)));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xr[i].dx[b]), acc[i]);
    }
  }
  for (int i = 0; i < MB; i++) _mm512_storeu_ps(out + i * 16, acc[i]);
}
#else
constexpr int TILE_A8_ROWS = 2;

template <int MB>
inline void tile_a8_half(const int8_t* w, int64_t B, int h, const TileA8Row* xr, float* out) {
  __m256 acc[MB];
  for (int i = 0; i < MB; i++) acc[i] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < B; b++) {
    const int8_t* wb = w + b * 512 + h * 32;
    __m256i aw[8];
    for (int c = 0; c < 8; c++) {
      _mm_prefetch(reinterpret_cast<const char*>(wb + 4096 + c * 64), _MM_HINT_T0);
      aw[c] = _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64)));
    }
    for (int i = 0; i < MB; i++) {
      const int8_t* xq = xr[i].q + b * 32;
      __m256i s = _mm256_setzero_si256();
      for (int c = 0; c < 8; c++) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64));
        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(four_bytes(xq + 4 * c)), q);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[c], xs), ones));
      }
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xr[i].dx[b]), acc[i]);
    }
  }
  for (int i = 0; i < MB; i++) _mm256_storeu_ps(out + i * 16 + h * 8, acc[i]);
}

template <int MB>
inline void tile_a8(const int8_t* w, int64_t B, const TileA8Row* xr, float* out) {
  tile_a8_half<MB>(w, B, 0, xr, out);
  tile_a8_half<MB>(w, B, 1, xr, out);
}
#endif

at::Tensor int8_a8_tile_gemv(const at::Tensor& x, const at::Tensor& qt, const at::Tensor& scales) {
  check_x("mfs::int8_a8_tile_gemv", x, qt, scales, true);
  const int64_t K = x.size(1), B = K / 32;
  TORCH_CHECK(qt.dim() == 5 && qt.scalar_type() == at::kChar && qt.is_contiguous() && qt.size(1) == B &&
                  qt.size(2) == 8 && qt.size(3) == 16 && qt.size(4) == 4,
              "mfs::int8_a8_tile_gemv: qt must be contiguous int8 [N / 16, K / 32, 8, 16, 4] = [N / 16, ", B,
              ", 8, 16, 4], got ", qt.scalar_type(), " ", qt.sizes());
  const int64_t T = qt.size(0), N = T * 16;
  const RowScales sc("mfs::int8_a8_tile_gemv", scales, N);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * B);
  std::vector<int32_t> corr(M * B);
  int32_t* cp = corr.data();
  quantize_rows_plain(xc.const_data_ptr<float>(), M, K, xq.data(), dx.data(),
                      [cp](int64_t i, float, int32_t sum) { cp[i] = -128 * sum; });
  auto row = [&](int64_t m) { return TileA8Row{xq.data() + m * K, dx.data() + m * B, corr.data() + m * B}; };
  const int8_t* qp = qt.const_data_ptr<int8_t>();
  float* yp = y.mutable_data_ptr<float>();
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), T));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < T; t++) {
    const int8_t* w = qp + t * B * 512;
    float s[16];
    for (int j = 0; j < 16; j++) s[j] = sc[t * 16 + j];
    for (int64_t m = 0; m < M; m += TILE_A8_ROWS) {
      TileA8Row xr[TILE_A8_ROWS];
      float out[TILE_A8_ROWS * 16];
      const int r = static_cast<int>(std::min<int64_t>(TILE_A8_ROWS, M - m));
      for (int i = 0; i < r; i++) xr[i] = row(m + i);
      with_rows<TILE_A8_ROWS>(r, [&](auto rows) { tile_a8<decltype(rows)::value>(w, B, xr, out); });
      for (int i = 0; i < r; i++)
        for (int j = 0; j < 16; j++) yp[(m + i) * N + t * 16 + j] = out[i * 16 + j] * s[j];
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(mfs, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("w4a8_gemv(Tensor x, Tensor q, Tensor dm) -> Tensor");
  m.def("int8_a8_gemv(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("w4a8_tile_gemv(Tensor x, Tensor qt, Tensor dmt) -> Tensor");
  m.def("int8_a8_tile_gemv(Tensor x, Tensor qt, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(mfs, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
  m.impl("w4a8_gemv", &w4a8_gemv);
  m.impl("int8_a8_gemv", &int8_a8_gemv);
  m.impl("w4a8_tile_gemv", &w4a8_tile_gemv);
  m.impl("int8_a8_tile_gemv", &int8_a8_tile_gemv);
}
