// The prefill GEMM of K-quant weights on AVX-512 VNNI: 16 weight rows at a time interleaved into a panel, so that
// one vpdpbusd multiplies 4 codes of each of the 16 rows by the same 4 int8 activations (broadcast) and sums them
// in its 16 int32 lanes, one lane per weight row. The per-16 scales then apply per lane (vpmulld, once per 16
// codes), the offsets by vpdpwssd on (offset, offset) pairs against (bsum, bsum) pairs, and the float scales once
// per block: per block and activation row, 64 vpdpbusd do 4096 multiply-adds, against 16 per 256 of the
// row-at-a-time dot (int8dot.h), which stays the kernel of decode, of other ISAs, and of the panel's edges. Where AMX
// runs (amx.h) the same Panels, their codes multiplied by their scales (WidePanel below), are the tiles' weights. A thread opens up to 8 weight tiles at a
// time and passes every group of activation rows over all of them, so the activations come from L1 / L2, not L3.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "amx.h"
#include "int8dot.h"
#include "int8gemv.h"

namespace deltaserve {
namespace kq {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kPanelGemm = true;

// one block of 16 weight rows, interleaved (rows past the matrix's end are zero: they add nothing)
struct alignas(64) Panel {
  uint8_t q[64][16][4];    // [codes / 4][row][4 codes]
  int32_t sc[16][16];      // [group of 16][row]
  int32_t off[8][16];      // [pair of groups][row]: the two int16 offsets of groups 2p, 2p + 1
  float d[16], o[16];
};

// the panels of weight rows n0 .. n0 + rows (rows <= 16), [nb]
inline void open_panels(const Segments& seg, const uint8_t* base, int64_t n0, int64_t rows, int64_t K,
                        WBlock* scratch, Panel* p) {
  const int64_t nb = K / 256;
  std::memset(static_cast<void*>(p), 0, sizeof(Panel) * nb);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = seg.find(n0 + r);
    open_row(seg.type(s), native_row(seg, base, s, n0 + r, K, row_scratch(K)), nb, scratch);
    for (int64_t b = 0; b < nb; ++b) {
      const WBlock& w = scratch[b];
      for (int c = 0; c < 64; ++c) std::memcpy(p[b].q[c][r], w.q + 4 * c, 4);
      for (int i = 0; i < 16; ++i) p[b].sc[i][r] = w.sc[i];
      for (int i = 0; i < 8; ++i)
        p[b].off[i][r] = static_cast<int32_t>(static_cast<uint16_t>(w.off[2 * i]) | (static_cast<uint32_t>(static_cast<uint16_t>(w.off[2 * i + 1])) << 16));
      p[b].d[r] = w.d;
      p[b].o[r] = w.o;
    }
  }
}

// y[m][0 .. 16) (stride ldy, `rows` lanes stored) = the panel's rows . activation rows m < MB (x: [nb][MB]). G: codes
// per scale, 16, or 32 where the type's scales are per 32 (Q4_K, Q5_K, IQ4_XS: sc[2i] = sc[2i + 1]), which halves the
// multiplies and adds by scales; integer sums, so either G gives the same bits.
template <int MB, int G>
inline void panel_rows(const Panel* p, const XBlock* x, int64_t nb, float* y, int64_t ldy, int64_t rows) {
  constexpr int kChunks = G / 4;  // vpdpbusd steps (4 codes a lane) per scale
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Panel& pb = p[b];
    const XBlock* xb = x + b * MB;
    __m512i blk[MB];
    for (int m = 0; m < MB; ++m) blk[m] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int i = 0; i < 256 / G; ++i) {  // a group of G codes: one scale per row
      __m512i sub[MB];
      for (int m = 0; m < MB; ++m) sub[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; ++c) {
        const __m512i codes = _mm512_load_si512(pb.q[kChunks * i + c]);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) sub[m] = dot4(sub[m], codes, xb[m].q + 4 * (kChunks * i + c));
      }
      const __m512i sc = _mm512_load_si512(pb.sc[i * G / 16]);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) blk[m] = _mm512_add_epi32(blk[m], _mm512_mullo_epi32(sub[m], sc));
    }
    const __m512 d = _mm512_load_ps(pb.d), o = _mm512_load_ps(pb.o);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      __m512i off = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) {
        int32_t pair;
        std::memcpy(&pair, xb[m].bs + 2 * i, 4);
        off = _mm512_dpwssd_epi32(off, _mm512_load_si512(pb.off[i]), _mm512_set1_epi32(pair));
      }
      const __m512 dx = _mm512_set1_ps(xb[m].d);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(blk[m]), _mm512_mul_ps(d, dx), acc[m]);
      acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off), _mm512_mul_ps(o, dx), acc[m]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy, keep, acc[m]);
}

template <int G>
inline void panel_group(int64_t mb, const Panel* p, const XBlock* x, int64_t nb, float* y, int64_t ldy, int64_t rows) {
  using Fn = void (*)(const Panel*, const XBlock*, int64_t, float*, int64_t, int64_t);
  static constexpr Fn by_rows[8] = {panel_rows<1, G>, panel_rows<2, G>, panel_rows<3, G>, panel_rows<4, G>,
                                    panel_rows<5, G>, panel_rows<6, G>, panel_rows<7, G>, panel_rows<8, G>};
  by_rows[std::min<int64_t>(mb, 8) - 1](p, x, nb, y, ldy, rows);
}

// the bias a panel type's offsets stand for (0: they are mins, at dmin): the AMX path folds it into the
// weights
inline int panel_bias(int64_t type) { return type == Q6_K ? 32 : type == IQ4_XS ? 128 : type == Q3_K ? 4 : 0; }

#if defined(DELTASERVE_AMX)
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
  int32_t mins[4][16];  // per-32 types with mins (Q4_K, Q5_K): [pair of 32-code groups][row], the two int16 mins
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
  for (int i = 0; i < 4; ++i)  // Panel::off[k] of a per-32 type: (min k, min k)
    _mm512_store_si512(w.mins[i], _mm512_ternarylogic_epi32(_mm512_load_si512(p.off[2 * i]), low16,
                                                            _mm512_slli_epi32(_mm512_load_si512(p.off[2 * i + 1]), 16), 0xEA));
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
  auto products = [&](int64_t b) {
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
  auto scale = [&](int64_t b) {
    const Panel& pb = p[b];
    int32_t(*s)[16][16] = sums[b & 1];
    const __m512 d = _mm512_load_ps(pb.d), o = _mm512_load_ps(pb.o);
    for (int m = 0; m < tiled_rows; ++m) {
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
          off = _mm512_dpwssd_epi32(off, _mm512_load_si512(Mins == 32 ? w[b].mins[i] : pb.off[i]), _mm512_set1_epi32(pair));
        }
        acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off), _mm512_mul_ps(o, dx), acc);
      }
      _mm512_store_ps(out[m], acc);
    }
  };
  for (int64_t b = 0; b < nb; ++b) {
    products(b);
    if (b > 0) scale(b - 1);
    store(b);
  }
  scale(nb - 1);
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

// the Panel of block b of a Q2_K (q3 false) or Q3_K row panel: codes 2 bits (Q3_K: | the hmask bit at 2), scales,
// and the offsets: Q3_K's 4 at the block's scale, Q2_K's mins at dmin
inline void open_q23k_panel(bool q3, const uint8_t* panel, int64_t nb, int64_t b, Panel& out) {
  const uint8_t* p = panel + panel_head(q3 ? Q3_K : Q2_K, nb) + b * (q3 ? kQ3Block : kQ2Block);
  const __m512i m3 = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
  for (int n = 0; n < 2; ++n)
    for (int l4 = 0; l4 < 8; ++l4) {
      const __m512i qs = _mm512_loadu_si512(p + (q3 ? kQ3Codes : kQ2Codes) + (8 * n + l4) * 64);
      const __m512i hm = q3 ? _mm512_loadu_si512(p + kQ3High + l4 * 64) : _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) {  // elements 32g + 4 l4 .. + 3, g = 4n + k: bits 2k of qs (Q3_K: bit g of hm at 2)
        const int g = 4 * n + k;
        const __m512i low = _mm512_and_si512(_mm512_srli_epi16(qs, 2 * k), m3);
        _mm512_store_si512(out.q[8 * g + l4], _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(hm, _mm512_set1_epi8(static_cast<char>(1 << g))), low, four));
      }
    }
  for (int r = 0; r < 16; ++r) {
    uint8_t bytes[16];  // the row's scale bytes
    for (int u = 0; u < (q3 ? 3 : 4); ++u) std::memcpy(bytes + 4 * u, p + 64 * u + 4 * r, 4);
    int16_t off[16];  // Q3_K: the codes' offset of 4 at the block's scale; Q2_K: the mins at dmin
    for (int i = 0; i < 16; ++i) {
      out.sc[i][r] = q3 ? q3k_scale(bytes, i) : bytes[i] & 0xF;
      off[i] = static_cast<int16_t>(q3 ? 4 * out.sc[i][r] : bytes[i] >> 4);
    }
    for (int i = 0; i < 8; ++i)
      out.off[i][r] = static_cast<int32_t>(static_cast<uint16_t>(off[2 * i]) | static_cast<uint32_t>(static_cast<uint16_t>(off[2 * i + 1])) << 16);
    out.d[r] = half(q3 ? panel + 32 * b + 2 * r : p + kQ2D + 2 * r);
    out.o[r] = q3 ? out.d[r] : half(p + kQ2Dmin + 2 * r);
  }
}

// The Panel of one block of a row panel (panels.h): codes unpacked into element order, scales and offsets of the
// 16 rows widened, straight from the panel's runs (no row is rebuilt).
inline void open_row_panel(int64_t type, const uint8_t* panel, int64_t nb, int64_t b, Panel& out) {
  const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30), bit4 = _mm512_set1_epi8(0x10);
  auto put = [&](int c, __m512i v) { _mm512_store_si512(out.q[c], v); };
  uint8_t words[16][12];  // Q4_K / Q5_K: each row's 12 scale bytes
  if (type == IQ4_XS) {
    const uint8_t* p = panel + b * (kIQ4Codes + 2048);
    alignas(16) uint8_t levels[16];
    for (int i = 0; i < 16; ++i) levels[i] = static_cast<uint8_t>(kIQ4Levels[i] + 128);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(levels)));
    for (int ib = 0; ib < 8; ++ib)
      for (int l4 = 0; l4 < 4; ++l4) {
        const __m512i v = _mm512_loadu_si512(p + kIQ4Codes + (ib * 4 + l4) * 64);
        put(8 * ib + l4, _mm512_shuffle_epi8(lut, _mm512_and_si512(v, m4)));
        put(8 * ib + 4 + l4, _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4)));
      }
    for (int r = 0; r < 16; ++r) {
      uint8_t native[8];  // d | scales_h | scales_l of row r
      std::memcpy(native, p + kIQ4D + 2 * r, 2);
      std::memcpy(native + 2, p + kIQ4High + 2 * r, 2);
      std::memcpy(native + 4, p + kIQ4Low + 4 * r, 4);
      for (int ib = 0; ib < 8; ++ib) {
        const int sc = iq4xs_scale(native, ib);
        out.sc[2 * ib][r] = out.sc[2 * ib + 1][r] = sc;
        out.off[ib][r] = static_cast<int32_t>(static_cast<uint16_t>(128 * sc) | static_cast<uint32_t>(static_cast<uint16_t>(128 * sc)) << 16);
      }
      out.d[r] = out.o[r] = half(native);
    }
    return;
  }
  if (type == Q2_K || type == Q3_K) return open_q23k_panel(type == Q3_K, panel, nb, b, out);
  if (type == Q6_K) {
    const uint8_t* p = panel + panel_head(Q6_K, nb) + b * 3328;
    for (int n = 0; n < 2; ++n)
      for (int l4 = 0; l4 < 8; ++l4) {
        const uint8_t* run = p + (2 * n + l4 / 4) * 832 + (l4 % 4) * 192;  // panels.h's Q6_K order
        const __m512i a = _mm512_loadu_si512(run), c = _mm512_loadu_si512(run + 64), h = _mm512_loadu_si512(run + 128);
        put(32 * n + l4, _mm512_ternarylogic_epi32(a, m4, _mm512_and_si512(_mm512_slli_epi16(h, 4), m30), 0xEA));
        put(32 * n + 8 + l4, _mm512_ternarylogic_epi32(c, m4, _mm512_and_si512(_mm512_slli_epi16(h, 2), m30), 0xEA));
        put(32 * n + 16 + l4, _mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 4), m4, _mm512_and_si512(h, m30), 0xEA));
        put(32 * n + 24 + l4, _mm512_ternarylogic_epi32(_mm512_srli_epi16(c, 4), m4, _mm512_and_si512(_mm512_srli_epi16(h, 2), m30), 0xEA));
      }
    for (int r = 0; r < 16; ++r) {
      for (int i = 0; i < 16; ++i) out.sc[i][r] = static_cast<int8_t>(p[(2 * (i / 8) + i % 2) * 832 + 768 + 16 * ((i % 8) / 2) + r]);
      for (int i = 0; i < 8; ++i)
        out.off[i][r] = static_cast<int32_t>(static_cast<uint16_t>(32 * out.sc[2 * i][r]) | static_cast<uint32_t>(static_cast<uint16_t>(32 * out.sc[2 * i + 1][r])) << 16);
      out.d[r] = out.o[r] = half(panel + 32 * b + 2 * r);
    }
    return;
  }
  const bool q5 = type == Q5_K;
  const uint8_t* p = panel + b * (k4_codes(q5) + 2048);
  for (int j = 0; j < 4; ++j)
    for (int l4 = 0; l4 < 8; ++l4) {
      const __m512i v = _mm512_loadu_si512(p + k4_codes(q5) + (j * 8 + l4) * 64);
      __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      if (q5) {  // bit 2j (2j + 1) of the high-bit bytes: each bit shifted down to 0, then up to 4
        const __m512i h = _mm512_loadu_si512(p + kQ5High + l4 * 64);
        lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(_mm512_srli_epi16(h, 2 * j), 4), bit4));
        hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi16(_mm512_srli_epi16(h, 2 * j + 1), 4), bit4));
      }
      put(16 * j + l4, lo);
      put(16 * j + 8 + l4, hi);
    }
  for (int r = 0; r < 16; ++r) {
    for (int u = 0; u < 3; ++u) std::memcpy(words[r] + 4 * u, p + kK4Scales + 64 * u + 4 * r, 4);
    uint8_t sc[8], mn[8];
    k4_scales(words[r], sc, mn);
    for (int i = 0; i < 16; ++i) out.sc[i][r] = sc[i / 2];
    for (int i = 0; i < 8; ++i) out.off[i][r] = static_cast<int32_t>(mn[i] | static_cast<uint32_t>(mn[i]) << 16);
    out.d[r] = half(p + kK4D + 2 * r);
    out.o[r] = half(p + kK4Dmin + 2 * r);
  }
}

// y [M, N] = xq (quantize_rows of x [M, K]) @ W^T, threads over tiles of up to 16 weight rows of one segment (its
// row panels, then its other rows 16 at a time), each opened into Panels once (a segment of 32-weight blocks': into
// a q8::Tile32, multiplied by x rounded per 32, x8) and run over every group of activation rows.
inline void gemm_panels(const Segments& seg, const uint8_t* base, const XBlock* xq, const q8::Q8Acts& x8, int64_t M,
                        int64_t K, float* y) {
  const int64_t nb = K / 256, N = seg.rows;
  struct Tile {
    int64_t s, n0, rows;
    bool panel;
  };
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < seg.S; ++s) {
    const int64_t pend = seg.first(s) + seg.panel_rows(s);
    for (int64_t n = seg.first(s); n < pend; n += kPanel) tiles.push_back({s, n, kPanel, true});
    for (int64_t n = pend; n < seg.end(s); n += kPanel) tiles.push_back({s, n, std::min(kPanel, seg.end(s) - n), false});
  }
#if defined(DELTASERVE_AMX)
  const bool tiled = amx::enabled();
  const std::vector<int8_t> codes = tiled ? amx_codes(xq, M, K) : std::vector<int8_t>{};
#endif
  constexpr size_t kOpen = 8;  // weight tiles opened at a time: each group of activation rows passes over all of them
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<WBlock> scratch(nb);
    std::vector<Panel> panels(kOpen * nb);
#if defined(DELTASERVE_AMX)
    std::vector<WidePanel> wide(tiled ? kOpen * nb : 0);
#endif
    q8::Tile32 tile32[q8::kQ8AmxTiles];
    int n32 = 0;  // (AMX) tiles opened in tile32 and not yet run: adjacent columns from first32, the last `last32` wide
    int64_t first32 = 0, last32 = 0;
    auto run32 = [&] {
#if defined(DELTASERVE_AMX)
      const q8::Tile32* const t[q8::kQ8AmxTiles] = {&tile32[0], &tile32[1], &tile32[2], &tile32[3]};
      if (n32) q8::run_amx(t, n32, x8, y + first32, N, last32);
#endif
      n32 = 0;
    };
    std::vector<std::pair<int64_t, int64_t>> open;  // the opened tiles' (first column, columns), all of one kind:
    bool per32 = false, mins = false;  // scales per 32 (Q4_K, Q5_K, IQ4_XS; else 16), offsets at dmin (Q2_K, Q4_K, Q5_K)
    auto run = [&] {
#if defined(DELTASERVE_AMX)
      if (tiled && !open.empty())
        amx_group(panels.data(), wide.data(), mins ? (per32 ? 32 : 16) : 0, open, codes.data(), xq, M, K, y, N);
      else
#endif
        for (int64_t g = 0; g < M; g += kRows)
          for (size_t j = 0; j < open.size(); ++j)
            (per32 ? panel_group<32> : panel_group<16>)(std::min<int64_t>(kRows, M - g), panels.data() + j * nb,
                                                        xq + g * nb, nb, y + g * N + open[j].first, N, open[j].second);
      open.clear();
    };
    for (int64_t t = lo; t < hi; ++t) {
      const Tile& tile = tiles[t];
      const int64_t type = seg.type(tile.s);
      if (q8::block32(type)) {
        const uint8_t* rows = seg.row(base, tile.s, tile.n0, K);
        const int64_t row_bytes = K / 32 * layout(type).bytes;
#if defined(DELTASERVE_AMX)
        if (tiled) {  // 4 adjacent tiles at a time: one tile per activation load measured slower than the registers
          // (a short tile ends a group: the next segment's rows may start 16 after it, past other types' rows)
          if (n32 && (n32 == q8::kQ8AmxTiles || last32 != 16 || tile.n0 != first32 + 16 * n32)) run32();
          if (!n32) first32 = tile.n0;
          tile32[n32++].open(type, rows, row_bytes, tile.rows, K);
          last32 = tile.rows;
          continue;
        }
#endif
        tile32[0].open(type, rows, row_bytes, tile.rows, K);
        tile32[0].run(x8, y + tile.n0, N, tile.rows);
        continue;
      }
      const bool tile32s = type == Q4_K || type == Q5_K || type == IQ4_XS, tile_mins = panel_bias(type) == 0;
      if (!open.empty() && (tile32s != per32 || tile_mins != mins || open.size() == kOpen)) run();
      per32 = tile32s;
      mins = tile_mins;
      Panel* p = panels.data() + open.size() * nb;
      if (tile.panel)
        for (int64_t b = 0; b < nb; ++b) open_row_panel(type, seg.row(base, tile.s, tile.n0, K), nb, b, p[b]);
      else
        open_panels(seg, base, tile.n0, tile.rows, K, scratch.data(), p);
#if defined(DELTASERVE_AMX)
      if (tiled)
        for (int64_t b = 0; b < nb; ++b) widen_panel(p[b], panel_bias(type), wide[open.size() * nb + b]);
#endif
      open.emplace_back(tile.n0, tile.rows);
    }
    run();
    run32();
  });
}
#else
constexpr bool kPanelGemm = false;
inline void gemm_panels(const Segments&, const uint8_t*, const XBlock*, const q8::Q8Acts&, int64_t, int64_t, float*) {}
#endif

// which instructions the integer kernels of this build use (the benchmark prints it)
inline std::string int8_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return std::string(amx::enabled() ? "AMX tiles (tdpbsud) for K-quant and Q8_0 prefill, " : "") +
         "AVX-512 VNNI: vpdpbusd on 16-row panels, decode straight from the row panels held at load";
#elif defined(__AVX512BW__)
  return "AVX-512 BW: decode from 16-row panels, vpmaddubsw + vpmaddwd";
#elif defined(__AVXVNNI__)
  return "AVX2 + AVX-VNNI: vpmaddubsw + vpdpwssd";
#elif defined(__AVX2__)
  return "AVX2: vpmaddubsw + vpmaddwd";
#else
  return "portable C++";
#endif
}

// y [M, N] = x [M, K] (float32, rounded here to Q8_K for K-quant / IQ4_XS rows, to Q8_0 for rows of 32-weight blocks)
// @ W^T, W packed blocks (segment table as for linear_packed). Prefill on AVX-512 VNNI: the panels above. Otherwise threads split the output columns into
// tiles of weight rows (one for decode, opened into L1 and used at once; 16 above, opened into a per-thread
// buffer that stays in L2) multiplied by every group of rows of x.
inline void linear_int8(torch::Tensor x, torch::Tensor bytes, torch::Tensor table, torch::Tensor y) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be float32 [M, K] contiguous");
  TORCH_CHECK(bytes.dtype() == torch::kUInt8 && bytes.is_contiguous(), "packed bytes must be contiguous uint8");
  const int64_t M = x.size(0), K = x.size(1), nb = K / 256;
  const Segments seg(table, K, bytes.numel());
  const int64_t N = seg.rows;
  TORCH_CHECK(y.dtype() == torch::kFloat32 && y.is_contiguous() && y.size(0) == M && y.size(1) == N, "y must be float32 [M, N]");
  bool per32 = false, per256 = false;  // which roundings of x the segments read
  for (int64_t s = 0; s < seg.S; ++s) {
    TORCH_CHECK(int8_type(seg.type(s)), "linear_int8: GGML type ", seg.type(s), " has no integer kernel");
    (q8::block32(seg.type(s)) ? per32 : per256) = true;
  }
  // decode (a step makes ~70 of these calls) reuses its thread's buffers; a prefill's are its own, freed after
  static thread_local std::vector<XBlock> decode_buf;
  std::vector<XBlock> prefill_buf;
  std::vector<XBlock>& xbuf = M <= kRows ? decode_buf : prefill_buf;
  if (xbuf.size() < static_cast<size_t>(M * nb)) xbuf.resize(M * nb);
  const XBlock* xq = xbuf.data();
  if (per256) quantize_rows(x.data_ptr<float>(), M, K, xbuf.data());
  static thread_local q8::Q8Acts decode_x8;  // x rounded per 32, for rows of 32-weight blocks
  q8::Q8Acts prefill_x8;
  q8::Q8Acts& x8 = M <= kRows ? decode_x8 : prefill_x8;
  if (per32) x8.quantize(x.data_ptr<float>(), M, K);
  const uint8_t* base = bytes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (kPanelGemm && M > kRows) return gemm_panels(seg, base, xq, x8, M, K, yp);
  if (kDirectGemv && M <= kRows) return gemv_direct(seg, base, xq, x8, M, K, yp);
  const int64_t tile = M <= kRows ? 1 : 16;  // one row: opened into L1 and used at once (decode)
  at::parallel_for(0, (N + tile - 1) / tile, 1, [&](int64_t lo, int64_t hi) {
    std::vector<WBlock> w(tile * nb);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t s = seg.find(n0 + r);
        open_row(seg.type(s), native_row(seg, base, s, n0 + r, K, row_scratch(K)), nb, w.data() + r * nb);
      }
      for (int64_t g = 0; g < M; g += kRows) {
        const int64_t mb = std::min<int64_t>(kRows, M - g);
        for (int64_t r = 0; r < rows; ++r) {
          float sums[kRows];
          dot_group(mb, w.data() + r * nb, xq + g * nb, nb, sums);
          for (int64_t m = 0; m < mb; ++m) yp[(g + m) * N + n0 + r] = sums[m];
        }
      }
    }
  });
}

}  // namespace kq
}  // namespace deltaserve
