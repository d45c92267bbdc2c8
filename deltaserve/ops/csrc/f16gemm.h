// The prefill GEMM of float16 weights: y [M, N] = x [M, K] (float32) @ W [N, K]^T with W float16 as the file stores
// it, accumulated in float32 (the activations are never rounded: the result is a float32 GEMM on the exact weights).
// bfloat16 weights times float32 activations take it too (bf16.h), widened by a shift instead of vcvtph2ps.
// Its format for panel_gemm.h: W is widened (vcvtph2ps) a block at a time into a float32 panel of kKC x kNC, laid
// [column tile][k][kNR] so that one vector load gives kNR columns at one k; x is laid out once per call in row tiles
// [tile][k][kMR] (rows of x K floats apart would alias the same L1 sets). The micro-kernel keeps a kMR x kNR block of
// y in registers and per k multiplies kNR / lanes vectors of W by kMR broadcast values of x.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panel_gemm.h"
#include "xrows.h"

namespace deltaserve {
namespace f16 {

#if defined(__AVX512F__)
// 4 zmm of columns x 6 rows: 24 accumulators of the 32 registers. Measured on the 2-core EPYC (Zen 4), one thread,
// 512 rows: 85-89% of the FMA peak a call, where 12 rows x 2 zmm (half the loads, twice the broadcasts) gave
// 81-83%, 24 x 1 80-83%, 7 x 4 80-83%.
constexpr int kNV = 4, kNR = 16 * kNV, kMR = 6;
constexpr int64_t kKC = 128;  // k per block: a column tile's panel is kKC x kNR floats, 32 KB (in L1: panel_gemm.h)
constexpr bool kColumnsOuter = true;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kNR = 16, kMR = 6;  // 2 ymm x 6 rows: 12 accumulators of the 16 registers
#else
constexpr int kNR = 16, kMR = 4;  // portable C++, vectorised by the compiler
#endif
#if !defined(__AVX512F__)
// the AVX2 tile leaves its registers through memory (below): passing a column tile at a time measured no faster there
constexpr int64_t kKC = 256;  // k per block: a row tile's block of x is kMR x kKC floats
constexpr bool kColumnsOuter = false;
#endif
constexpr int64_t kNC = 256;  // columns per block: the widened panel is kKC x kNC floats (128 KB; AVX2 256 KB)
static_assert(kNC % kNR == 0, "a block of columns is whole tiles: the panel holds kKC x kNC floats");

// One stored value widened to float32: float16 (BF16 false) or bfloat16 (its bits are a float32's upper half)
template <bool BF16>
inline float widen1(uint16_t h) {
  if constexpr (BF16) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  }
}

// x [M, K] (rows ldx floats apart) -> xp [ceil(M / kMR)][K][kMR] (a last tile's missing rows are never read)
inline void pack_x(const float* x, int64_t M, int64_t K, int64_t ldx, float* xp) {
  at::parallel_for(0, (M + kMR - 1) / kMR, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t rows = std::min<int64_t>(kMR, M - t * kMR);
      const float* xr = x + t * kMR * ldx;
      float* out = xp + t * kMR * K;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t i = 0; i < rows; ++i) out[k * kMR + i] = xr[i * ldx + k];
    }
  });
}

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
// 8 stored values of a row widened; a short tail (k < 8) through a zeroed copy
template <bool BF16>
inline __m256 widen8(__m128i v) {
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  else return _mm256_cvtph_ps(v);
}

template <bool BF16>
inline __m256 widen8(const uint16_t* w, int64_t k) {
  if (k == 8) return widen8<BF16>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  alignas(16) uint16_t tail[8] = {0};
  std::memcpy(tail, w, k * sizeof(uint16_t));
  return widen8<BF16>(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
}

// r[i][j] -> r[j][i] for an 8 x 8 block: pairs of rows interleaved, then quads, then the 128-bit halves
inline void transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int p = 0; p < 4; ++p) {
    t[2 * p] = _mm256_unpacklo_ps(r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm256_unpackhi_ps(r[2 * p], r[2 * p + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // s[4h + c]: rows 4h .. 4h + 3 at columns c and c + 4
    s[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
  }
}
#endif

#if defined(__AVX512F__)
// 16 stored values of a row widened; a short tail (k < 16) through a zeroed copy
template <bool BF16>
inline __m512 widen16(__m256i v) {
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  else return _mm512_cvtph_ps(v);
}

template <bool BF16>
inline __m512 widen16(const uint16_t* w, int64_t k) {
  if (k == 16) return widen16<BF16>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  alignas(32) uint16_t tail[16] = {0};
  std::memcpy(tail, w, k * sizeof(uint16_t));
  return widen16<BF16>(_mm256_load_si256(reinterpret_cast<const __m256i*>(tail)));
}
#endif

// W rows n0 .. n0 + nc, columns k0 .. k0 + kc, widened into bp [ceil(nc / kNR)][kc][kNR] (rows past nc: zero)
template <bool BF16>
inline void pack_w(const uint16_t* w, int64_t K, int64_t n0, int64_t nc, int64_t k0, int64_t kc, float* bp) {
  const int64_t tiles = (nc + kNR - 1) / kNR;
#if defined(__AVX512F__)
  for (int64_t g = 0; g < kNV * tiles; ++g) {  // 16 rows at a time: a tile's kNV parts
    float* out = bp + (g / kNV) * kc * kNR + (g % kNV) * 16;
    const int64_t rows = std::clamp<int64_t>(nc - 16 * g, 0, 16);
    const uint16_t* wr = w + (n0 + 16 * g) * K + k0;
    for (int64_t k = 0; k < kc; k += 16) {
      const int64_t kn = std::min<int64_t>(16, kc - k);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = i < rows ? widen16<BF16>(wr + i * K + k, kn) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t j = 0; j < kn; ++j) _mm512_storeu_ps(out + (k + j) * kNR, r[j]);
    }
  }
#elif defined(__AVX2__) && defined(__F16C__)
  for (int64_t g = 0; g < 2 * tiles; ++g) {  // 8 rows at a time: a tile's two halves
    float* out = bp + (g / 2) * kc * kNR + (g % 2) * 8;
    const int64_t rows = std::clamp<int64_t>(nc - 8 * g, 0, 8);
    const uint16_t* wr = w + (n0 + 8 * g) * K + k0;
    for (int64_t k = 0; k < kc; k += 8) {
      const int64_t kn = std::min<int64_t>(8, kc - k);
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = i < rows ? widen8<BF16>(wr + i * K + k, kn) : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t j = 0; j < kn; ++j) _mm256_storeu_ps(out + (k + j) * kNR, r[j]);
    }
  }
#else
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t j = 0; j < kNR; ++j) {
      float* out = bp + t * kc * kNR + j;
      const int64_t n = t * kNR + j;
      for (int64_t k = 0; k < kc; ++k) out[k * kNR] = n < nc ? widen1<BF16>(w[(n0 + n) * K + k0 + k]) : 0.f;
    }
#endif
}

// y[i][0 .. cols) (+)= sum over k < kc of xp[k][i] * bp[k][0 .. cols) for the MR rows of a tile; add: y holds the
// sum over the earlier blocks of k
template <int MR>
inline void tile(const float* xp, const float* bp, int64_t kc, float* y, int64_t ldy, int64_t cols, bool add) {
#if defined(__AVX512F__)
  __m512 c[MR][kNV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kNV; ++v) c[i][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m512 b[kNV];
    for (int v = 0; v < kNV; ++v) b[v] = _mm512_loadu_ps(bp + k * kNR + 16 * v);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(xp[k * kMR + i]);
      for (int v = 0; v < kNV; ++v) c[i][v] = _mm512_fmadd_ps(a, b[v], c[i][v]);
    }
  }
  store_tile<MR, kNV>(c, y, ldy, cols, add);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  __m256 c0[MR], c1[MR];
  for (int i = 0; i < MR; ++i) c0[i] = c1[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(bp + k * kNR), b1 = _mm256_loadu_ps(bp + k * kNR + 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(xp + k * kMR + i);
      c0[i] = _mm256_fmadd_ps(a, b0, c0[i]);
      c1[i] = _mm256_fmadd_ps(a, b1, c1[i]);
    }
  }
  // the sums leave their registers in an unrolled loop: with a loop over i here, GCC kept c0 and c1 in memory too and
  // stored all 12 at every k (44% of the FMA peak, store-bound)
  alignas(32) float out[MR][kNR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(out[i], c0[i]);
    _mm256_store_ps(out[i] + 8, c1[i]);
  }
  for (int i = 0; i < MR; ++i) {
    float* yr = y + i * ldy;
    for (int64_t j = 0; j < cols; ++j) yr[j] = add ? yr[j] + out[i][j] : out[i][j];
  }
#else
  float c[MR][kNR] = {};
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < kNR; ++j) c[i][j] += xp[k * kMR + i] * bp[k * kNR + j];
  for (int i = 0; i < MR; ++i)
    for (int64_t j = 0; j < cols; ++j) y[i * ldy + j] = add ? y[i * ldy + j] + c[i][j] : c[i][j];
#endif
}

template <int... R>
inline void tile_rows(std::integer_sequence<int, R...>, int64_t rows, const float* xp, const float* bp, int64_t kc,
                      float* y, int64_t ldy, int64_t cols, bool add) {
  ((rows == R + 1 ? tile<R + 1>(xp, bp, kc, y, ldy, cols, add) : void()), ...);
}

// the format panel_gemm.h runs: float32 x in row tiles [tile][k][kMR], W (float16, or bfloat16 where BF16) widened
// into [column tile][k][kNR]
template <bool BF16>
struct Format {
  using X = float;
  using P = float;
  static constexpr int64_t kMR = f16::kMR, kNR = f16::kNR, kKC = f16::kKC, kNC = f16::kNC;
  static int64_t x_at(int64_t t, int64_t K, int64_t k0) { return t * kMR * K + k0 * kMR; }
  static int64_t panel_at(int64_t j, int64_t kc) { return j * kc; }
  static int64_t panel_size() { return kKC * kNC; }
  static constexpr bool kColumnsOuter = f16::kColumnsOuter;
  using Scope = NoTiles;
  static void pack_w(const uint16_t* w, int64_t K, int64_t n0, int64_t nc, int64_t k0, int64_t kc, float* bp) {
    f16::pack_w<BF16>(w, K, n0, nc, k0, kc, bp);
  }
  static void tile(int64_t rows, const float* xp, const float* bp, int64_t kc, float* y, int64_t ldy, int64_t cols,
                   bool add) {
    tile_rows(std::make_integer_sequence<int, kMR>{}, rows, xp, bp, kc, y, ldy, cols, add);
  }
};

// y [M, N] = x [M, K] (rows ldx floats apart) @ W [N, K]^T on raw pointers (M, N, K >= 1), W float16 or (BF16)
// bfloat16. The packed x (7 MB for 512 rows of 3,584) from torch's allocator: blocks.h's range once a model has loaded.
template <bool BF16 = false>
inline void gemm(const float* x, int64_t ldx, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const at::Tensor held = at::empty({(M + kMR - 1) / kMR * kMR * K}, at::kFloat);  // pack_x writes every value read
  pack_x(x, M, K, ldx, held.data_ptr<float>());
  panel_gemm<Format<BF16>>(held.data_ptr<float>(), w, y, M, N, K);
}

inline void check_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& y) {
  check_rows(x, "linear_f16_gemm");
  TORCH_CHECK(w.dtype() == at::kHalf && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be float16 [N, K] contiguous, K as x's");
  TORCH_CHECK(y.dtype() == at::kFloat && y.is_contiguous() && y.dim() == 2 && y.size(0) == x.size(0) &&
              y.size(1) == w.size(0), "y must be float32 [M, N] contiguous");
}

// y [M, N] = x [M, K] (float32) @ w [N, K]^T (float16), accumulated in float32: the GEMM above whatever M
inline void linear_f16_gemm(at::Tensor x, at::Tensor w, at::Tensor y) {
  check_args(x, w, y);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ldx = row_stride(x);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    y.zero_();
    return;
  }
  gemm(x.data_ptr<float>(), ldx, reinterpret_cast<const uint16_t*>(w.data_ptr<at::Half>()), y.data_ptr<float>(), M, N, K);
}

}  // namespace f16
}  // namespace deltaserve
