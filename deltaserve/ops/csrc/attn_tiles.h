// The two products of a prefill attention tile (attention.h) as AVX-512 register-blocked kernels.
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
#endif
