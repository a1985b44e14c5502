// mfs::w4a8_tile_gemv (registered in cpu_gemv.cpp; shared helpers in cpu_gemv.h)
#include "cpu_gemv.h"

namespace mfs_cpu {

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

}  // namespace mfs_cpu
