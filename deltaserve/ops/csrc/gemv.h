// Matrix-vector products for decode on weights stored narrower than the activations (float16, Q8_0).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace deltaserve {

// The GEMVs below prefetch the weight stream this many bytes ahead: the hardware prefetchers alone
// reach 15-19 GB/s here, with this 24-26 GB/s (streaming 0.8B weights, 2 threads).
constexpr int64_t kGemvPrefetch = 4096;

// sums[r * MB + m] = weight row r [K] (float16, rows ws apart) . x row m [K] (rows ld apart), for R weight rows and MB
// rows of x. Both counts are known at compile time so the accumulators stay in registers (with a run-time count
// they lived on the stack, and 3 rows cost 2.6x one). Each sum has two accumulator chains, so with K = 256 one row
// is 8 dependent FMAs: R = 2 runs two rows' chains side by side and shares each x load between them. The
// summation order of a sum is the same for every R and MB, so a row's result does not depend on the batch.
template <int64_t R, int64_t MB>
inline void f16_dots(const uint16_t* wr, int64_t ws, const float* xp, int64_t ld, int64_t K, float* sums) {
  int64_t k = 0;
  for (int64_t i = 0; i < R * MB; ++i) sums[i] = 0.f;
#if defined(__AVX512F__)
  __m512 acc[R][MB], acc2[R][MB];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < MB; ++m) acc[r][m] = acc2[r][m] = _mm512_setzero_ps();
  for (; k + 32 <= K; k += 32) {
    __m512 wv[R], wv2[R];
    for (int64_t r = 0; r < R; ++r) {
      const uint16_t* w = wr + r * ws + k;
      _mm_prefetch(reinterpret_cast<const char*>(w) + kGemvPrefetch, _MM_HINT_T0);
      wv[r] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
      wv2[r] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)));
    }
    for (int64_t m = 0; m < MB; ++m) {
      const __m512 x = _mm512_loadu_ps(xp + m * ld + k), x2 = _mm512_loadu_ps(xp + m * ld + k + 16);
      for (int64_t r = 0; r < R; ++r) {
        acc[r][m] = _mm512_fmadd_ps(wv[r], x, acc[r][m]);
        acc2[r][m] = _mm512_fmadd_ps(wv2[r], x2, acc2[r][m]);
      }
    }
  }
  for (; k + 16 <= K; k += 16)
    for (int64_t r = 0; r < R; ++r) {
      const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + r * ws + k)));
      for (int64_t m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + m * ld + k), acc[r][m]);
    }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < MB; ++m) sums[r * MB + m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m], acc2[r][m]));
#endif
  for (; k < K; ++k)
    for (int64_t r = 0; r < R; ++r) {
      const float wk = static_cast<float>(c10::Half(wr[r * ws + k], c10::Half::from_bits()));
      for (int64_t m = 0; m < MB; ++m) sums[r * MB + m] += wk * xp[m * ld + k];
    }
}

// y[m, n] for output rows n in [lo, hi) and MB rows of x: two weight rows at a time where MB leaves the registers
// for their accumulators (4 R MB of 32), then one.
template <int64_t MB>
void f16_rows(const uint16_t* wp, const float* xp, float* yp, int64_t K, int64_t N, int64_t lo, int64_t hi) {
  float sums[2 * MB];
  int64_t n = lo;
  if (MB <= 4)
    for (; n + 2 <= hi; n += 2) {
      f16_dots<2, MB>(wp + n * K, K, xp, K, K, sums);
      for (int64_t m = 0; m < MB; ++m) yp[m * N + n] = sums[m], yp[m * N + n + 1] = sums[MB + m];
    }
  for (; n < hi; ++n) {
    f16_dots<1, MB>(wp + n * K, K, xp, K, K, sums);
    for (int64_t m = 0; m < MB; ++m) yp[m * N + n] = sums[m];
  }
}

// y [M, N] = x [M, K] (float32) @ w [N, K]^T (float16), accumulated in float32. For decode (M = a few
// sequences) the weights stream from memory once, converted to float32 in registers: the activations are
// never rounded to float16, so the result equals a float32 matmul with the float16 weights.
void linear_f16(torch::Tensor x, torch::Tensor w, torch::Tensor y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  constexpr int64_t MB = 8;  // activation rows per pass over the weights
  using Rows = void (*)(const uint16_t*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
  static constexpr Rows rows[MB + 1] = {nullptr, f16_rows<1>, f16_rows<2>, f16_rows<3>, f16_rows<4>,
                                        f16_rows<5>, f16_rows<6>, f16_rows<7>, f16_rows<8>};
  constexpr int64_t NB = 16;  // weight rows per step: past 8 rows of x, the next block reads them again from L1 / L2
  at::parallel_for(0, N, NB, [&](int64_t lo, int64_t hi) {
    for (int64_t n0 = lo; n0 < hi; n0 += NB)
      for (int64_t m0 = 0; m0 < M; m0 += MB)
        rows[std::min(MB, M - m0)](wp, xp + m0 * K, yp + m0 * N, K, N, n0, std::min(hi, n0 + NB));
  });
}

// y [M, N] = x [M, K] (float32) @ W^T, W [N, K] in Q8_0 form: W[n, k] = d[n, k / 32] * q[n, k] with q int8
// and d float16 (one scale per 32 weights of a row, llama.cpp's Q8_0 block). For decode: the weights
// stream from memory at 1.0625 bytes each and are widened in registers; the activations stay float32, so
// the result equals a float32 matmul with the dequantised weights (up to summation order).
void linear_q8(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor y) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), B = K / 32;
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t MB = 8;  // activation rows per pass over a weight row
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const int8_t* qr = qp + n * K;
      const at::Half* dr = dp + n * B;
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = std::min(MB, M - m0);
        float sums[MB] = {0.f};
#if defined(__AVX512F__)
        __m512 acc[MB], acc2[MB];
        for (int64_t m = 0; m < mb; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
        for (int64_t b = 0; b < B; ++b) {
          const int64_t k = b * 32;
          _mm_prefetch(reinterpret_cast<const char*>(qr + k) + kGemvPrefetch, _MM_HINT_T0);
          const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k))));
          const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k + 16))));
          const __m512 db = _mm512_set1_ps(static_cast<float>(dr[b]));
          for (int64_t m = 0; m < mb; ++m) {
            const float* xr = xp + (m0 + m) * K + k;
            const __m512 p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xr)));
            if (b & 1) acc2[m] = _mm512_fmadd_ps(p, db, acc2[m]);
            else acc[m] = _mm512_fmadd_ps(p, db, acc[m]);
          }
        }
        for (int64_t m = 0; m < mb; ++m) sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m]));
#else
        for (int64_t b = 0; b < B; ++b) {
          const float db = static_cast<float>(dr[b]);
          for (int64_t m = 0; m < mb; ++m) {
            float p = 0.f;
            for (int64_t j = 0; j < 32; ++j) p += static_cast<float>(qr[b * 32 + j]) * xp[(m0 + m) * K + b * 32 + j];
            sums[m] += db * p;
          }
        }
#endif
        for (int64_t m = 0; m < mb; ++m) yp[(m0 + m) * N + n] = sums[m];
      }
    }
  });
}

}  // namespace deltaserve
