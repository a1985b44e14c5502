// mfs::gguf_a8_gemv's tile path (the operator, its formula and its order: kernels/cpu_kquant.cpp): the same
// value of every output bit for bit, computed for many activation rows at once.
//
// The row path decodes a weight row's group of 8 blocks into registers and meets it with up to 4
// activation rows; for a batch of M rows it decodes every weight row M / 4 times and reads all M
// activation rows once per weight row. Here a thread decodes 8 weight rows' blocks once into a tile
// (codes interleaved 4 values of a row to a 32-bit lane: one register holds 4 values of 8 rows) and
// runs every activation row of a block of rows small enough to stay in L2 over it, 4 rows to a pass
// (each code vector loaded once for the 4, each accumulator acc[j] finished before the next). A register lane is
// one output row: 4 activation bytes broadcast to the 8 lanes, vpmaddubsw against the tile's codes.
//
// The same numbers: a block's integer sum I[n, b] is an exact integer however it is summed (int16
// partial sums bounded as said at block_sum), and the float work is per (row n, block b) elementwise:
// the row path's lane j of acc takes blocks 8g + j, fma(I, ws * dx, acc); here acc[j] is a vector over
// the tile's 8 rows, lane r taking row r's blocks 8g + j in the same order with the same operands; its
// horizontal sum is done across the 8 vectors in hsum's order ((a0 + a4) + (a2 + a6)) + ((a1 + a5) +
// (a3 + a7)), the mins accumulated the same way, then acc - macc. Q8_0 (signed codes) stays on the row
// path.
#include "cpu_kquant.h"

namespace mfs_kq {

constexpr int TILE_PASS = 4;  // activation rows per pass over a tile

// 8 weight rows' blocks 0 .. BP, decoded: codes [BP][8 p][8 rows][4 values 4p .. 4p + 3], per block and
// row ws and wm, and for Q6_K each row's two group scales as int16 pairs (s16) and each one repeated
// in both halves of a 32-bit lane (sc0, sc1: vpmaddwd's factors)
struct Tile {
  std::vector<uint8_t> c;
  std::vector<float> ws, wm;
  std::vector<int32_t> s16, sc0, sc1;
  explicit Tile(int64_t BP) : c(BP * 256), ws(BP * 8), wm(BP * 8), s16(BP * 8), sc0(BP * 8), sc1(BP * 8) {}
};

// 8 vectors of 8 int32 (or fp32) lanes, transposed: v[p] lane r = the input v[r]'s lane p
inline void transpose8(__m256i* v) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int p = 0; p < 4; p++) {
    v[p] = _mm256_permute2x128_si256(u[p], u[p + 4], 0x20);
    v[p + 4] = _mm256_permute2x128_si256(u[p], u[p + 4], 0x31);
  }
}

inline void store_t(void* dst, __m256i* v) {  // v transposed, then its 8 vectors one after another
  transpose8(v);
  for (int p = 0; p < 8; p++) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + p, v[p]);
}

template <int KIND>
void decode_tile(const uint8_t* rows, int64_t row_bytes, int64_t G, int64_t B, Tile& t) {
  constexpr bool kq = KIND == Q4_K || KIND == Q5_K || KIND == Q6_K;
  Group w[8];
  for (int64_t g = 0; g < G; g++) {
    for (int r = 0; r < 8; r++) {
      if constexpr (kq) decode_k<KIND>(rows + r * row_bytes, g, w[r]);
      else decode_legacy<KIND>(rows + r * row_bytes, g, B, w[r]);
    }
    for (int j = 0; j < 8; j++) {
      __m256i v[8];
      for (int r = 0; r < 8; r++) v[r] = w[r].c[j];
      store_t(t.c.data() + (g * 8 + j) * 256, v);
    }
    __m256i v[8];
    for (int r = 0; r < 8; r++) v[r] = _mm256_castps_si256(w[r].ws);
    store_t(t.ws.data() + g * 64, v);
    for (int r = 0; r < 8; r++) v[r] = _mm256_castps_si256(w[r].wm);
    store_t(t.wm.data() + g * 64, v);
    if constexpr (KIND == Q6_K) {
      for (int r = 0; r < 8; r++) v[r] = w[r].s16;
      store_t(t.s16.data() + g * 64, v);
      for (int i = 0; i < 64; i++) {
        const uint32_t s = static_cast<uint32_t>(t.s16[g * 64 + i]);
        t.sc0[g * 64 + i] = static_cast<int32_t>((s & 0xFFFFu) | (s << 16));
        t.sc1[g * 64 + i] = static_cast<int32_t>((s >> 16) | (s & 0xFFFF0000u));
      }
    }
  }
}

KQ_INLINE __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(mfs_cpu::four_bytes(p)); }

KQ_INLINE __m256i load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// I[n, b] of the tile's 8 rows (codes c: block b's 8 vectors) against one activation row's block b. int16
// partial sums hold at most 16 products of 4-bit codes (16 * 15 * 127 < 2^15), 8 of 5-bit (8 * 31 * 127)
// and 4 of 6-bit (4 * 63 * 127).
template <int KIND>
KQ_INLINE __m256i block_sum(const __m256i* c, const Tile& t, const ActRow& x, int64_t b) {
  const int8_t* xq = x.q + b * 32;
  const __m256i one = _mm256_set1_epi16(1);
  auto prod = [&](int p) { return _mm256_maddubs_epi16(c[p], bcast4(xq + 4 * p)); };
  auto sum16 = [&](int p0, int n) {
    __m256i s = prod(p0);
    for (int p = p0 + 1; p < p0 + n; p++) s = _mm256_add_epi16(s, prod(p));
    return s;
  };
  if constexpr (KIND == Q4_0 || KIND == Q4_K) {
    __m256i s = _mm256_madd_epi16(sum16(0, 8), one);
    if constexpr (KIND == Q4_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(x.xs[b] * 8));
    return s;
  } else if constexpr (KIND == Q6_K) {  // scale_g * (its 16 products) per group, less 32 * sum_g scale_g * xs16_g
    const __m256i s0 = load(t.sc0.data() + b * 8), s1 = load(t.sc1.data() + b * 8);
    __m256i s = _mm256_add_epi32(_mm256_madd_epi16(sum16(0, 2), s0), _mm256_madd_epi16(sum16(2, 2), s0));
    s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(sum16(4, 2), s1), _mm256_madd_epi16(sum16(6, 2), s1)));
    int32_t x16;
    std::memcpy(&x16, x.xs16 + 2 * b, 4);
    const __m256i corr = _mm256_madd_epi16(load(t.s16.data() + b * 8), _mm256_set1_epi32(x16));
    return _mm256_sub_epi32(s, _mm256_slli_epi32(corr, 5));
  } else {  // 5-bit codes: Q5_0, Q5_1, Q5_K
    __m256i s = _mm256_add_epi32(_mm256_madd_epi16(sum16(0, 4), one), _mm256_madd_epi16(sum16(4, 4), one));
    if constexpr (KIND == Q5_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(x.xs[b] * 16));
    return s;
  }
}

// hsum's order across 8 vectors: lane r of the result is hsum of (a[0][r], .., a[7][r])
KQ_INLINE __m256 hsum_across(const __m256* a) {
  return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6])),
                       _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7])));
}

// The tile's 8 outputs for R activation rows: acc[j] (blocks 8g + j) one at a time, so a block's 8 code
// vectors are loaded once for the R rows and only R accumulators are live
template <int KIND, int R>
KQ_INLINE void tile_rows(const Tile& t, const ActRow* xr, int64_t G, float* const* out) {
  __m256 acc[R][8], macc[R][8];
  for (int j = 0; j < 8; j++) {
    __m256 a[R], ma[R];
    for (int r = 0; r < R; r++) a[r] = ma[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
      const int64_t b = g * 8 + j;
      __m256i c[8];
      for (int p = 0; p < 8; p++) c[p] = load(t.c.data() + b * 256 + 32 * p);
      const __m256 ws = _mm256_loadu_ps(t.ws.data() + b * 8);
      for (int r = 0; r < R; r++) {
        const __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(xr[r].dx[b]));
        a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sum<KIND>(c, t, xr[r], b)), scale, a[r]);
      }
    }
    if constexpr (KIND == Q4_K || KIND == Q5_K || KIND == Q5_1) {
      for (int64_t g = 0; g < G; g++) {
        const int64_t b = g * 8 + j;
        const __m256 wm = _mm256_loadu_ps(t.wm.data() + b * 8);
        for (int r = 0; r < R; r++) ma[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xr[r].dxs[b]), ma[r]);
      }
    }
    for (int r = 0; r < R; r++) acc[r][j] = a[r], macc[r][j] = ma[r];
  }
  for (int r = 0; r < R; r++) {
    __m256 v = hsum_across(acc[r]);
    if constexpr (KIND == Q4_K || KIND == Q5_K || KIND == Q5_1) v = _mm256_sub_ps(v, hsum_across(macc[r]));
    _mm256_storeu_ps(out[r], v);
  }
}

// Each thread a contiguous range of tiles; activation rows in blocks of ~128 KB of codes (they stay in L2
// while the thread's tiles pass), each tile decoded once per block of rows
template <int KIND>
void tiles(const Quantized& xq, const uint8_t* w, int64_t M, int64_t N, int64_t K, float* y) {
  const int64_t B = K / 32, BP = pad8(B), G = BP / 8, row_bytes = K / VALUES[KIND] * BYTES[KIND], T = N / 8;
  const int64_t rows = std::max<int64_t>(8, (128 << 10) / K);
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), T));
#pragma omp parallel num_threads(threads)
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t t0 = T * id / nt, t1 = T * (id + 1) / nt;
    Tile tile(BP);
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
      const int64_t m1 = std::min(M, m0 + rows);
      for (int64_t t = t0; t < t1; t++) {
        decode_tile<KIND>(w + t * 8 * row_bytes, row_bytes, G, B, tile);
        for (int64_t m = m0; m < m1; m += TILE_PASS) {
          const int n = static_cast<int>(std::min<int64_t>(TILE_PASS, m1 - m));
          ActRow xr[TILE_PASS];
          float* out[TILE_PASS];
          for (int i = 0; i < n; i++) xr[i] = xq.row(m + i), out[i] = y + (m + i) * N + t * 8;
          mfs_cpu::with_rows<TILE_PASS>(n, [&](auto rows) { tile_rows<KIND, decltype(rows)::value>(tile, xr, G, out); });
        }
      }
    }
  }
}

bool tile_gemv(int64_t kind, const Quantized& xq, const uint8_t* w, int64_t M, int64_t N, int64_t K, float* y) {
  if (N < 8) return N == 0;
  switch (kind) {
    case Q4_0: tiles<Q4_0>(xq, w, M, N, K, y); return true;
    case Q5_0: tiles<Q5_0>(xq, w, M, N, K, y); return true;
    case Q4_K: tiles<Q4_K>(xq, w, M, N, K, y); return true;
    case Q5_K: tiles<Q5_K>(xq, w, M, N, K, y); return true;
    case Q5_1: tiles<Q5_1>(xq, w, M, N, K, y); return true;
    case Q6_K: tiles<Q6_K>(xq, w, M, N, K, y); return true;
    default: return false;
  }
}

}  // namespace mfs_kq
