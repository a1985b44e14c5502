// GGUF weight blocks, shared by the two paths of mfs::gguf_a8_gemv (kernels/cpu_kquant.cpp: one weight
// row at a time; kernels/cpu_kquant_tile.cpp: tiles of 8 weight rows decoded once for many activation
// rows): the kinds, a group of 8 blocks decoded into registers, and the quantized activation rows.
#pragma once

#include "cpu_gemv.h"

// the decoders are called per group in the hot loops: a call there (through the PLT, the library being
// -fPIC) spills the loop's accumulators and costs a vzeroupper per group
#define KQ_INLINE inline __attribute__((always_inline))

namespace mfs_kq {

enum Kind : int64_t { Q4_0 = 0, Q5_0 = 1, Q8_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, Q5_1 = 6 };
constexpr int64_t VALUES[] = {32, 32, 32, 256, 256, 256, 32};
constexpr int64_t BYTES[] = {18, 22, 34, 144, 176, 210, 24};

KQ_INLINE float half_at(const uint8_t* p) {
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
  __m256i g6[8];  // Q6_K: block j's two group scales as int16 words (values 0..15's in the low 128 bits)
  __m256i s16;  // Q6_K: its 16 group scales as int16
  __m256 ws, wm;
};

KQ_INLINE __m256i nibbles16(const uint8_t* p) {  // 16 bytes -> 32 codes: low nibbles, then high ones
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}

KQ_INLINE __m256i bits32(const uint8_t* p) {  // a little-endian uint32 -> 32 bytes, 0x10 where bit j is set
  uint32_t w;
  std::memcpy(&w, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(w)), shuf),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// Legacy kinds: blocks 8g .. 8g + 7 of a row of B blocks (those past B: zero codes and scale)
template <int KIND>
KQ_INLINE void decode_legacy(const uint8_t* row, int64_t g, int64_t B, Group& out) {
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

// Q4_K / Q5_K's 6-bit scales and mins of the super-block's 8 sub-blocks (as kquant_blocks.k_scales), as fp32
// lanes: the 12 bytes as three words, each byte of a word its own field
KQ_INLINE void k_scales(const uint8_t* s, __m256& sc, __m256& mn) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  const __m128i v = _mm_setr_epi32(static_cast<int>(u[0] & m6),                                    // sc 0..3
                                   static_cast<int>((u[2] & m4) | (((u[0] >> 6) & m2) << 4)),      // sc 4..7
                                   static_cast<int>(u[1] & m6),                                    // m 0..3
                                   static_cast<int>(((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4)));  // m 4..7
  sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}

template <int KIND>
KQ_INLINE void decode_k(const uint8_t* row, int64_t g, Group& out) {
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
      const __m256i m30 = _mm256_set1_epi8(0x30);  // value 32s + j's high bits: bits 2s, 2s + 1 of byte j
      out.c[4 * h] = _mm256_or_si256(lo[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
      out.c[4 * h + 1] = _mm256_or_si256(lo[1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
      out.c[4 * h + 2] = _mm256_or_si256(lo[2], _mm256_and_si256(hb, m30));
      out.c[4 * h + 3] = _mm256_or_si256(lo[3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    const __m256i lo8 = _mm256_permute2x128_si256(s16, s16, 0x00), hi8 = _mm256_permute2x128_si256(s16, s16, 0x11);
    for (int j = 0; j < 4; j++) {  // block j: scale 2j in the low 128 bits' words, 2j + 1 in the high ones'
      const __m256i pick = _mm256_setr_m128i(_mm_set1_epi16(static_cast<short>(0x0100 + 0x0404 * j)),
                                             _mm_set1_epi16(static_cast<short>(0x0302 + 0x0404 * j)));
      out.g6[j] = _mm256_shuffle_epi8(lo8, pick);
      out.g6[j + 4] = _mm256_shuffle_epi8(hi8, pick);
    }
    out.s16 = s16;
    out.ws = _mm256_set1_ps(half_at(p + 208));
    out.wm = _mm256_setzero_ps();
    return;
  }
  __m256 sc, mn;
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
  out.ws = _mm256_mul_ps(d, sc);
  out.wm = _mm256_mul_ps(dmin, mn);
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
    mfs_cpu::quantize_rows_plain(x, M, K, q.data(), dx.data(), [&](int64_t i, float d, int32_t sum) {
      const int8_t* qb = q.data() + i * 32;
      int32_t h0 = 0;
      for (int j = 0; j < 16; j++) h0 += qb[j];
      xs[i] = sum;
      dxs[i] = d * static_cast<float>(sum);
      xs16[i * 2] = static_cast<int16_t>(h0);
      xs16[i * 2 + 1] = static_cast<int16_t>(sum - h0);
    }, BP);
  }
  ActRow row(int64_t m) const {
    return ActRow{q.data() + m * BP * 32, dx.data() + m * BP, dxs.data() + m * BP, xs.data() + m * BP,
                  xs16.data() + m * BP * 2};
  }
};

// The tile path (kernels/cpu_kquant_tile.cpp): rows [0, N / 8 * 8) of y for every activation row, the
// same value bit for bit as the row path gives; false for a kind it does not serve (Q8_0)
bool tile_gemv(int64_t kind, const Quantized& xq, const uint8_t* w, int64_t M, int64_t N, int64_t K, float* y);

}  // namespace mfs_kq
