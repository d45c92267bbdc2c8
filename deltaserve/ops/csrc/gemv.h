// Matrix-vector products for decode on weights stored narrower than the activations (float16, Q8_0).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "shares.h"

namespace deltaserve {

// The GEMVs below prefetch the weight stream this many bytes ahead: the hardware prefetchers alone
// reach 15-19 GB/s here, with this 24-26 GB/s (streaming 0.8B weights, 2 threads).
constexpr int64_t kGemvPrefetch = 4096;
constexpr int64_t kF16Prefetch = 8192;  // linear_f16's, into L2 (f16_block says why)

#if defined(__AVX512F__)
// The lane sums of v[0..15] as one vector (lane j: v[j]'s 16 lanes added): pairs interleaved and added within each
// 128-bit lane, then quads, then across the four 128-bit lanes. 45 operations for 16 sums, where a reduce_add each
// took 8 and ended a dependency chain: at 3 activation rows the reductions cost half the FMAs of a 256-wide row.
inline __m512 sum16(const __m512* v) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lane l: v[2i]'s and v[2i+1]'s partial sums interleaved
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 128-bit lane l: the sums over lane l of v[4i .. 4i+3]
    const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], even), _mm512_shuffle_f32x4(w[0], w[1], odd));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], even), _mm512_shuffle_f32x4(w[2], w[3], odd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, even), _mm512_shuffle_f32x4(s01, s23, odd));
}

// y[m, n0 .. n0+nb) for nb <= 16 weight rows from w (row n0) and MB rows of x (ld apart). MB is known at compile time
// so the accumulators stay in registers; each weight row's lanes are summed with its 15 neighbours' (sum16). A
// row's K % 16 last weights come in masked, into the same accumulators. The order of the sums does not depend on
// MB, so a row's result does not depend on the batch. The stream is prefetched into L2, not L1: this loop is tight
// enough that prefetches into L1 held back its own loads (1 x 6144 x 1024: 17 GB/s with T0 4 KB ahead, 26-28 with
// T1 8 KB ahead).
template <int64_t MB>
inline void f16_block(const uint16_t* w, const float* xp, int64_t ld, int64_t K, float* yp, int64_t N, int64_t nb) {
  __m512 lanes[MB][16];
  const int64_t k16 = K & ~int64_t{15}, k32 = K & ~int64_t{31};
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - k16)) - 1);
  for (int64_t j = 0; j < 16; ++j) {
    if (j >= nb) {
      for (int64_t m = 0; m < MB; ++m) lanes[m][j] = _mm512_setzero_ps();
      continue;
    }
    const uint16_t* wr = w + j * K;
    __m512 acc[MB], acc2[MB];
    for (int64_t m = 0; m < MB; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k32; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + k) + kF16Prefetch, _MM_HINT_T1);
      const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k)));
      const __m512 wv2 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k + 16)));
      for (int64_t m = 0; m < MB; ++m) {
        acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + m * ld + k), acc[m]);
        acc2[m] = _mm512_fmadd_ps(wv2, _mm512_loadu_ps(xp + m * ld + k + 16), acc2[m]);
      }
    }
    if (k16 > k32) {
      const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k32)));
      for (int64_t m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + m * ld + k32), acc[m]);
    }
    if (tail) {
      const __m512 wv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail, wr + k16));
      for (int64_t m = 0; m < MB; ++m)
        acc2[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, xp + m * ld + k16), acc2[m]);
    }
    for (int64_t m = 0; m < MB; ++m) lanes[m][j] = _mm512_add_ps(acc[m], acc2[m]);
  }
  const __mmask16 out = static_cast<__mmask16>((1u << nb) - 1);
  for (int64_t m = 0; m < MB; ++m) _mm512_mask_storeu_ps(yp + m * N, out, sum16(lanes[m]));
}

// y[m, n] for output rows n in [lo, hi) and MB rows of x.
template <int64_t MB>
void f16_rows(const uint16_t* wp, const float* xp, float* yp, int64_t K, int64_t N, int64_t lo, int64_t hi) {
  for (int64_t n = lo; n < hi; n += 16) f16_block<MB>(wp + n * K, xp, K, K, yp + n, N, std::min<int64_t>(16, hi - n));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The lane sums of v[0..7] as one vector (lane j: v[j]'s 8 lanes added): horizontal adds of pairs, then of quads,
// then the two 128-bit halves.
inline __m256 sum8(const __m256* v) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// The AVX2 form of the f16_block above: 8 weight rows a block, 8 lanes, and a row's K % 8 last weights from a
// zero-padded copy (AVX2 has no masked 16-bit load).
template <int64_t MB>
inline void f16_block(const uint16_t* w, const float* xp, int64_t ld, int64_t K, float* yp, int64_t N, int64_t nb) {
  __m256 lanes[MB][8];
  const int64_t k8 = K & ~int64_t{7}, k16 = K & ~int64_t{15};
  alignas(32) float xt[MB][8] = {};
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t k = k8; k < K; ++k) xt[m][k - k8] = xp[m * ld + k];
  for (int64_t j = 0; j < 8; ++j) {
    if (j >= nb) {
      for (int64_t m = 0; m < MB; ++m) lanes[m][j] = _mm256_setzero_ps();
      continue;
    }
    const uint16_t* wr = w + j * K;
    __m256 acc[MB], acc2[MB];
    for (int64_t m = 0; m < MB; ++m) acc[m] = acc2[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k16; k += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + k) + kF16Prefetch, _MM_HINT_T1);
      const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k)));
      const __m256 wv2 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k + 8)));
      for (int64_t m = 0; m < MB; ++m) {
        acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp + m * ld + k), acc[m]);
        acc2[m] = _mm256_fmadd_ps(wv2, _mm256_loadu_ps(xp + m * ld + k + 8), acc2[m]);
      }
    }
    if (k8 > k16) {
      const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k16)));
      for (int64_t m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp + m * ld + k16), acc[m]);
    }
    if (K > k8) {
      alignas(16) uint16_t wt[8] = {};
      for (int64_t k = k8; k < K; ++k) wt[k - k8] = wr[k];
      const __m256 wv = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(wt)));
      for (int64_t m = 0; m < MB; ++m) acc2[m] = _mm256_fmadd_ps(wv, _mm256_load_ps(xt[m]), acc2[m]);
    }
    for (int64_t m = 0; m < MB; ++m) lanes[m][j] = _mm256_add_ps(acc[m], acc2[m]);
  }
  for (int64_t m = 0; m < MB; ++m) {
    alignas(32) float out[8];
    _mm256_store_ps(out, sum8(lanes[m]));
    for (int64_t j = 0; j < nb; ++j) yp[m * N + j] = out[j];
  }
}

template <int64_t MB>
void f16_rows(const uint16_t* wp, const float* xp, float* yp, int64_t K, int64_t N, int64_t lo, int64_t hi) {
  for (int64_t n = lo; n < hi; n += 8) f16_block<MB>(wp + n * K, xp, K, K, yp + n, N, std::min<int64_t>(8, hi - n));
}
#else
// y[m, n] for output rows n in [lo, hi) and MB rows of x: each weight row's dot products with the MB rows, summed in
// 16 lanes (which the compiler vectorises; one running sum lost 3e-5 of a 1000-term product) added pairwise.
template <int64_t MB>
void f16_rows(const uint16_t* wp, const float* xp, float* yp, int64_t K, int64_t N, int64_t lo, int64_t hi) {
  for (int64_t n = lo; n < hi; ++n) {
    float lanes[MB][16] = {};
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      const int64_t width = std::min<int64_t>(16, K - k0);
      for (int64_t j = 0; j < width; ++j) {
        const float wk = static_cast<float>(c10::Half(wp[n * K + k0 + j], c10::Half::from_bits()));
        for (int64_t m = 0; m < MB; ++m) lanes[m][j] += wk * xp[m * K + k0 + j];
      }
    }
    for (int64_t m = 0; m < MB; ++m) {
      for (int64_t half = 8; half >= 1; half /= 2)
        for (int64_t j = 0; j < half; ++j) lanes[m][j] += lanes[m][j + half];
      yp[m * N + n] = lanes[m][0];
    }
  }
}
#endif

// y [M, N] = x [M, K] (float32) @ w [N, K]^T (float16), accumulated in float32. For decode (M = a few
// sequences) the weights stream from memory once, converted to float32 in registers: the activations are
// never rounded to float16, so the result equals a float32 matmul with the float16 weights.
void linear_f16(at::Tensor x, at::Tensor w, at::Tensor y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  // activation rows per pass over the weights: 8, or 4 where 16 vector registers hold the sums (AVX2)
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  constexpr int64_t MB = 4;
#else
  constexpr int64_t MB = 8;
#endif
  using Rows = void (*)(const uint16_t*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
  static constexpr Rows rows[9] = {nullptr, f16_rows<1>, f16_rows<2>, f16_rows<3>, f16_rows<4>,
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
void linear_q8(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor y) {
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
