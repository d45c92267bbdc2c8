// The prefill GEMM of K-quant and IQ4_XS weights on AMX tiles (amx.h), from the Panels int8panel.h opens; the
// registers' path is int8gemm.h's panel_rows, which gemm_panels runs where the tiles do not.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "amx.h"
#include "int8dot.h"
#include "int8panel.h"

namespace deltaserve {
namespace kq {

#if defined(DELTASERVE_AMX) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Prefill on AMX tiles where they run (amx.h). tdpbsud / tdpbssd sum 64 products a lane, but a K-quant's scales change
// every 16 or 32 codes, and taking each group's sums out of a tile to scale them cost more than the products. So a
// Panel is widened once per call into its codes times their scales, w = (q - bias) x sc, split into bytes: lo = w &
// 0xFF (unsigned: tdpbsud) and hi = w >> 8 (signed: tdpbssd); |w| < 2^13 for every panel type. The bias is the offset
// Q3_K (4), Q6_K (32) and IQ4_XS (128: level + 128) take at the block's own scale, so only Q2_K, Q4_K and Q5_K keep
// offsets (their mins, at dmin). A block of 16 activation rows x 16 weight rows is then 4 + 4 tile products into two sums,
// lo + 256 hi: the int32 sum panel_rows reaches (less the folded offsets), so the two paths give the same bits where
// there are mins and differ by one float rounding fewer here where they are folded. Against the group-by-group tiles
// before: Q4_K 970 -> 1,041 GOP/s, Q6_K 772 -> 1,120 on two Xeon cores (256 x 1024 x 1024).
struct alignas(64) WidePanel {
  uint8_t lo[64][16][4];  // as Panel::q: [codes / 4][row][4 codes], a tdpbsud weight tile per 64 codes
  int8_t hi[64][16][4];
};

inline void widen_panel(const Panel& p, int bias, WidePanel& w) {
  const __m512i m00ff = _mm512_set1_epi16(0xFF), low16 = _mm512_set1_epi32(0xFFFF), b16 = _mm512_set1_epi16(bias);
  for (int c = 0; c < 64; ++c) {  // 4 codes of each of the 16 rows; their scale is group c / 4 of 16
    const __m512i v = _mm512_load_si512(p.q[c]), sc = _mm512_load_si512(p.sc[c / 4]);
    const __m512i sc16 = _mm512_ternarylogic_epi32(sc, low16, _mm512_slli_epi32(sc, 16), 0xEA);  // in both words
    const __m512i even = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_and_si512(v, m00ff), b16), sc16);  // codes 0, 2
    const __m512i odd = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_srli_epi16(v, 8), b16), sc16);      // codes 1, 3
    _mm512_store_si512(w.lo[c], _mm512_ternarylogic_epi32(even, m00ff, _mm512_slli_epi16(odd, 8), 0xEA));
    _mm512_store_si512(w.hi[c], _mm512_ternarylogic_epi32(_mm512_srli_epi16(even, 8), m00ff, odd, 0xE2));
  }
}

// bytes between rows of x's codes: K and a cache line, so that a tile's 16 rows K = 2^n apart do not all fall in a few
// L1 sets
inline int64_t amx_lda(int64_t K) { return K + 64; }

// x's codes as rows amx_lda(K) bytes apart, round16(M) of them (the last ones zero): tdpbsud's tiles of 16 rows
inline std::vector<int8_t> amx_codes(const XBlock* xq, int64_t M, int64_t K) {
  const int64_t nb = K / 256, Mp = (M + 15) / 16 * 16, lda = amx_lda(K);
  std::vector<int8_t> codes(Mp * lda, 0);
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m)
      for (int64_t b = 0; b < nb; ++b) std::memcpy(&codes[m * lda + 256 * b], xq[xblock_at(M, nb, m, b)].q, 256);
  });
  return codes;
}

// y rows m0 .. m0 + mr (mr <= 32, ldy apart; `rows` columns stored) = the weight tile (Panels p, widened w: [nb]) . x:
// two tiles of 16 activation rows share each weight tile loaded (the weights come from L2, the activations from L1).
// Mins: 0 (offsets folded into w), 32 (mins per 32 codes: Q4_K, Q5_K), 16 (per 16: Q2_K). Block b's tile products
// are issued before block b - 1's sums (in the other of two buffers) are scaled: 3-8% faster than in turn.
template <int Mins>
inline void amx_rows(const Panel* p, const WidePanel* w, const int8_t* codes, const XBlock* xq, int64_t M, int64_t K,
                     int64_t m0, int64_t mr, float* y, int64_t ldy, int64_t rows) {
  const int64_t nb = K / 256, lda = amx_lda(K);
  alignas(64) int32_t sums[2][4][16][16];  // by block parity: lo, hi of the first 16 rows; lo, hi of the second
  alignas(64) float out[32][16] = {};
  static const XBlock none{};  // the rows past mr: zero sums, zero scale
  const bool two = mr > 16;
  const int tiled_rows = two ? 32 : 16;
  const XBlock* first[32];  // row m's block b is first[m] + b * step[m] (xblock_at's groups of kRows rows)
  int64_t step[32];
  for (int m = 0; m < tiled_rows; ++m) {
    first[m] = m < mr ? xq + xblock_at(M, nb, m0 + m, 0) : &none;
    step[m] = m < mr ? std::min<int64_t>(kRows, M - (m0 + m) / kRows * kRows) : 0;
  }
  const int8_t* a = codes + m0 * lda;
  // block b's products, with `between(k)` run after each step of 64 codes (the scaling of the block before: see below)
  auto products = [&](int64_t b, auto&& between) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < 4; ++k) {  // 64 codes a step
      _tile_loadd(6, w[b].lo[16 * k], 64);
      _tile_loadd(7, w[b].hi[16 * k], 64);
      _tile_loadd(4, a + 256 * b + 64 * k, lda);
      _tile_dpbsud(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      if (two) {
        _tile_loadd(5, a + 16 * lda + 256 * b + 64 * k, lda);
        _tile_dpbsud(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
      between(k);
    }
  };
  auto store = [&](int64_t b) {
    int32_t(*s)[16][16] = sums[b & 1];
    _tile_stored(0, s[0], 64);
    _tile_stored(1, s[1], 64);
    if (two) {
      _tile_stored(2, s[2], 64);
      _tile_stored(3, s[3], 64);
    }
  };
  auto scale = [&](int64_t b, int m_lo, int m_hi) {  // block b's sums of rows m_lo .. m_hi, into out
    const Panel& pb = p[b];
    int32_t(*s)[16][16] = sums[b & 1];
    const __m512 d = _mm512_load_ps(pb.d), o = _mm512_load_ps(pb.o);
    for (int m = m_lo; m < m_hi; ++m) {
      const XBlock& xb = first[m][b * step[m]];
      const int t = 2 * (m / 16), r = m % 16;
      const __m512i sum = _mm512_add_epi32(_mm512_load_si512(s[t][r]), _mm512_slli_epi32(_mm512_load_si512(s[t + 1][r]), 8));
      const __m512 dx = _mm512_set1_ps(xb.d);
      __m512 acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, dx), _mm512_load_ps(out[m]));
      if constexpr (Mins != 0) {
        __m512i off = _mm512_setzero_si512();
        for (int i = 0; i < 128 / Mins; ++i) {  // int16 pairs of mins times pairs of the activations' sums
          int32_t pair;
          std::memcpy(&pair, Mins == 32 ? xb.bs32 + 2 * i : xb.bs + 2 * i, 4);
          off = _mm512_dpwssd_epi32(off, _mm512_load_si512(pb.off[i]), _mm512_set1_epi32(pair));
        }
        acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off), _mm512_mul_ps(o, dx), acc);
      }
      _mm512_store_ps(out[m], acc);
    }
  };
  // Block b - 1's sums are scaled a quarter of the rows after each of block b's 4 steps. Scaled after all 4, the two
  // barely overlapped (the times with each switched off added up to the whole: likely the scaling's ~800
  // instructions filled the reorder buffer behind the unfinished products). Calls alternating in one process, Q4_K /
  // Q6_K / IQ4_XS: 1.05-1.11x at 256 x 1024 x 1024 and 512 x 1024 x 3584, unchanged at 512 x 6144 x 1024
  const int quarter = tiled_rows / 4;
  for (int64_t b = 0; b < nb; ++b) {
    products(b, [&](int k) {
      if (b > 0) scale(b - 1, k * quarter, (k + 1) * quarter);
    });
    store(b);
  }
  scale(nb - 1, 0, tiled_rows);
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  for (int64_t m = 0; m < mr; ++m) _mm512_mask_storeu_ps(y + m * ldy, keep, _mm512_load_ps(out[m]));
}

// every 32 activation rows times each opened weight tile (tile j's Panels at p + j nb, widened at w + j nb, its
// outputs at columns cols[j].first, cols[j].second of them): a row tile's codes stay in L1 while it passes over them
inline void amx_group(const Panel* p, const WidePanel* w, int mins, const std::vector<std::pair<int64_t, int64_t>>& cols,
                      const int8_t* codes, const XBlock* xq, int64_t M, int64_t K, float* y, int64_t ldy) {
  const amx::Scope tiles;  // all 16 rows x 64 bytes
  for (int64_t m0 = 0; m0 < M; m0 += 32)
    for (size_t j = 0; j < cols.size(); ++j)
      (mins == 32 ? amx_rows<32> : mins == 16 ? amx_rows<16> : amx_rows<0>)(p + j * (K / 256), w + j * (K / 256), codes, xq, M, K, m0,
                                                 std::min<int64_t>(32, M - m0), y + m0 * ldy + cols[j].first, ldy,
                                                 cols[j].second);
}
#endif

}  // namespace kq
}  // namespace deltaserve
