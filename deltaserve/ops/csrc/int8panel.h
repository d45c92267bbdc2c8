// A K-quant (or IQ4_XS) block of 16 weight rows opened for the prefill GEMMs (int8gemm.h on the registers,
// int8gemm_amx.h on AMX tiles): the codes interleaved 4 at a time per row, so that one vpdpbusd multiplies 4 codes of
// each of the 16 rows by the same 4 int8 activations, and the rows' scales, offsets and float scales beside them.
// Opened from a row panel (panels.h) straight from its runs, or from 16 rows as the file holds them.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int8dot.h"
#include "kquants.h"
#include "panels.h"

namespace deltaserve {
namespace kq {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// one block of 16 weight rows, interleaved (rows past the matrix's end are zero: they add nothing)
struct alignas(64) Panel {
  uint8_t q[64][16][4];    // [codes / 4][row][4 codes]
  int32_t sc[16][16];      // [group of 16][row]
  int32_t off[8][16];      // [pair][row]: two int16 offsets, of groups 2p and 2p + 1 of 16 codes, or where the
                           // scales are per 32 (per32) of groups 2p and 2p + 1 of 32 (p < 4, the rest zero)
  float d[16], o[16];
};

// the types whose scales and offsets are per 32 codes (sc[2i] = sc[2i + 1]): their offsets pair groups of 32, so that
// 4 vpdpwssd against the activations' bs32 take them where 8 would against bs
inline bool per32(int64_t type) { return type == Q4_K || type == Q5_K || type == IQ4_XS; }

// two int16 offsets as one int32 (lo in the low half), a vpdpwssd operand
inline int32_t pair16(int lo, int hi) {
  return static_cast<int32_t>(static_cast<uint16_t>(lo) | static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
}

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
      const bool wide = per32(seg.type(s));  // (WBlock: off[2i] = off[2i + 1], group i of 32's)
      for (int i = 0; i < (wide ? 4 : 8); ++i)
        p[b].off[i][r] = wide ? pair16(w.off[4 * i], w.off[4 * i + 2]) : pair16(w.off[2 * i], w.off[2 * i + 1]);
      p[b].d[r] = w.d;
      p[b].o[r] = w.o;
    }
  }
}

// the bias a panel type's offsets stand for (0: they are mins, at dmin): the AMX path folds it into the
// weights
inline int panel_bias(int64_t type) { return type == Q6_K ? 32 : type == IQ4_XS ? 128 : type == Q3_K ? 4 : 0; }

// The 16 rows' scales, offsets and float scales of a block are opened across the rows: each field lies in the row
// panel as 16 adjacent values (panels.h), so one vector holds it for every row. Against a loop over the rows, the
// Q4_K_M 0.8B file's prefill 512 / 2048 ran 1.04x / 1.06x on the AMX Xeon's tiles, 1.02-1.04x on its vpdpbusd path.
inline __m512i byte_at(__m512i v, int i) {  // byte i of each 32-bit lane, widened
  return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * i)), _mm512_set1_epi32(0xFF));
}

inline __m512i pair16(__m512i lo, __m512i hi) {  // the vector pair16: lo's low 16 bits | hi's above them
  return _mm512_ternarylogic_epi32(lo, _mm512_set1_epi32(0xFFFF), _mm512_slli_epi32(hi, 16), 0xEA);
}

inline void put_d(const uint8_t* halves, float* d) {  // 16 float16 values, widened
  _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves))));
}

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
      out.off[i][r] = pair16(off[2 * i], off[2 * i + 1]);
    out.d[r] = half(q3 ? panel + 32 * b + 2 * r : p + kQ2D + 2 * r);
    out.o[r] = q3 ? out.d[r] : half(p + kQ2Dmin + 2 * r);
  }
}

// The Panel of one block of a row panel (panels.h): codes unpacked into element order, scales and offsets of the
// 16 rows widened, straight from the panel's runs (no row is rebuilt).
inline void open_row_panel(int64_t type, const uint8_t* panel, int64_t nb, int64_t b, Panel& out) {
  const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30), bit4 = _mm512_set1_epi8(0x10);
  auto put = [&](int c, __m512i v) { _mm512_store_si512(out.q[c], v); };
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
    const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kIQ4High)));
    const __m512i low = _mm512_loadu_si512(p + kIQ4Low);  // [row] 4 bytes: 8 low nibbles, of groups 0 .. 7
    __m512i sc[8];  // iq4xs_scale of group ib of 32, every row
    for (int ib = 0; ib < 8; ++ib) {
      const __m512i l = _mm512_and_si512(_mm512_srl_epi32(low, _mm_cvtsi32_si128(4 * ib)), _mm512_set1_epi32(0xF));
      const __m512i h = _mm512_and_si512(_mm512_srl_epi32(high, _mm_cvtsi32_si128(2 * ib)), _mm512_set1_epi32(3));
      sc[ib] = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(h, 4)), _mm512_set1_epi32(32));
      _mm512_store_si512(out.sc[2 * ib], sc[ib]);
      _mm512_store_si512(out.sc[2 * ib + 1], sc[ib]);
    }
    for (int i = 0; i < 8; ++i)
      _mm512_store_si512(out.off[i], i < 4 ? pair16(_mm512_slli_epi32(sc[2 * i], 7), _mm512_slli_epi32(sc[2 * i + 1], 7))
                                           : _mm512_setzero_si512());
    put_d(p + kIQ4D, out.d);
    put_d(p + kIQ4D, out.o);
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
    __m512i sc[16];
    for (int i = 0; i < 16; ++i) {
      const uint8_t* at = p + (2 * (i / 8) + i % 2) * 832 + 768 + 16 * ((i % 8) / 2);  // the 16 rows' scale i
      sc[i] = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
      _mm512_store_si512(out.sc[i], sc[i]);
    }
    for (int i = 0; i < 8; ++i)
      _mm512_store_si512(out.off[i], pair16(_mm512_slli_epi32(sc[2 * i], 5), _mm512_slli_epi32(sc[2 * i + 1], 5)));
    put_d(panel + 32 * b, out.d);
    put_d(panel + 32 * b, out.o);
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
  // k4_scales across the rows: words u = bytes 4u .. 4u + 3 of each row's 12; scales 0 .. 3 and mins 0 .. 3 are
  // their low 6 bits, scales and mins 4 .. 7 a nibble of word 2 with the top 2 bits of words 0 and 1 above it
  const __m512i w0 = _mm512_loadu_si512(p + kK4Scales), w1 = _mm512_loadu_si512(p + kK4Scales + 64),
                w2 = _mm512_loadu_si512(p + kK4Scales + 128);
  const __m512i m6 = _mm512_set1_epi32(0x3F3F3F3F), m4s = _mm512_set1_epi32(0x0F0F0F0F), top = _mm512_set1_epi32(0x30303030);
  const __m512i sc[2] = {_mm512_and_si512(w0, m6), _mm512_ternarylogic_epi32(_mm512_srli_epi32(w0, 2), top,
                                                                            _mm512_and_si512(w2, m4s), 0xEA)};
  const __m512i mn[2] = {_mm512_and_si512(w1, m6), _mm512_ternarylogic_epi32(_mm512_srli_epi32(w1, 2), top,
                                                                            _mm512_and_si512(_mm512_srli_epi32(w2, 4), m4s), 0xEA)};
  for (int i = 0; i < 8; ++i) {
    const __m512i v = byte_at(sc[i / 4], i % 4);
    _mm512_store_si512(out.sc[2 * i], v);
    _mm512_store_si512(out.sc[2 * i + 1], v);
    _mm512_store_si512(out.off[i], i < 4 ? pair16(byte_at(mn[i / 2], 2 * (i % 2)), byte_at(mn[i / 2], 2 * (i % 2) + 1))
                                         : _mm512_setzero_si512());
  }
  put_d(p + kK4D, out.d);
  put_d(p + kK4Dmin, out.o);
}
#endif

}  // namespace kq
}  // namespace deltaserve
