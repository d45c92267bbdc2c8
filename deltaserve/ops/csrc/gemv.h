// Matrix-vector products for decode on weights stored narrower than the activations (float16, Q8_0).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "shares.h"

namespace deltaserve {

// The GEMVs below prefetch the weight stream this many bytes ahead: the hardware prefetchers alone
// reach 15-19 GB/s here, with this 24-26 GB/s (streaming 0.8B weights, 2 threads).
constexpr int64_t kGemvPrefetch = 4096;
constexpr int64_t kF16Prefetch = 8192;  // linear_f16's, into L2 (f16_dots says why)

// sums[m] = weight row [K] (float16) . x row m [K] (rows ld apart), for MB rows of x. MB is known at compile time so
// the accumulators stay in registers (with a run-time count they lived on the stack, and 3 rows cost 2.6x one).
// The summation order is the same for every MB, so a row's result does not depend on the batch. The stream is
// prefetched into L2, not L1: this loop is tight enough that prefetches into L1 held back its own loads (1 x 6144 x
// 1024: 17 GB/s with T0 4 KB ahead, 26-28 with T1 8 KB ahead; two rows a pass, tried for latency, gained nothing).
template <int64_t MB>
inline void f16_dots(const uint16_t* w, const float* xp, int64_t ld, int64_t K, float* sums) {
  int64_t k = 0;
  for (int64_t m = 0; m < MB; ++m) sums[m] = 0.f;
#if defined(__AVX512F__)
  __m512 acc[MB], acc2[MB];
  for (int64_t m = 0; m < MB; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + kF16Prefetch, _MM_HINT_T1);
    const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)));
    const __m512 wv2 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 16)));
    for (int64_t m = 0; m < MB; ++m) {
      acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + m * ld + k), acc[m]);
      acc2[m] = _mm512_fmadd_ps(wv2, _mm512_loadu_ps(xp + m * ld + k + 16), acc2[m]);
    }
  }
  for (; k + 16 <= K; k += 16) {
    const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)));
    for (int64_t m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + m * ld + k), acc[m]);
  }
  for (int64_t m = 0; m < MB; ++m) sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m]));
#endif
  for (; k < K; ++k) {
    const float wk = static_cast<float>(c10::Half(w[k], c10::Half::from_bits()));
    for (int64_t m = 0; m < MB; ++m) sums[m] += wk * xp[m * ld + k];
  }
}

// y[m, n] for output rows n in [lo, hi) and MB rows of x.
template <int64_t MB>
void f16_rows(const uint16_t* wp, const float* xp, float* yp, int64_t K, int64_t N, int64_t lo, int64_t hi) {
  float sums[MB];
  for (int64_t n = lo; n < hi; ++n) {
    f16_dots<MB>(wp + n * K, xp, K, K, sums);
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
    const ShareClock clock(hi - lo);
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
