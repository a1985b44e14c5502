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
// saturation) then vpmaddwd by 1 (Q6_K: the 16-bit pair sums less 32 * theirs, then vpmaddwd by the
// group's scale); where the build has AVX-512 VNNI (kernels/cpu_gemv.py builds for the CPU's ISA),
// vpdpbusd in 256-bit registers instead. Q8_0's signed codes go through vpsignb (|q| times sign(q) * xq).
// Each thread takes a contiguous range of weight rows; each weight row's group is decoded once and
// met by up to 4 activation rows per pass.
#include "cpu_gemv.h"

#include <torch/library.h>

namespace mfs_kq {

using mfs_cpu::hsum;

enum Kind : int64_t { Q4_0 = 0, Q5_0 = 1, Q8_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, Q5_1 = 6 };
constexpr int64_t VALUES[] = {32, 32, 32, 256, 256, 256, 32};
constexpr int64_t BYTES[] = {18, 22, 34, 144, 176, 210, 24};
constexpr int MAXR = 4;  // activation rows per pass over a weight row

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline int64_t pad8(int64_t b) { return (b + 7) & ~int64_t(7); }

// One activation row, quantized per 32 (BP = pad8(K / 32) blocks, zeros past K): xq [BP * 32], dx and
// dxs = dx * xs [BP], xs [BP], xs16 [BP * 2] (the sums of each block's two halves: Q6_K's groups)
struct ActRow {
  const int8_t* q;
  const float* dx;
  const float* dxs;
  const int32_t* xs;
  const int16_t* xs16;
};

// A group of 8 blocks of one weight row, decoded: codes (unsigned, or Q8_0's signed), the per-lane
// int32 scales of Q6_K's groups, ws and wm
struct Group {
  __m256i c[8];
  __m256i g6[8];
  __m256i s16;  // Q6_K: its 16 group scales as int16
  __m256 ws, wm;
};

inline __m256i nibbles16(const uint8_t* p) {  // 16 bytes -> 32 codes: low nibbles, then high ones
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}

inline __m256i bits32(const uint8_t* p) {  // a little-endian uint32 -> 32 bytes, 0x10 where bit j is set
  uint32_t w;
  std::memcpy(&w, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(w)), shuf),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// Legacy kinds: blocks 8g .. 8g + 7 of a row of B blocks (those past B: zero codes and scale)
template <int KIND>
inline void decode_legacy(const uint8_t* row, int64_t g, int64_t B, Group& out) {
  alignas(32) float d[8] = {0, 0, 0, 0, 0, 0, 0, 0}, mn[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t n = std::min<int64_t>(8, B - g * 8);
  for (int j = 0; j < 8; j++) {
    if (j >= n) {
      out.c[j] = _mm256_setzero_si256();
      continue;
    }
    const uint8_t* p = row + (g * 8 + j) * BYTES[KIND];
    d[j] = half_at(p);
    if constexpr (KIND == Q8_0) out.c[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    if constexpr (KIND == Q4_0) out.c[j] = nibbles16(p + 2);
    if constexpr (KIND == Q5_0) out.c[j] = _mm256_or_si256(nibbles16(p + 6), bits32(p + 2));
    if constexpr (KIND == Q5_1) {
      mn[j] = -half_at(p + 2);
      out.c[j] = _mm256_or_si256(nibbles16(p + 8), bits32(p + 4));
    }
  }
  out.ws = _mm256_load_ps(d);
  out.wm = _mm256_load_ps(mn);
}

// Q4_K / Q5_K's 6-bit scales and mins of the super-block's 8 sub-blocks
inline void k_scales(const uint8_t* s, int32_t* sc, int32_t* mn) {
  for (int j = 0; j < 4; j++) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

template <int KIND>
inline void decode_k(const uint8_t* row, int64_t g, Group& out) {
  const uint8_t* p = row + g * BYTES[KIND];
  const __m256i low = _mm256_set1_epi8(0x0F);
  if constexpr (KIND == Q6_K) {
    for (int h = 0; h < 2; h++) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
      const __m256i lo[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                             _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
      for (int s = 0; s < 4; s++) {
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
        out.c[4 * h + s] = _mm256_or_si256(lo[s], _mm256_slli_epi16(hi, 4));
      }
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    for (int j = 0; j < 8; j++)
      out.g6[j] = _mm256_setr_m128i(_mm_set1_epi32(sc[2 * j]), _mm_set1_epi32(sc[2 * j + 1]));
    out.s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    out.ws = _mm256_set1_ps(half_at(p + 208));
    out.wm = _mm256_setzero_ps();
    return;
  }
  alignas(32) int32_t sc[8], mn[8];
  k_scales(p + 4, sc, mn);
  const uint8_t* qs = p + (KIND == Q5_K ? 48 : 16);
  for (int c = 0; c < 4; c++) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    out.c[2 * c] = _mm256_and_si256(v, low);
    out.c[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  }
  if constexpr (KIND == Q5_K) {
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    for (int j = 0; j < 8; j++) {
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);
      out.c[j] = _mm256_or_si256(out.c[j], _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
  }
  const __m256 d = _mm256_set1_ps(half_at(p)), dmin = _mm256_set1_ps(half_at(p + 2));
  out.ws = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc))));
  out.wm = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mn))));
}

// Unsigned codes u (0..63) times signed xq: 8 int32 lanes, lane k the sum over values 4k .. 4k + 3 of
// each 128-bit half (lanes 0..3: values 0..15, lanes 4..7: values 16..31)
inline __m256i udot(__m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

// 8 vectors of 8 int32 -> one vector, lane j the sum of vector j's lanes (exact)
inline __m256i reduce8(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The integer sums I of one decoded group against one activation row's blocks 8g .. 8g + 7
template <int KIND>
inline __m256i group_sums(const Group& w, const ActRow& x, int64_t g) {
  const int8_t* xq = x.q + g * 256;
  __m256i s[8];
  for (int j = 0; j < 8; j++) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * j));
    if constexpr (KIND == Q8_0) {
      s[j] = udot(_mm256_abs_epi8(w.c[j]), _mm256_sign_epi8(xv, w.c[j]));
    } else if constexpr (KIND == Q6_K) {
      s[j] = _mm256_mullo_epi32(udot(w.c[j], xv), w.g6[j]);
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
inline void row_dot(const uint8_t* row, int64_t G, int64_t B, const ActRow* xr, float* out) {
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

// x [M, K] -> the ActRow arrays of every row (BP blocks each)
struct Quantized {
  int64_t BP;
  std::vector<int8_t> q;
  std::vector<float> dx, dxs;
  std::vector<int32_t> xs;
  std::vector<int16_t> xs16;
  Quantized(const float* x, int64_t M, int64_t K)
      : BP(pad8(K / 32)), q(M * BP * 32, 0), dx(M * BP, 0.f), dxs(M * BP, 0.f), xs(M * BP, 0), xs16(M * BP * 2, 0) {
    const int64_t B = K / 32;
#pragma omp parallel for schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++) {
      for (int64_t b = 0; b < B; b++) {
        float d;
        int32_t sum;
        const __m256i p = mfs_cpu::quantize_block(x + m * K + b * 32, &d, &sum);
        int8_t* qb = q.data() + (m * BP + b) * 32;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), p);
        int32_t h0 = 0;
        for (int j = 0; j < 16; j++) h0 += qb[j];
        dx[m * BP + b] = d;
        xs[m * BP + b] = sum;
        dxs[m * BP + b] = d * static_cast<float>(sum);
        xs16[(m * BP + b) * 2] = static_cast<int16_t>(h0);
        xs16[(m * BP + b) * 2 + 1] = static_cast<int16_t>(sum - h0);
      }
    }
  }
  ActRow row(int64_t m) const {
    return ActRow{q.data() + m * BP * 32, dx.data() + m * BP, dxs.data() + m * BP, xs.data() + m * BP,
                  xs16.data() + m * BP * 2};
  }
};

template <int KIND>
void gemv(const Quantized& xq, const uint8_t* w, int64_t M, int64_t N, int64_t K, float* y) {
  const int64_t B = K / 32, G = pad8(B) / 8, row_bytes = K / VALUES[KIND] * BYTES[KIND];
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (N + 15) / 16));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n++) {
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
  switch (kind) {
    case Q4_0: gemv<Q4_0>(xq, w, M, N, K, yp); break;
    case Q5_0: gemv<Q5_0>(xq, w, M, N, K, yp); break;
    case Q8_0: gemv<Q8_0>(xq, w, M, N, K, yp); break;
    case Q4_K: gemv<Q4_K>(xq, w, M, N, K, yp); break;
    case Q5_K: gemv<Q5_K>(xq, w, M, N, K, yp); break;
    case Q5_1: gemv<Q5_1>(xq, w, M, N, K, yp); break;
    default: gemv<Q6_K>(xq, w, M, N, K, yp); break;
  }
  return y;
}

}  // namespace mfs_kq

TORCH_LIBRARY_FRAGMENT(mfs, m) { m.def("gguf_a8_gemv(Tensor x, Tensor blocks, int kind) -> Tensor"); }

TORCH_LIBRARY_IMPL(mfs, CPU, m) { m.impl("gguf_a8_gemv", &mfs_kq::gguf_a8_gemv); }
