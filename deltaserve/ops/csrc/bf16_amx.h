// The prefill GEMM of activations rounded to bfloat16 on AMX tiles (amx.h), as panel_gemm.h's format: tdpbf16ps
// multiplies a 16 x 32 tile of x by a 32 x 16 tile of W (held as 16 pairs of k a row, the layout pack_pairs writes
// for vdpbf16ps too) into 16 x 16 float32 sums, each sum over a pair a product exact in float32 (as vdpbf16ps).
// A micro-kernel keeps 2 x 2 tiles of sums (32 rows x 32 columns) in four tile registers over a block of k, loading
// two tiles of x and two of W a step: four tdpbf16ps to four 1 KB loads. A block of k is all of K up to 4096, so that
// the sums stay in their tiles: blocks of 256 (a row tile's block of x in L1) loaded and stored the four sum tiles
// at every block, 8 KB through memory per 32 products, and 4096 x 128 ran 1.2-1.3x faster at 512 x 6144-7168 x 1024
// on the AMX Xeon (x and W then both come from L2; the panel, 1 MB, stays there: 256 columns ran K = 3584 slower).
// Both operands are padded with zeros to whole steps of 32 k and whole tiles of rows, so no tile ever reads past
// what was written.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "panel_gemm.h"

namespace deltaserve {
namespace bf16 {

#if defined(DELTASERVE_AMX)
struct AmxFormat {
  using X = uint16_t;
  using P = uint16_t;
  using Scope = amx::Scope;
  static constexpr int64_t kMR = 32, kNR = 32, kKC = 4096, kNC = 128;
  static int64_t r32(int64_t k) { return (k + 31) & ~int64_t{31}; }
  // x: [row tile][K / 32][kMR rows][32]; a panel: [16-column group][kc / 2][16][2]
  static int64_t x_at(int64_t t, int64_t K, int64_t k0) { return t * kMR * r32(K) + k0 * kMR; }
  static int64_t panel_at(int64_t j, int64_t kc) { return j * r32(kc); }
  static int64_t panel_size() { return kKC * kNC; }
  static constexpr bool kColumnsOuter = false;
  static int64_t x_size(int64_t M, int64_t K) { return (M + kMR - 1) / kMR * kMR * r32(K); }

  // x [M, K] rounded into xp (x_at's layout, missing rows and k zero)
  static void pack_x(const float* x, int64_t M, int64_t K, int64_t ldx, uint16_t* xp) {
    const int64_t K32 = r32(K);
    at::parallel_for(0, (M + kMR - 1) / kMR, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t)
        for (int64_t i = 0; i < kMR; ++i) {
          uint16_t* out = xp + t * kMR * K32 + 32 * i;
          const int64_t m = t * kMR + i;
          for (int64_t k = 0; k < K32; k += 32) {
            __m512i r = _mm512_setzero_si512();
            if (m < M) {
              const float* xr = x + m * ldx + k;
              const int64_t lo16 = std::clamp<int64_t>(K - k, 0, 16), hi16 = std::clamp<int64_t>(K - k - 16, 0, 16);
              const __m512 a = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << lo16) - 1), xr);
              const __m512 b = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << hi16) - 1), xr + 16);
              r = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            }
            _mm512_storeu_si512(out + k * kMR, r);
          }
        }
    });
  }

  static void pack_w(const uint16_t* w, int64_t K, int64_t n0, int64_t nc, int64_t k0, int64_t kc, uint16_t* bp) {
    pack_pairs<1>(w, K, n0, nc, k0, kc, r32(kc), 2 * ((nc + kNR - 1) / kNR), bp);
  }

  // y's rows x cols (<= 32 x 32, ldy apart) (+)= the tile's sums over kc
  static void tile(int64_t rows, const uint16_t* xp, const uint16_t* bp, int64_t kc, float* y, int64_t ldy,
                   int64_t cols, bool add) {
    const bool whole = rows == kMR && cols == kNR;
    alignas(64) float edge[kMR][kNR];  // a partial tile's sums, staged
    float* c = whole ? y : &edge[0][0];
    const int64_t ld = whole ? ldy : kNR, ldc = 4 * ld;  // floats, bytes between rows
    if (add && !whole) {
      std::memset(edge, 0, sizeof(edge));
      for (int64_t i = 0; i < rows; ++i) std::memcpy(edge[i], y + i * ldy, 4 * cols);
    }
    if (add) {
      _tile_loadd(0, c, ldc);
      _tile_loadd(1, c + 16, ldc);
      _tile_loadd(2, c + 16 * ld, ldc);
      _tile_loadd(3, c + 16 * ld + 16, ldc);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    const uint16_t* b1 = bp + 16 * r32(kc);
    for (int64_t s = 0; s < r32(kc) / 32; ++s) {
      _tile_loadd(4, xp + s * kMR * 32, 64);
      _tile_loadd(5, xp + s * kMR * 32 + 16 * 32, 64);
      _tile_loadd(6, bp + s * 512, 64);
      _tile_loadd(7, b1 + s * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, ldc);
    _tile_stored(1, c + 16, ldc);
    _tile_stored(2, c + 16 * ld, ldc);
    _tile_stored(3, c + 16 * ld + 16, ldc);
    if (!whole)
      for (int64_t i = 0; i < rows; ++i) std::memcpy(y + i * ldy, edge[i], 4 * cols);
  }
};
#endif

}  // namespace bf16
}  // namespace deltaserve
