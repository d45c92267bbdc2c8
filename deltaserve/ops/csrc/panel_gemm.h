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
// panel_size(); kColumnsOuter (the order of the tiles: panel_unit); pack_w(w, K, n0, nc, k0, kc, panel); tile(rows, xp,
// bp, kc, y, ldy, cols, add), add: y holds the sum over the earlier blocks of k; Scope, held by each thread while it
// takes units.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
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

// y[i][0 .. cols) (+)= c[i] for a micro-kernel's MR x (16 NV) block of float32 sums (add: y holds earlier blocks' sums)
template <int MR, int NV>
inline void store_tile(const __m512 (&c)[MR][NV], float* y, int64_t ldy, int64_t cols, bool add) {
  for (int v = 0; v < NV; ++v) {
    const int64_t n = std::clamp<int64_t>(cols - 16 * v, 0, 16);
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
    for (int i = 0; i < MR; ++i) {
      float* yr = y + i * ldy + 16 * v;
      _mm512_mask_storeu_ps(yr, m, add ? _mm512_add_ps(c[i][v], _mm512_maskz_loadu_ps(m, yr)) : c[i][v]);
    }
  }
}
#endif

#if defined(__AVX512BW__)
// W rows n0 .. n0 + nc, columns k0 .. k0 + kc, as pairs of k (the layout vdpbf16ps and tdpbf16ps multiply): groups of
// 16 rows [groups / NV][kcp / 2][16 NV][2], so group g starts at (g / NV) kcp 16 NV + (g % NV) 32 and its pair p lies
// 32 NV values further on per p, row r's pair at 32-bit lane r. Pairs up to kcp / 2 (>= kc / 2) and rows past nc are
// zero. 16 rows x 16 pairs at a time, transposed as 32-bit values.
template <int NV>
inline void pack_pairs(const uint16_t* w, int64_t K, int64_t n0, int64_t nc, int64_t k0, int64_t kc, int64_t kcp,
                       int64_t groups, uint16_t* bp) {
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t* out = bp + (g / NV) * kcp * 16 * NV + (g % NV) * 32;
    const int64_t rows = std::clamp<int64_t>(nc - 16 * g, 0, 16);
    const uint16_t* wr = w + (n0 + 16 * g) * K + k0;
    for (int64_t k = 0; k < kcp; k += 32) {
      const int64_t kn = std::clamp<int64_t>(kc - k, 0, 32);
      const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << kn) - 1);
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(m, wr + i * K + k)) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t j = 0; j < std::min<int64_t>(16, (kcp - k) / 2); ++j)
        _mm512_storeu_ps(reinterpret_cast<float*>(out + (k / 2 + j) * 32 * NV), r[j]);
    }
  }
}
#endif

// a format's Scope for the threads of a call where it needs none (AMX formats: the tiles configured)
struct NoTiles {};

// one unit: columns n0 .. n0 + nc of y for row tiles t0 .. t1, k in blocks of kKC (the panel laid out once per block).
// Formats with kColumnsOuter pass every row tile over one column tile's panel at a time (kKC x kNR values, sized to
// stay in L1 between its loads) and build the sums up in acc [t1 - t0][kMR][kNC], each row tile's contiguous, which
// reach y once at the end: y's rows lie N floats apart, and where N is a multiple of 1024 a tile's rows and the next
// tiles' fall in the same few L1 sets and evict the panel at every block of k. The others (AMX: a tile's 16 rows of x
// are loaded once for every column tile) pass a row tile over every column tile, straight into y. On the AMX Xeon the
// float16 GEMM took kColumnsOuter from 1.01-1.11x its rate before (512 x 1024 x 3584: 248 -> 269 GFLOP/s), the 0.8B
// F16 file's prefill 512 / 2048 1.04x / 1.08x; neither the AMX tiles nor the vdpbf16ps ones gained.
template <class F>
inline void panel_unit(const typename F::X* xp, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K,
                       int64_t n0, int64_t nc, int64_t t0, int64_t t1, typename F::P* bp, float* acc) {
  auto tile = [&](int64_t t, int64_t j, int64_t k0, int64_t kc, float* out, int64_t ld) {
    F::tile(std::min<int64_t>(F::kMR, M - t * F::kMR), xp + F::x_at(t, K, k0), bp + F::panel_at(j, kc), kc, out, ld,
            std::min<int64_t>(F::kNR, nc - j), k0 > 0);
  };
  for (int64_t k0 = 0; k0 < K; k0 += F::kKC) {
    const int64_t kc = std::min<int64_t>(F::kKC, K - k0);
    F::pack_w(w, K, n0, nc, k0, kc, bp);
    if constexpr (F::kColumnsOuter) {
      for (int64_t j = 0; j < nc; j += F::kNR)
        for (int64_t t = t0; t < t1; ++t) tile(t, j, k0, kc, acc + (t - t0) * F::kMR * F::kNC + j, F::kNC);
    } else {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t j = 0; j < nc; j += F::kNR) tile(t, j, k0, kc, y + t * F::kMR * N + n0 + j, N);
    }
  }
  if constexpr (F::kColumnsOuter)
    for (int64_t m = t0 * F::kMR; m < std::min(M, t1 * F::kMR); ++m)
      std::memcpy(y + m * N + n0, acc + (m - t0 * F::kMR) * F::kNC, nc * sizeof(float));
}

// y [M, N] from x packed by F (M, N, K >= 1)
template <class F>
inline void panel_gemm(const typename F::X* xp, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t kMaxTiles = 512 / F::kMR + 1;  // a unit's row tiles at most where it sums in acc (0.5 MB)
  const int64_t tiles = (M + F::kMR - 1) / F::kMR, blocks = (N + F::kNC - 1) / F::kNC;
  const int64_t threads = at::get_num_threads();
  // few column blocks (a narrow W): their rows are split too, so that every thread has units to take
  const int64_t split = std::min(tiles, std::max({int64_t{1}, (4 * threads + blocks - 1) / blocks,
                                                  F::kColumnsOuter ? (tiles + kMaxTiles - 1) / kMaxTiles : 1}));
  const int64_t units = blocks * split;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    static thread_local std::vector<typename F::P> panel(F::panel_size());
    static thread_local std::vector<float> acc(F::kColumnsOuter ? kMaxTiles * F::kMR * F::kNC : 0);
    const typename F::Scope scope{};
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
      const int64_t b = u / split, s = u % split, n0 = b * F::kNC, nc = std::min<int64_t>(F::kNC, N - n0);
      const int64_t t0 = tiles * s / split, t1 = tiles * (s + 1) / split;
      const UnitClock clock(nc * (std::min(M, t1 * F::kMR) - t0 * F::kMR));
      panel_unit<F>(xp, w, y, M, N, K, n0, nc, t0, t1, panel.data(), acc.data());
    }
  });
}

}  // namespace deltaserve
