// The decode GEMV of K-quant and IQ4_XS rows on AVX2 CPUs without AVX-512 (Zen 2 / 3, Intel's client cores): a run
// of weight rows a call (each_row), a row at a time, its codes opened in registers from the file's blocks as they
// stream in, the arithmetic llama.cpp's AVX2 dot products take (vpmaddubsw: unsigned codes x int8 activations in
// int16 pairs; vpmaddwd: the pairs times their scale into int32; one float multiply-add per block). They replace
// opening each block into memory (int8dot.h's WBlock: 256 codes, 16 scales and offsets) and reading it back: 1.4-2x
// the rate.
//
//   Q4_K / Q5_K: 32 bytes of nibbles hold elements 64j + 0..31 (low) and 64j + 32..63 (high), sub-blocks 2j, 2j + 1
//     of 32, one 6-bit scale each; Q5_K's fifth bits are bits 2j, 2j + 1 of its 32 high-bit bytes. The mins go
//     against the activations' sums per 32 (XBlock::bs32).
//   Q6_K: per half n, ql[64n ..] holds elements 128n + 0..31 and + 64.. (low, high nibble), ql[64n + 32 ..] + 32..
//     and + 96..; qh[32n ..] their two high bits (pairs 0, 1, 2, 3 for the four quarters); an int8 scale per 16, and
//     the offset of 32 as 32 x the scales against the activations' sums per 16 (XBlock::bs).
//   IQ4_XS: 32 bytes of nibbles hold sub-blocks 2k, 2k + 1, looked up as their signed levels (rows_iq4xs_avx2).
//   Q2_K / Q3_K: 32 bytes hold 128 elements in 2-bit pairs, a scale per 16 (rows_q23k_avx2).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int8dot.h"

namespace deltaserve {
namespace kq {

#if defined(__AVX2__) && !defined(__AVX512BW__)
inline bool rows_avx2(int64_t type) {
  return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS;
}

inline __m256i scaled_pairs(__m256i acc, __m256i pairs, __m256i scales) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, pairs, scales);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scales));
#endif
}

inline float lane_sum(__m128 v) {
  const __m128 s = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

inline float lane_sum(__m256 v) { return lane_sum(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); }

// every int16 lane = word w of each 128-bit half of v
inline __m256i word_of(__m256i v, int w) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<int16_t>((2 * w + 1) << 8 | 2 * w)));
}

// a Q4_K / Q5_K block's scales and mins as int16 lanes, from registers
inline void k4_scales16(const uint8_t* packed, __m128i& sc, __m128i& mn) {
  uint64_t s, m;
  k4_scale_words(packed, s, m);
  sc = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(s)));
  mn = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(m)));
}

// every int16 lane of the low 128-bit half = word w of v's low half, of the high half = word w + 1 of v's high half
inline __m256i words_of(__m256i v, int w) {
  const int16_t lo = static_cast<int16_t>((2 * w + 1) << 8 | 2 * w), hi = static_cast<int16_t>((2 * w + 3) << 8 | (2 * w + 2));
  return _mm256_shuffle_epi8(v, _mm256_setr_epi16(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi));
}

// A block's lines prefetched this far ahead: half gemv.h's distance, as these kernels read a run of rows without a
// pause between them. The 0.8B IQ4_XS file's decode GEMVs on the AMX Xeon's AVX2 build, 2 threads, beside a plain
// read: 52-60% at 8,192 bytes (into L1 or L2), 56-58% at 4,096, 66-71% at 1,024-3,072 (the per-row calls before: 55-58%)
constexpr int64_t kRowsPrefetch = 2048;

template <int64_t Bytes>
inline void prefetch_row_block(const uint8_t* p) {
  for (int64_t o = 0; o < Bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + kRowsPrefetch + o, _MM_HINT_T0);
}

// out[m] = (a row of Q4_K, or Q5_K, blocks) . (activation row m), x laid out [nb][MB]
template <int MB, bool Q5>
inline void rows_k4_avx2(const uint8_t* row, int64_t nb, const XBlock* x, float* out) {
  constexpr int64_t kBytes = Q5 ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(0xF), bit4 = _mm256_set1_epi8(0x10);
  __m256 acc[MB];
  __m128 mins[MB];  // the mins' sums in 4 lanes, added across lanes once a row
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps(), mins[m] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * kBytes;
    prefetch_row_block<kBytes>(p);
    const XBlock* xb = x + b * MB;
    __m128i sc16x8, mn16;
    k4_scales16(p + 4, sc16x8, mn16);
    const __m256i sc16 = _mm256_broadcastsi128_si256(sc16x8);
    const uint8_t* qs = p + (Q5 ? 48 : 16);
    const __m256i high = Q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)) : _mm256_setzero_si256();
    __m256i ai[MB];
    for (int m = 0; m < MB; ++m) ai[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if constexpr (Q5) {  // bits 2j, 2j + 1 of the high bytes to bit 4 (the word shifts keep them within their byte)
        lo = _mm256_or_si256(lo, _mm256_and_si256(2 * j <= 4 ? _mm256_slli_epi16(high, 4 - 2 * j) : _mm256_srli_epi16(high, 2 * j - 4), bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(2 * j + 1 <= 4 ? _mm256_slli_epi16(high, 3 - 2 * j) : _mm256_srli_epi16(high, 2 * j - 3), bit4));
      }
      const __m256i s_lo = word_of(sc16, 2 * j), s_hi = word_of(sc16, 2 * j + 1);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_load_si256(reinterpret_cast<const __m256i*>(xb[m].q + 64 * j)));
        const __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_load_si256(reinterpret_cast<const __m256i*>(xb[m].q + 64 * j + 32)));
        ai[m] = scaled_pairs(scaled_pairs(ai[m], p_lo, s_lo), p_hi, s_hi);
      }
    }
    const float d = half(p), dmin = half(p + 2);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[m]), _mm256_set1_ps(d * xb[m].d), acc[m]);
      const __m128i o = _mm_madd_epi16(mn16, _mm_load_si128(reinterpret_cast<const __m128i*>(xb[m].bs32)));
      mins[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(o), _mm_set1_ps(dmin * xb[m].d), mins[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = lane_sum(acc[m]) - lane_sum(mins[m]);
}

// out[m] = (a row of Q6_K blocks) . (activation row m), x laid out [nb][MB]
template <int MB>
inline void rows_q6k_avx2(const uint8_t* row, int64_t nb, const XBlock* x, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * 210;
    prefetch_row_block<210>(p);
    const XBlock* xb = x + b * MB;
    // the 16 int8 scales as int16: words 0..7 (elements 0..127) in both halves, then words 8..15 (128..255)
    const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
    const __m256i sc_lo = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(s8));
    const __m256i sc_hi = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(s8, 8)));
    const __m256i sc16 = _mm256_cvtepi8_epi16(s8);
    __m256i ai[MB];
    for (int m = 0; m < MB; ++m)  // the codes' offset of 32: -32 x sum_g scale_g bsum_g
      ai[m] = _mm256_sub_epi32(_mm256_setzero_si256(),
                               _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_load_si256(reinterpret_cast<const __m256i*>(xb[m].bs))), 5));
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {
      const __m256i half_sc = n ? sc_hi : sc_lo;
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * n));
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * n));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * n + 32));
      __m256i codes[4];  // quarters q: elements 128n + 32q + 0..31
      codes[0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
      codes[1] = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
      codes[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(h, m30));
      codes[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        // pairs 0..7 of the quarter: scale 2q of the half, 8..15: 2q + 1 (lanes of each 128-bit half)
        const __m256i s = words_of(half_sc, 2 * q);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
          const __m256i pairs = _mm256_maddubs_epi16(codes[q], _mm256_load_si256(reinterpret_cast<const __m256i*>(xb[m].q + 128 * n + 32 * q)));
          ai[m] = scaled_pairs(ai[m], pairs, s);
        }
      }
    }
    const float d = half(p + 208);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[m]), _mm256_set1_ps(d * xb[m].d), acc[m]);
  }
  for (int m = 0; m < MB; ++m) out[m] = lane_sum(acc[m]);
}

// out[m] = (a row of IQ4_XS blocks) . (activation row m), x laid out [nb][MB]: 32 bytes of nibbles hold sub-blocks
// 2k, 2k + 1 (16 bytes each: elements 0..15 low, 16..31 high), looked up as the signed levels. vpmaddubsw multiplies
// the activations' magnitudes |x| (XBlock::qa, unsigned, in the nibbles' order: qp) by the levels given x's sign
// (vpsignb): level x, exactly, and a pair at most 2 x 128 x 127, inside int16. (llama.cpp gives x the level's sign
// and takes |level|: one vpsignb more a 32 codes, and x's halves gathered from two registers.)
template <int MB>
inline void rows_iq4xs_avx2(const uint8_t* row, int64_t nb, const XBlock* x, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Levels)));
  const __m256i nibble_at = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), pair_at = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * 136;
    prefetch_row_block<136>(p);
    const XBlock* xb = x + b * MB;
    // scale ib - 32: nibble ib of scales_l, bits 2 ib of scales_h at 4; as int16 words 0..7 in both halves
    uint16_t high;
    uint32_t low;
    std::memcpy(&high, p + 2, 2);
    std::memcpy(&low, p + 4, 4);
    const __m256i s32 = _mm256_sub_epi32(
        _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(low)), nibble_at), _mm256_set1_epi32(0xF)),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(high), pair_at), _mm256_set1_epi32(3)), 4)),
        _mm256_set1_epi32(32));
    const __m256i sc16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(s32, s32), 0x88);
    __m256i ai[MB];
    for (int m = 0; m < MB; ++m) ai[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 + 32 * k));
      // lo: elements 0..15 of sub-blocks 2k (low half), 2k + 1 (high half); hi: their elements 16..31
      const __m256i lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(v, m4));
      const __m256i hi = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
      const __m256i s = words_of(sc16, 2 * k);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {  // lo pairs with qp's first 32 of these 64, hi with the second
        const auto at = [&](const void* v, int half) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(v) + 2 * k + half); };
        const __m256i p_lo = _mm256_maddubs_epi16(at(xb[m].qa, 0), _mm256_sign_epi8(lo, at(xb[m].qp, 0)));
        const __m256i p_hi = _mm256_maddubs_epi16(at(xb[m].qa, 1), _mm256_sign_epi8(hi, at(xb[m].qp, 1)));
        ai[m] = scaled_pairs(scaled_pairs(ai[m], p_lo, s), p_hi, s);
      }
    }
    const float d = half(p);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[m]), _mm256_set1_ps(d * xb[m].d), acc[m]);
  }
  for (int m = 0; m < MB; ++m) out[m] = lane_sum(acc[m]);
}

// the 16 scales of a Q3_K block (less 32) as int16, in order: low nibbles of bytes 0..7 (scales 0..7) and their
// high nibbles (8..15), the top two bits of scale 4k + j bits 2k of byte 8 + j
inline __m256i q3k_scales16(const uint8_t* s) {
  const __m128i m4 = _mm_set1_epi8(0xF);
  const __m128i l8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(l8, m4), _mm_and_si128(_mm_srli_epi16(l8, 4), m4));
  uint32_t t4;
  std::memcpy(&t4, s + 8, 4);
  const __m128i top = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(static_cast<int32_t>(t4)), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
  return _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_or_si128(low, _mm_slli_epi16(top, 4))), _mm256_set1_epi16(32));
}

// out[m] = (a row of Q2_K, or Q3_K, blocks) . (activation row m), x laid out [nb][MB]: per half n, 32 bytes hold
// elements 128n + 32j + 0..31 in bits 2j; a scale per 16. Q2_K: d scale q - dmin min (the mins against the
// activations' sums per 16); Q3_K: d (scale - 32)(q + 4 hbit - 4), hbit of element 32g + l bit g of hmask byte l.
template <int MB, bool Q3>
inline void rows_q23k_avx2(const uint8_t* row, int64_t nb, const XBlock* x, float* out) {
  constexpr int64_t kBytes = Q3 ? 110 : 84, kCodes = Q3 ? 32 : 16;
  const __m256i m3 = _mm256_set1_epi8(3), bit2 = _mm256_set1_epi8(4);
  __m256 acc[MB], mins[MB];  // Q2_K's mins' sums in 8 lanes, added across lanes once a row
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps(), mins[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * kBytes;
    prefetch_row_block<kBytes>(p);
    const XBlock* xb = x + b * MB;
    __m256i sc16, mn16 = _mm256_setzero_si256();
    if constexpr (Q3) {
      sc16 = q3k_scales16(p + 96);
    } else {
      const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s8, _mm_set1_epi8(0xF)));
      mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), _mm_set1_epi8(0xF)));
    }
    const __m256i hm = Q3 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_setzero_si256();
    __m256i ai[MB];
    for (int m = 0; m < MB; ++m)  // Q3_K's offset of 4: -4 x sum_g scale_g bsum_g
      ai[m] = Q3 ? _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_load_si256(reinterpret_cast<const __m256i*>(xb[m].bs))), 2))
                 : _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kCodes + 32 * n));
      const __m256i half_sc = _mm256_permute4x64_epi64(sc16, n ? 0xEE : 0x44);  // scales 8n .. 8n + 7 in both halves
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m256i codes = _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), m3);
        if constexpr (Q3) {  // bit g of each hmask byte to bit 2 (16-bit shifts, masked per byte)
          const int g = 4 * n + j;
          codes = _mm256_or_si256(codes, _mm256_and_si256(g < 2 ? _mm256_slli_epi16(hm, 2 - g) : _mm256_srli_epi16(hm, g - 2), bit2));
        }
        const __m256i s = words_of(half_sc, 2 * j);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
          const __m256i pairs = _mm256_maddubs_epi16(codes, _mm256_load_si256(reinterpret_cast<const __m256i*>(xb[m].q + 128 * n + 32 * j)));
          ai[m] = scaled_pairs(ai[m], pairs, s);
        }
      }
    }
    const float d = half(p + (Q3 ? 108 : 80));
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[m]), _mm256_set1_ps(d * xb[m].d), acc[m]);
      if constexpr (!Q3) {
        const __m256i o = _mm256_madd_epi16(mn16, _mm256_load_si256(reinterpret_cast<const __m256i*>(xb[m].bs)));
        mins[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_set1_ps(half(p + 82) * xb[m].d), mins[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = lane_sum(acc[m]) - lane_sum(mins[m]);
}

// y[m * ldy + r] = (row r of `rows` rows, row_bytes apart) . (activation row m) for m < MB, by ROW a row at a time:
// one call a run of rows, the kernel's constants set up once (a 1,024-wide row is 4 blocks, and a call, a dispatch
// and a setup per row had cost about a third of a hot 1,024-wide matrix's time)
template <int MB, void (*ROW)(const uint8_t*, int64_t, const XBlock*, float*)>
void each_row(const uint8_t* row, int64_t rows, int64_t row_bytes, int64_t nb, const XBlock* x, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    float sums[MB];
    ROW(row + r * row_bytes, nb, x, sums);
    for (int m = 0; m < MB; ++m) y[m * ldy + r] = sums[m];
  }
}

using RowsAvx2 = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const XBlock*, float*, int64_t);

template <int MB>
inline RowsAvx2 rows_avx2_of(int64_t type) {
  switch (type) {
    case Q4_K: return each_row<MB, rows_k4_avx2<MB, false>>;
    case Q5_K: return each_row<MB, rows_k4_avx2<MB, true>>;
    case IQ4_XS: return each_row<MB, rows_iq4xs_avx2<MB>>;
    case Q2_K: return each_row<MB, rows_q23k_avx2<MB, false>>;
    case Q3_K: return each_row<MB, rows_q23k_avx2<MB, true>>;
    default: return each_row<MB, rows_q6k_avx2<MB>>;
  }
}

// the kernel for `type` (rows_avx2) and mb <= kRows activation rows
inline RowsAvx2 rows_avx2_kernel(int64_t type, int64_t mb) {
  switch (mb) {
    case 1: return rows_avx2_of<1>(type);
    case 2: return rows_avx2_of<2>(type);
    case 3: return rows_avx2_of<3>(type);
    default: return rows_avx2_of<4>(type);
  }
}
#endif

}  // namespace kq
}  // namespace deltaserve
