// The two products of a prefill attention tile (attention.h) as AVX-512 register-blocked kernels (AVX2: below).
//
// The loops over small float arrays that they replace left their accumulators to the compiler, which at
// 64 rows x 64 keys x head 256 ran both products at about 50 GFLOP/s on a Zen 4 core (peak ~118). Here the
// accumulators are named zmm registers held across the whole reduction: scores take 4 keys x up to 64 rows
// (16 sums in flight, 8 loads per 16 FMAs), the weighted values 4 rows x up to 64 output columns across all
// keys of the tile, each output read and written once per tile.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace deltaserve {
namespace attn {
namespace zmm {

// GCC folds a loaded register into each FMA that reads it as a memory operand, one load per FMA (16 loads
// per 16 FMAs, load-bound); the empty asm makes the value a register, loaded once.
inline __m512 held(__m512 x) {
  asm("" : "+v"(x));
  return x;
}

// s[c, r] = k[c] . q[r] for c < keys (a multiple of KB), r < 16 * NV, from the queries transposed
// (qt[i * rows + r]): each key element broadcast against NV registers of rows.
template <int NV, int KB>
inline void scores_block(const float* qt, const float* k, float* s, int64_t rows, int64_t dk, int64_t keys) {
  for (int64_t c0 = 0; c0 < keys; c0 += KB) {
    __m512 a[KB][NV];
    #pragma GCC unroll 4
    for (int cc = 0; cc < KB; ++cc)
      #pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) a[cc][v] = _mm512_setzero_ps();
    const float* kc = k + c0 * dk;
    for (int64_t i = 0; i < dk; ++i) {
      __m512 q[NV];
      #pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) q[v] = held(_mm512_loadu_ps(qt + i * rows + 16 * v));
      #pragma GCC unroll 4
      for (int cc = 0; cc < KB; ++cc) {
        const __m512 x = _mm512_set1_ps(kc[cc * dk + i]);
        #pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) a[cc][v] = _mm512_fmadd_ps(x, q[v], a[cc][v]);
      }
    }
    #pragma GCC unroll 4
    for (int cc = 0; cc < KB; ++cc)
      #pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + (c0 + cc) * rows + 16 * v, a[cc][v]);
  }
}

// All rows (a multiple of 16) against the first `keys` keys of the tile (rounded up to the key block; the
// keys past the tile's count are zero rows, their scores never read).
inline void scores(const float* qt, const float* k, float* s, int64_t rows, int64_t dk, int64_t keys) {
  for (int64_t r0 = 0; r0 < rows; r0 += 64) {
    const float* q = qt + r0;
    float* o = s + r0;
    const int64_t up4 = (keys + 3) / 4 * 4, up8 = (keys + 7) / 8 * 8;
    switch (std::min<int64_t>(4, (rows - r0) / 16)) {
      case 4: scores_block<4, 4>(q, k, o, rows, dk, up4); break;
      case 3: scores_block<3, 4>(q, k, o, rows, dk, up4); break;
      case 2: scores_block<2, 8>(q, k, o, rows, dk, up8); break;
      default: scores_block<1, 8>(q, k, o, rows, dk, up8); break;
    }
  }
}

// exp(x) for x <= 0 to about 1 ulp (Cephes' reduction to [-ln2/2, ln2/2] and its polynomial), 0 far below.
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));  // scalef of the result flushes to 0 from about -88 down
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// The online softmax of one tile's scores s[c, r] (c < n keys from position `key`, rows a multiple of 16),
// sixteen rows a register, their running max and sum held in registers across the keys: row r sees the keys
// at or before pos[r] when `masked`. The scores become probabilities relative to the new running max m (0
// where not visible), l takes the tile's sums, and corr the factor that rescales each row's earlier output.
inline void softmax(float* s, int64_t rows, int64_t n, int64_t key, bool masked, const float* pos, float* m,
                    float* l, float* corr) {
  const __m512 none = _mm512_set1_ps(-1e30f);
  for (int64_t r = 0; r < rows; r += 16) {
    const __m512 old = _mm512_loadu_ps(m + r), at = _mm512_loadu_ps(pos + r);
    __m512 mx = old;
    for (int64_t c = 0; c < n; ++c) {
      const __mmask16 seen = masked ? _mm512_cmp_ps_mask(_mm512_set1_ps(float(key + c)), at, _CMP_LE_OQ)
                                    : __mmask16(0xFFFF);
      mx = _mm512_max_ps(mx, _mm512_mask_blend_ps(seen, none, _mm512_loadu_ps(s + c * rows + r)));
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; ++c) {
      const __mmask16 seen = masked ? _mm512_cmp_ps_mask(_mm512_set1_ps(float(key + c)), at, _CMP_LE_OQ)
                                    : __mmask16(0xFFFF);
      const __m512 e = _mm512_maskz_mov_ps(seen, exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + c * rows + r), mx)));
      _mm512_storeu_ps(s + c * rows + r, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 f = exp_neg(_mm512_sub_ps(old, mx));
    _mm512_storeu_ps(corr + r, f);
    _mm512_storeu_ps(l + r, _mm512_fmadd_ps(_mm512_loadu_ps(l + r), f, sum));
    _mm512_storeu_ps(m + r, mx);
  }
}

// acc[rr, :16 NV] += sum over c < n of p[c * rows + rr] v[c, :16 NV] for rr < 4 (acc rows dv apart, v rows dv
// apart, p, acc and v offset to the block); the last register of columns takes only the lanes in `tail`.
template <int NV>
inline void values_block(const float* p, const float* v, float* acc, int64_t rows, int64_t n, int64_t dv,
                         __mmask16 tail) {
  constexpr int R = 4;
  __mmask16 mask[NV];
  #pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) mask[j] = j == NV - 1 ? tail : __mmask16(0xFFFF);
  __m512 a[R][NV];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) a[r][j] = _mm512_maskz_loadu_ps(mask[j], acc + r * dv + 16 * j);
  for (int64_t c = 0; c < n; ++c) {
    __m512 x[NV];
    #pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) x[j] = held(_mm512_maskz_loadu_ps(mask[j], v + c * dv + 16 * j));
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[c * rows + r]);
      #pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(w, x[j], a[r][j]);
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) _mm512_mask_storeu_ps(acc + r * dv + 16 * j, mask[j], a[r][j]);
}

// acc[r] += sum over c < n of p[c, r] v[c] for r < real (rounded up to 4; rows a multiple of 16, padding
// rows' weights zero), any dv.
inline void values(const float* p, const float* v, float* acc, int64_t rows, int64_t real, int64_t n,
                   int64_t dv) {
  for (int64_t d0 = 0; d0 < dv; d0 += 64) {  // columns outer: their slice of the values stays in L1 over the rows
    const int64_t w = std::min<int64_t>(64, dv - d0), nv = (w + 15) / 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (w - 16 * (nv - 1))) - 1);
    for (int64_t r0 = 0; r0 < real; r0 += 4) {
      const float* pr = p + r0;
      float* ar = acc + r0 * dv + d0;
      switch (nv) {
        case 4: values_block<4>(pr, v + d0, ar, rows, n, dv, tail); break;
        case 3: values_block<3>(pr, v + d0, ar, rows, n, dv, tail); break;
        case 2: values_block<2>(pr, v + d0, ar, rows, n, dv, tail); break;
        default: values_block<1>(pr, v + d0, ar, rows, n, dv, tail); break;
      }
    }
  }
}

}  // namespace zmm
}  // namespace attn
}  // namespace deltaserve
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace deltaserve {
namespace attn {
// The same two products with AVX2's 16 registers (the AVX2 builds: AMD Zen 2 / 3, Intel client cores), where the
// plain loops' 4 x 32 sums took all 16 and GCC kept them in memory. The softmax stays in the plain loops.
namespace ymm {

inline __m256 held(__m256 x) {  // a loaded register used by several FMAs, loaded once (as zmm::held)
  asm("" : "+x"(x));
  return x;
}

// s[c, r] = k[c] . q[r] for c0 <= c < c0 + KB, r0 <= r < r0 + 16, from the queries transposed: each key element
// broadcast against 2 registers of rows, KB x 2 sums in flight
template <int KB>
inline void scores_block(const float* qt, const float* k, float* s, int64_t rows, int64_t dk, int64_t r0, int64_t c0) {
  __m256 a[KB][2];
#pragma GCC unroll 6
  for (int cc = 0; cc < KB; ++cc) a[cc][0] = a[cc][1] = _mm256_setzero_ps();
  const float *kc = k + c0 * dk, *q = qt + r0;
  for (int64_t i = 0; i < dk; ++i) {
    const __m256 q0 = held(_mm256_loadu_ps(q + i * rows)), q1 = held(_mm256_loadu_ps(q + i * rows + 8));
#pragma GCC unroll 6
    for (int cc = 0; cc < KB; ++cc) {
      const __m256 x = _mm256_broadcast_ss(kc + cc * dk + i);
      a[cc][0] = _mm256_fmadd_ps(x, q0, a[cc][0]);
      a[cc][1] = _mm256_fmadd_ps(x, q1, a[cc][1]);
    }
  }
#pragma GCC unroll 6
  for (int cc = 0; cc < KB; ++cc) {
    _mm256_storeu_ps(s + (c0 + cc) * rows + r0, a[cc][0]);
    _mm256_storeu_ps(s + (c0 + cc) * rows + r0 + 8, a[cc][1]);
  }
}

// s[c, r] = k[c] . q[r] for c < keys rounded up to 4 (zero key rows past the tile's count), r < rows (a multiple
// of 16): 16 rows (2 registers) at a time stay in L1 over all keys, 6 keys a block (12 sums in flight: FMAs wait 4
// cycles and two issue a cycle, so 8 left no slack), the last 4 or 2 apart.
inline void scores(const float* qt, const float* k, float* s, int64_t rows, int64_t dk, int64_t keys) {
  const int64_t up4 = (keys + 3) / 4 * 4, six = up4 / 6 * 6;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    for (int64_t c0 = 0; c0 < six; c0 += 6) scores_block<6>(qt, k, s, rows, dk, r0, c0);
    if (up4 - six == 4) scores_block<4>(qt, k, s, rows, dk, r0, six);
    else if (up4 - six == 2) scores_block<2>(qt, k, s, rows, dk, r0, six);
  }
}

// lanes below n of a register (n in 1 .. 8) for the masked loads and stores of a last block of columns
inline __m256i lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// acc[r] += sum over c < n of p[c * rows + r] v[c] for r0 <= r < r0 + RB, columns d0 .. d0 + 16 (FULL) or the
// first w of them (masked loads and stores, whose extra uops take the FMA ports: the last block only)
template <int RB, bool FULL>
inline void values_block(const float* p, const float* v, float* acc, int64_t rows, int64_t n, int64_t dv, int64_t r0,
                         int64_t d0, int64_t w) {
  const __m256i m0 = lanes(std::min<int64_t>(8, w)), m1 = lanes(std::max<int64_t>(w - 8, 0));
  float* ar = acc + r0 * dv + d0;
  __m256 a[RB][2];
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r) {
    a[r][0] = FULL ? _mm256_loadu_ps(ar + r * dv) : _mm256_maskload_ps(ar + r * dv, m0);
    a[r][1] = FULL ? _mm256_loadu_ps(ar + r * dv + 8) : _mm256_maskload_ps(ar + r * dv + 8, m1);
  }
  for (int64_t c = 0; c < n; ++c) {
    const float* vc = v + c * dv + d0;
    const __m256 x0 = held(FULL ? _mm256_loadu_ps(vc) : _mm256_maskload_ps(vc, m0));
    const __m256 x1 = held(FULL ? _mm256_loadu_ps(vc + 8) : _mm256_maskload_ps(vc + 8, m1));
#pragma GCC unroll 6
    for (int r = 0; r < RB; ++r) {
      const __m256 wt = _mm256_broadcast_ss(p + c * rows + r0 + r);
      a[r][0] = _mm256_fmadd_ps(wt, x0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(wt, x1, a[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r) {
    if (FULL) {
      _mm256_storeu_ps(ar + r * dv, a[r][0]);
      _mm256_storeu_ps(ar + r * dv + 8, a[r][1]);
    } else {
      _mm256_maskstore_ps(ar + r * dv, m0, a[r][0]);
      _mm256_maskstore_ps(ar + r * dv + 8, m1, a[r][1]);
    }
  }
}

template <bool FULL>
inline void values_cols(const float* p, const float* v, float* acc, int64_t rows, int64_t real, int64_t n, int64_t dv,
                        int64_t d0, int64_t w) {
  const int64_t up4 = (real + 3) / 4 * 4, six = up4 / 6 * 6;
  for (int64_t r0 = 0; r0 < six; r0 += 6) values_block<6, FULL>(p, v, acc, rows, n, dv, r0, d0, w);
  if (up4 - six == 4) values_block<4, FULL>(p, v, acc, rows, n, dv, six, d0, w);
  else if (up4 - six == 2) values_block<2, FULL>(p, v, acc, rows, n, dv, six, d0, w);
}

// acc[r] += sum over c < n of p[c * rows + r] v[c] for r < real rounded up to 4 (padding rows' weights are zero),
// any dv: 16 columns at a time (their slice of the values stays in L1 over the rows), 6 rows x 2 registers of sums
// held across all keys of the tile (as scores: 12 in flight), each output read and written once.
inline void values(const float* p, const float* v, float* acc, int64_t rows, int64_t real, int64_t n, int64_t dv) {
  for (int64_t d0 = 0; d0 < dv; d0 += 16) {
    const int64_t w = std::min<int64_t>(16, dv - d0);
    if (w == 16) values_cols<true>(p, v, acc, rows, real, n, dv, d0, w);
    else values_cols<false>(p, v, acc, rows, real, n, dv, d0, w);
  }
}

}  // namespace ymm
}  // namespace attn
}  // namespace deltaserve
#endif
