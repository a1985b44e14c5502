// GGUF weight blocks as they ship times 8-bit activations: the torch operator mfs::gguf_a8_gemv
// (kernels/cpu_kquant.py builds it with kernels/cpu_gemv.py's builder and loads it).
//
//   y[m, n] = sum_b dx[m, b] * (ws[n, b] * I[m, n, b] - wm[n, b] * xs[m, b])
//
// x fp32 [M, K]; blocks uint8 [N, K / values * bytes], each weight row whole blocks of one kind, the
// bytes as the GGUF file holds them (worker/formats/kquant_blocks.py gives the layouts): Q4_0, Q5_0,
// Q5_1, Q8_0 (blocks of 32 values), Q4_K, Q5_K, Q6_K (super-blocks of 256). b runs over groups of 32 inputs.
// Each activation row is quantized per 32 values as llama.cpp's Q8_0 does (cpu_gemv.h's
// quantize_block: dx = amax / 127, xq = round-half-even(x / dx)); xs[m, b] = sum of block b's xq.
// I is an exact integer: sum_j q[n, 32b + j] * xq[m, 32b + j] with the kind's codes (Q4_0's q - 8,
// Q5_0's q - 16, Q8_0's q, Q6_K's scale_g * (q - 32) over its two groups g of 16, Q4_K / Q5_K / Q5_1's
// unsigned q); ws the block's fp32 scale (d; d * sc for Q4_K / Q5_K; d for Q6_K, whose int8 scales are
// inside I); wm the K-quants' min dmin * m, Q5_1's -m (0 for the others). The super-block scales and mins are
// read from the file's bytes on every pass: nothing is rounded a second time.
//
// Order: per weight row, groups of 8 blocks in turn (a K-quant super-block; 8 consecutive blocks of a
// legacy kind, the last group padded with zero codes and zero activations); the 8 blocks' integer
// sums land in one 8-lane vector (exact integer adds), then one fused multiply-add with ws * dx into
// an 8-lane accumulator and one with wm into a second (wm * (dx * xs)); the row's value is
// hsum(acc) - hsum(macc). That depends on K and the kind only, and a row's quantization on that row
// only: a row's output is the same bit for bit at any batch size.
//
// Integer products: vpmaddubsw (unsigned codes times signed xq; |pairs| <= 63 * 127 * 2 < 2^15, no
// saturation) then vpmaddwd by 1 (Q6_K: vpmaddwd by the group's scale, then less 32 * sum_g scale_g * the
// group's sum of xq); where the build has AVX-512 VNNI (kernels/cpu_gemv.py builds for the CPU's ISA),
// vpdpbusd in 256-bit registers instead of the pair with 1. Q8_0's signed codes go through vpsignb (|q|
// times sign(q) * xq).
//
// This file is the row path: each thread takes a contiguous range of weight rows; each weight row's
// group is decoded once and met by up to 4 activation rows per pass. From TILE_MIN_ROWS activation rows
// on, whole tiles of 8 weight rows go through kernels/cpu_kquant_tile.cpp instead: the same integers and
// the same float operations per output in the same order, so the same values bit for bit.
#include "cpu_kquant.h"

#include <torch/library.h>

namespace mfs_kq {

using mfs_cpu::hsum;

constexpr int MAXR = 4;  // activation rows per pass over a weight row
// activation rows from which the tile path serves: below, decoding a tile costs more than it saves (one
// thread, a 1B's Q4_K shapes: the row path ~2x faster at 1 row, ~1.4x at 3)
constexpr int64_t TILE_MIN_ROWS = 4;

// Unsigned codes u (0..63) times signed xq: 8 int32 lanes, lane k the sum over values 4k .. 4k + 3 of
// each 128-bit half (lanes 0..3: values 0..15, lanes 4..7: values 16..31)
KQ_INLINE __m256i udot(__m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

// 8 vectors of 8 int32 -> one vector, lane j the sum of vector j's lanes (exact)
KQ_INLINE __m256i reduce8(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The integer sums I of one decoded group against one activation row's blocks 8g .. 8g + 7
template <int KIND>
KQ_INLINE __m256i group_sums(const Group& w, const ActRow& x, int64_t g) {
  const int8_t* xq = x.q + g * 256;
  __m256i s[8];
  for (int j = 0; j < 8; j++) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * j));
    if constexpr (KIND == Q8_0) {
      s[j] = udot(_mm256_abs_epi8(w.c[j]), _mm256_sign_epi8(xv, w.c[j]));
    } else if constexpr (KIND == Q6_K) {
      s[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(w.c[j], xv), w.g6[j]);  // pairs < 2 * 63 * 127
    } else {
      s[j] = udot(w.c[j], xv);
    }
  }
  __m256i sum = reduce8(s);
  const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.xs + g * 8));
  if constexpr (KIND == Q4_0) sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(xs, 3));
  if constexpr (KIND == Q5_0) sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(xs, 4));
  if constexpr (KIND == Q6_K) {  // less 32 * sum_g scale_g * (the group's sum of xq), per block
    const __m256i x16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.xs16 + g * 16));
    sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(_mm256_madd_epi16(x16, w.s16), 5));
  }
  return sum;
}

template <int KIND, int MB>
KQ_INLINE void row_dot(const uint8_t* row, int64_t G, int64_t B, const ActRow* xr, float* out) {
  __m256 acc[MB], macc[MB];
  for (int i = 0; i < MB; i++) acc[i] = macc[i] = _mm256_setzero_ps();
  constexpr bool kq = KIND == Q4_K || KIND == Q5_K || KIND == Q6_K;
  constexpr int64_t group_bytes = kq ? BYTES[KIND] : 8 * BYTES[KIND];
  for (int64_t g = 0; g < G; g++) {
    _mm_prefetch(reinterpret_cast<const char*>(row + (g + 4) * group_bytes), _MM_HINT_T0);
    Group w;
    if constexpr (kq) decode_k<KIND>(row, g, w);
    else decode_legacy<KIND>(row, g, B, w);
    for (int i = 0; i < MB; i++) {
      const __m256i isum = group_sums<KIND>(w, xr[i], g);
      const __m256 dx = _mm256_loadu_ps(xr[i].dx + g * 8);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(w.ws, dx), acc[i]);
      if constexpr (KIND == Q4_K || KIND == Q5_K || KIND == Q5_1)
        macc[i] = _mm256_fmadd_ps(w.wm, _mm256_loadu_ps(xr[i].dxs + g * 8), macc[i]);
    }
  }
  for (int i = 0; i < MB; i++) out[i] = hsum(acc[i]) - hsum(macc[i]);
}

// Weight rows n0 .. N of y [M, N]
template <int KIND>
void gemv(const Quantized& xq, const uint8_t* w, int64_t M, int64_t n0, int64_t N, int64_t K, float* y) {
  const int64_t B = K / 32, G = pad8(B) / 8, row_bytes = K / VALUES[KIND] * BYTES[KIND];
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (N - n0 + 15) / 16));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = n0; n < N; n++) {
    const uint8_t* row = w + n * row_bytes;
    mfs_cpu::row_passes<MAXR, ActRow>(
        M, [&](int64_t m) { return xq.row(m); },
        [&](auto rows, const ActRow* xr, float* out) { row_dot<KIND, decltype(rows)::value>(row, G, B, xr, out); },
        [&](int64_t m, float v) { y[m * N + n] = v; });
  }
}

at::Tensor gguf_a8_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(kind >= Q4_0 && kind <= Q5_1, "mfs::gguf_a8_gemv: kind must be 0..6 (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, ",
              "Q6_K, Q5_1), got ", kind);
  mfs_cpu::check_x("mfs::gguf_a8_gemv", x, blocks, blocks, true);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % VALUES[kind] == 0, "mfs::gguf_a8_gemv: K must be a multiple of ", VALUES[kind], ", got ", K);
  const int64_t row_bytes = K / VALUES[kind] * BYTES[kind];
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == row_bytes,
              "mfs::gguf_a8_gemv: blocks must be contiguous uint8 [N, ", row_bytes, "], got ", blocks.scalar_type(),
              " ", blocks.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), N = blocks.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Quantized xq(xc.const_data_ptr<float>(), M, K);
  const uint8_t* w = blocks.const_data_ptr<uint8_t>();
  float* yp = y.mutable_data_ptr<float>();
  // from TILE_MIN_ROWS activation rows on, whole tiles of 8 weight rows through the tile path (the
  // same values bit for bit), the rest one weight row at a time
  const int64_t n0 = M >= TILE_MIN_ROWS && tile_gemv(kind, xq, w, M, N, K, yp) ? N / 8 * 8 : 0;
  if (n0 == N) return y;
  switch (kind) {
    case Q4_0: gemv<Q4_0>(xq, w, M, n0, N, K, yp); break;
    case Q5_0: gemv<Q5_0>(xq, w, M, n0, N, K, yp); break;
    case Q8_0: gemv<Q8_0>(xq, w, M, n0, N, K, yp); break;
    case Q4_K: gemv<Q4_K>(xq, w, M, n0, N, K, yp); break;
    case Q5_K: gemv<Q5_K>(xq, w, M, n0, N, K, yp); break;
    case Q5_1: gemv<Q5_1>(xq, w, M, n0, N, K, yp); break;
    default: gemv<Q6_K>(xq, w, M, n0, N, K, yp); break;
  }
  return y;
}

}  // namespace mfs_kq

TORCH_LIBRARY_FRAGMENT(mfs, m) { m.def("gguf_a8_gemv(Tensor x, Tensor blocks, int kind) -> Tensor"); }

TORCH_LIBRARY_IMPL(mfs, CPU, m) { m.impl("gguf_a8_gemv", &mfs_kq::gguf_a8_gemv); }
