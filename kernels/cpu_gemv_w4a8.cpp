// mfs::w4a8_gemv (registered in cpu_gemv.cpp; shared helpers in cpu_gemv.h)
#include "cpu_gemv.h"

namespace mfs_cpu {

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
// (docs/journal/benchmarks-history.md).
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

}  // namespace mfs_cpu
