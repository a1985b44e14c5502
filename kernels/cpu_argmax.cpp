// Greedy decoding's argmax over the vocabulary, registered as the torch operator mfs::argmax_rows
// (kernels/cpu_argmax.py builds it with kernels/cpu_gemv.py's builder and loads it).
//
//   out[m] = the first n with x[m, n] == max_n x[m, n]   (a NaN counts as the largest: the first NaN)
//
// x fp32 [M, N] (rows contiguous), out int64 [M]: torch.argmax(x, dim=-1)'s answer, ties and NaNs alike.
//
// Why: torch's argmax along the last dim walks each row with a scalar compare-and-index chain:
// 16 rows of 49,152 logits (a 16-request decode step's head) take ~330 us on two threads, ten times
// its amax (~22 us). Here a row is read twice with 8-lane compares: its max (and whether it holds
// a NaN), then the first index equal to it; the row (192 KB) is in L2 for the second read. The rows
// are split over threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  if (n >= 8) {
    __m256 m0 = _mm256_set1_ps(best), m1 = m0;
    __m256 un = _mm256_setzero_ps();  // lanes that met an unordered (NaN) compare
    for (; i + 16 <= n; i += 16) {
      const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
      un = _mm256_or_ps(un, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
      m0 = _mm256_max_ps(m0, a);
      m1 = _mm256_max_ps(m1, b);
    }
    for (; i + 8 <= n; i += 8) {
      const __m256 a = _mm256_loadu_ps(x + i);
      un = _mm256_or_ps(un, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      m0 = _mm256_max_ps(m0, a);
    }
    nan = _mm256_movemask_ps(un) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
    for (float v : lanes) best = v > best ? v : best;
  }
  for (; i < n; i++) {
    if (std::isnan(x[i])) nan = true;
    else if (x[i] > best) best = x[i];
  }
  if (nan) {  // torch's answer: the first NaN
    for (int64_t j = 0; j < n; j++)
      if (std::isnan(x[j])) return j;
  }
  const __m256 target = _mm256_set1_ps(best);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (mask) return j + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; j < n; j++)
    if (x[j] == best) return j;
  return 0;  // unreachable for n > 0: best is one of the row's values (or -inf, which a row of -inf holds)
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "mfs::argmax_rows: x must be a CPU fp32 [M, N] tensor, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) > 0, "mfs::argmax_rows: rows must not be empty");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = xc.size(0), N = xc.size(1), ld = xc.stride(0);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  const float* xp = xc.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; m++) op[m] = argmax_row(xp + m * ld, N);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mfs, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(mfs, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
