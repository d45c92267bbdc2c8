// The driver of the prefill GEMMs that rearrange W a panel at a time as it lies in the file (f16gemm.h: float16
// widened to float32; bf16.h: bfloat16 pairs for vdpbf16ps): y [M, N] = x [M, K] @ W [N, K]^T. x is laid out once
// per call in row tiles by the format (so that a tile's block of k is one contiguous run that stays in L1); W is
// rearranged a block of kKC x kNC at a time into a panel that stays in L2 while every row tile passes over it, and the
// format's micro-kernel keeps a kMR x kNR block of y in registers. Threads take (column block, row range) units in
// turn from a counter: each owns disjoint outputs, and a thread slowed by another job on a shared machine takes fewer
// units instead of holding the call up.
//
// A format F gives: X (x's packed element) and P (the panel's); kMR, kNR, kKC (even), kNC; x_at(t, K, k0), the offset
// of row tile t's block at k0 in the packed x; panel_at(j, kc), the offset of column j's tile in a panel of kc;
// panel_size(); pack_w(w, K, n0, nc, k0, kc, panel); tile(rows, xp, bp, kc, y, ldy, cols, add), add: y holds the
// sum over the earlier blocks of k.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "shares.h"

namespace deltaserve {

#if defined(__AVX512F__)
// r[i][j] -> r[j][i] for a 16 x 16 block: pairs of rows interleaved, then quads, then 128-bit lanes twice
inline void transpose16(__m512 r[16]) {
  __m512 t[16], s[16];
  for (int p = 0; p < 8; ++p) {
    t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // s[4c + q]: in each lane L, rows 4q .. 4q + 3 at column 4L + c
    s[q] = _mm512_shuffle_ps(t[4 * q], t[4 * q + 2], 0x44);
    s[4 + q] = _mm512_shuffle_ps(t[4 * q], t[4 * q + 2], 0xEE);
    s[8 + q] = _mm512_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0x44);
    s[12 + q] = _mm512_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512* sc = s + 4 * c;
    const __m512 x0 = _mm512_shuffle_f32x4(sc[0], sc[1], 0x88), x1 = _mm512_shuffle_f32x4(sc[0], sc[1], 0xDD);
    const __m512 x2 = _mm512_shuffle_f32x4(sc[2], sc[3], 0x88), x3 = _mm512_shuffle_f32x4(sc[2], sc[3], 0xDD);
    r[c] = _mm512_shuffle_f32x4(x0, x2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(x1, x3, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(x0, x2, 0xDD);
    r[12 + c] = _mm512_shuffle_f32x4(x1, x3, 0xDD);
  }
}
#endif

// one unit: columns n0 .. n0 + nc of y for row tiles t0 .. t1, k in blocks of kKC (the panel laid out once per block)
template <class F>
inline void panel_unit(const typename F::X* xp, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K,
                       int64_t n0, int64_t nc, int64_t t0, int64_t t1, typename F::P* bp) {
  for (int64_t k0 = 0; k0 < K; k0 += F::kKC) {
    const int64_t kc = std::min<int64_t>(F::kKC, K - k0);
    F::pack_w(w, K, n0, nc, k0, kc, bp);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rows = std::min<int64_t>(F::kMR, M - t * F::kMR);
      for (int64_t j = 0; j < nc; j += F::kNR)
        F::tile(rows, xp + F::x_at(t, K, k0), bp + F::panel_at(j, kc), kc, y + t * F::kMR * N + n0 + j, N,
                std::min<int64_t>(F::kNR, nc - j), k0 > 0);
    }
  }
}

// y [M, N] from x packed by F (M, N, K >= 1)
template <class F>
inline void panel_gemm(const typename F::X* xp, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (M + F::kMR - 1) / F::kMR, blocks = (N + F::kNC - 1) / F::kNC;
  const int64_t threads = at::get_num_threads();
  // few column blocks (a narrow W): their rows are split too, so that every thread has units to take
  const int64_t split = std::min(tiles, std::max<int64_t>(1, (4 * threads + blocks - 1) / blocks));
  const int64_t units = blocks * split;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    static thread_local std::vector<typename F::P> panel(F::panel_size());
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
      const int64_t b = u / split, s = u % split, n0 = b * F::kNC, nc = std::min<int64_t>(F::kNC, N - n0);
      const int64_t t0 = tiles * s / split, t1 = tiles * (s + 1) / split;
      const UnitClock clock(nc * (std::min(M, t1 * F::kMR) - t0 * F::kMR));
      panel_unit<F>(xp, w, y, M, N, K, n0, nc, t0, t1, panel.data());
    }
  });
}

}  // namespace deltaserve
