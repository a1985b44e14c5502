// Decode attention over the paged KV pool, registered as the torch operator mfs::decode_attention
// (kernels/cpu_attention.py builds it with kernels/cpu_gemv.py's builder and loads it).
//
//   out[t, h] = sum_p softmax_p(scale * q[t, h] . K_t[p, h / G]) V_t[p, h / G],  p = 0 .. last[t]
//
// where K_t[p] is k_pool[flat[t * lmax + p]] for p < last[t] and k_new[t] at p = last[t] (the row's
// own new entry, not yet written to the pool), likewise V; G = Hq / Hkv query heads share a KV head.
// q [T, Hq, D], k_pool/v_pool [S, Hkv, D], k_new/v_new [T, Hkv, D] fp32; flat int64 [T * lmax];
// last int64 [T]. Positions past last[t] (the padding of the gathered layout) are not read.
//
// Why: the compiled decode layer (worker/compiled_step.py) gathered each row's context out of the
// pool (index_select), put the new entry in (index_put) and called SDPA on the copy; at one row and
// ~50 positions that is 25-44 us a layer on the Zen 5 machine (docs/journal/probes/attn_part.py.txt), most of it
// per-call work for ~10 K multiply-adds. Here each (row, KV head) reads its context in place: one
// pass of dot products for the G query heads, a vectorized exp, one pass of weighted sums -- in
// 512-bit registers with q and the outputs held there where the build has AVX-512 and the shape is
// SmolLM's kind (G <= 4, head_dim 64 or 128; attend_zmm), else in AVX2 registers (attend). On the Zen 5
// machine (two threads, docs/journal/probes/attn_op.py.txt): one row 3.7 us at 50 positions, 7.1 at 200 (the AVX2
// form 5.7 / 12.1), six rows 7.8 / 26.9; the gather + SDPA it replaces, eager, 44 / 98 and 80 / 165 us.
//
// A row's output depends on that row only (its context and its q), in a fixed order: the same bit for
// bit at any batch size and thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t GRAIN = 32768;  // multiply-adds below which a range of (row, KV head) pairs runs inline

using mfs_vec::exp_nonpos;
using mfs_vec::hsum;

inline float dot(const float* a, const float* b, int64_t D) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
  }
  return hsum(_mm256_add_ps(s0, s1));
}

// Each of the G rows of s [G, n] (scores) replaced by its softmax.
inline void softmax_rows(float* s, int64_t G, int64_t n) {
  for (int64_t g = 0; g < G; g++) {
    float* sg = s + g * n;
    float mx = -INFINITY;
    for (int64_t p = 0; p < n; p++) mx = std::max(mx, sg[p]);
    const __m256 m8 = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) {
      const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sg + p), m8));
      _mm256_storeu_ps(sg + p, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum(sum8);
    if (p < n) {  // the tail through the same exp, eight lanes at a time (the rest padded with the max)
      alignas(32) float t[8];
      for (int j = 0; j < 8; j++) t[j] = p + j < n ? sg[p + j] : mx;
      _mm256_store_ps(t, exp_nonpos(_mm256_sub_ps(_mm256_load_ps(t), m8)));
      for (int64_t j = 0; p + j < n; j++) {
        sg[p + j] = t[j];
        sum += t[j];
      }
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; j++) sg[j] *= inv;
  }
}

// One row's one KV head: G query heads q[g * D ..], n positions whose K/V rows `krow(p)`/`vrow(p)`
// gives; out[g * D ..]; s: scratch for G * n scores.
template <class KRow, class VRow>
void attend(const float* q, int64_t G, int64_t D, int64_t n, float scale, KRow krow, VRow vrow, float* s,
            float* out) {
  for (int64_t p = 0; p < n; p++) {
    const float* k = krow(p);
    for (int64_t g = 0; g < G; g++) s[g * n + p] = dot(q + g * D, k, D) * scale;
  }
  softmax_rows(s, G, n);
  for (int64_t g = 0; g < G; g++) {
    float* o = out + g * D;
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
  }
  for (int64_t p = 0; p < n; p++) {
    const float* v = vrow(p);
    for (int64_t g = 0; g < G; g++) {
      const __m256 w = _mm256_set1_ps(s[g * n + p]);
      float* o = out + g * D;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
    }
  }
}

#if defined(__AVX512F__)
// The same for AVX-512 builds with G query heads of DV * 16 values held in registers: per position one
// pass over its K row (G dot products) and later one over its V row (G * DV fused multiply-adds into
// accumulators that stay in registers).
template <int G, int DV, class KRow, class VRow>
void attend_zmm(const float* q, int64_t n, float scale, KRow krow, VRow vrow, float* s, float* out) {
  __m512 qv[G][DV];
  for (int g = 0; g < G; g++)
    for (int d = 0; d < DV; d++) qv[g][d] = _mm512_loadu_ps(q + g * DV * 16 + d * 16);
  for (int64_t p = 0; p < n; p++) {
    const float* k = krow(p);
    __m512 kv[DV];
    for (int d = 0; d < DV; d++) kv[d] = _mm512_loadu_ps(k + d * 16);
    for (int g = 0; g < G; g++) {
      __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int d = 1; d < DV; d++) a = _mm512_fmadd_ps(qv[g][d], kv[d], a);
      s[g * n + p] = _mm512_reduce_add_ps(a) * scale;
    }
  }
  softmax_rows(s, G, n);
  __m512 acc[G][DV];
  for (int g = 0; g < G; g++)
    for (int d = 0; d < DV; d++) acc[g][d] = _mm512_setzero_ps();
  for (int64_t p = 0; p < n; p++) {
    const float* v = vrow(p);
    __m512 vv[DV];
    for (int d = 0; d < DV; d++) vv[d] = _mm512_loadu_ps(v + d * 16);
    for (int g = 0; g < G; g++) {
      const __m512 w = _mm512_set1_ps(s[g * n + p]);
      for (int d = 0; d < DV; d++) acc[g][d] = _mm512_fmadd_ps(w, vv[d], acc[g][d]);
    }
  }
  for (int g = 0; g < G; g++)
    for (int d = 0; d < DV; d++) _mm512_storeu_ps(out + g * DV * 16 + d * 16, acc[g][d]);
}
#endif

#if defined(__AVX512F__)
// attend_zmm for the shapes it is built for (G <= 4 query heads per KV head, head_dim 64 or 128);
// false for others (the AVX2 form serves them).
template <class KRow, class VRow>
bool zmm_attend(int64_t G, int64_t D, const float* q, int64_t n, float sc, KRow krow, VRow vrow, float* s,
                float* out) {
  auto run = [&](auto g, auto dv) {
    attend_zmm<decltype(g)::value, decltype(dv)::value>(q, n, sc, krow, vrow, s, out);
    return true;
  };
  auto by_g = [&](auto dv) {
    switch (G) {
      case 1: return run(std::integral_constant<int, 1>{}, dv);
      case 2: return run(std::integral_constant<int, 2>{}, dv);
      case 3: return run(std::integral_constant<int, 3>{}, dv);
      case 4: return run(std::integral_constant<int, 4>{}, dv);
      default: return false;
    }
  };
  if (D == 64) return by_g(std::integral_constant<int, 4>{});
  if (D == 128) return by_g(std::integral_constant<int, 8>{});
  return false;
}
#endif

void check_f32(const char* what, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.dim() == dim && t.scalar_type() == at::kFloat && t.device().is_cpu(),
              "mfs::decode_attention: ", what, " must be fp32 CPU with ", dim, " dims, got ", t.scalar_type(), " ",
              t.sizes());
}

at::Tensor decode_attention(const at::Tensor& q_, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& flat, const at::Tensor& last, const at::Tensor& k_new_,
                            const at::Tensor& v_new_, double scale) {
  check_f32("q", q_, 3);
  check_f32("k_pool", k_pool, 3);
  check_f32("v_pool", v_pool, 3);
  check_f32("k_new", k_new_, 3);
  check_f32("v_new", v_new_, 3);
  const int64_t T = q_.size(0), Hq = q_.size(1), D = q_.size(2), S = k_pool.size(0), Hkv = k_pool.size(1);
  TORCH_CHECK(D % 16 == 0, "mfs::decode_attention: head_dim must be a multiple of 16, got ", D);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "mfs::decode_attention: ", Hq, " query heads for ", Hkv, " KV heads");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == D && k_pool.is_contiguous() &&
                  v_pool.is_contiguous(),
              "mfs::decode_attention: k_pool and v_pool must be contiguous [S, ", Hkv, ", ", D, "], got ",
              k_pool.sizes(), " and ", v_pool.sizes());
  TORCH_CHECK(k_new_.sizes() == at::IntArrayRef({T, Hkv, D}) && v_new_.sizes() == k_new_.sizes(),
              "mfs::decode_attention: k_new and v_new must be [", T, ", ", Hkv, ", ", D, "], got ", k_new_.sizes(),
              " and ", v_new_.sizes());
  TORCH_CHECK(flat.dim() == 1 && flat.scalar_type() == at::kLong && last.dim() == 1 &&
                  last.scalar_type() == at::kLong && last.size(0) == T && (T == 0 || flat.size(0) % T == 0),
              "mfs::decode_attention: flat must be int64 [T * lmax] and last int64 [T], got ", flat.sizes(), " and ",
              last.sizes());
  at::Tensor out = at::empty({T, Hq, D}, q_.options());
  if (T == 0) return out;
  const at::Tensor q = q_.contiguous(), k_new = k_new_.contiguous(), v_new = v_new_.contiguous();
  const at::Tensor fl = flat.contiguous(), la = last.contiguous();
  const int64_t lmax = fl.size(0) / T, G = Hq / Hkv;
  const int64_t* fp = fl.const_data_ptr<int64_t>();
  const int64_t* lp = la.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++)
    TORCH_CHECK(lp[t] >= 0 && lp[t] < lmax, "mfs::decode_attention: last[", t, "] = ", lp[t], " outside [0, ", lmax,
                ")");
  const float* qp = q.const_data_ptr<float>();
  const float* kp = k_pool.const_data_ptr<float>();
  const float* vp = v_pool.const_data_ptr<float>();
  const float* knp = k_new.const_data_ptr<float>();
  const float* vnp = v_new.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // at::parallel_for runs a range shorter than the grain inline: one row's few heads stay on this thread
  const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, lmax * D * G));
  at::parallel_for(0, T * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> s;
    for (int64_t i = begin; i < end; i++) {
      const int64_t t = i / Hkv, hk = i % Hkv, n = lp[t] + 1;
      const int64_t* slots = fp + t * lmax;
      for (int64_t p = 0; p + 1 < n; p++)
        TORCH_CHECK(slots[p] >= 0 && slots[p] < S, "mfs::decode_attention: slot ", slots[p], " outside the pool");
      s.resize(G * n);
      auto krow = [&](int64_t p) { return p + 1 == n ? knp + (t * Hkv + hk) * D : kp + (slots[p] * Hkv + hk) * D; };
      auto vrow = [&](int64_t p) { return p + 1 == n ? vnp + (t * Hkv + hk) * D : vp + (slots[p] * Hkv + hk) * D; };
      const float* qh = qp + (t * Hq + hk * G) * D;
      float* oh = op + (t * Hq + hk * G) * D;
#if defined(__AVX512F__)
      if (zmm_attend(G, D, qh, n, sc, krow, vrow, s.data(), oh)) continue;
#endif
      attend(qh, G, D, n, sc, krow, vrow, s.data(), oh);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mfs, m) {
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor flat, Tensor last, Tensor k_new, "
        "Tensor v_new, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mfs, CPU, m) { m.impl("decode_attention", &decode_attention); }
