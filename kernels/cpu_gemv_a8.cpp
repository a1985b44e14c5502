// mfs::int8_a8_gemv and mfs::int8_a8_tile_gemv (registered in cpu_gemv.cpp; shared helpers in cpu_gemv.h)
#include "cpu_gemv.h"

namespace mfs_cpu {

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
// ms against 1.0-1.1 at the head's shape; docs/journal/benchmarks-history.md).
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

}  // namespace mfs_cpu
