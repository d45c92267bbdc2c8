// The decode GEMV of K-quant weights on AVX-512 BW: y [M, N] = x [M, K] (rounded to Q8_K) @ W^T for M <= kRows,
// the codes opened in registers straight from the file's blocks (int8dot.h's row-at-a-time path first writes each
// block opened to memory and reads it back: 42-62% of the read peak). Per block and activation row: the codes
// times the int8 activations in pairs (vpmaddubsw), times the per-16 / per-32 scales into int32 (vpdpwssd), one
// float multiply-add; the mins (Q4_K, Q5_K) or the codes' offset of 32 (Q6_K) against the activations' sums.
//
//   Q4_K / Q5_K: one 64-byte load of nibbles holds 128 codes, the low nibbles elements 0..31 and 64..95 of them,
//     the high ones 32..63 and 96..127: the activations are kept in that order too (XBlock::qp), so an AND and a
//     shift open 128 codes. Q5_K's fifth bits come from its 32 bytes of high bits broadcast, shifted per half.
//   Q6_K: 64 bytes of low nibbles hold elements 0..63 (low) and 64..127 (high) of a half block in order; the two
//     high bits come from 32 bytes broadcast, shifted per 32-element quarter and merged by vpternlogd.
//
// These row kernels take native rows (and a panel matrix's last rows past its whole panels); panel_gemv.h holds the
// panel kernels and the call, gemv_direct.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "int8dot.h"
#include "panels.h"

namespace deltaserve {
namespace kq {

#if defined(__AVX512BW__)
inline __m512i dot_scaled(__m512i acc, __m512i codes, const int8_t* x, __m512i scales) {
  const __m512i pairs = _mm512_maddubs_epi16(codes, _mm512_load_si512(x));  // u8 codes x s8: int16 pair sums
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, pairs, scales);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, scales));
#endif
}

inline void prefetch_block(const uint8_t* p, int bytes) {
  for (int o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + kGemvPrefetch + o, _MM_HINT_T0);
}

// int16 lane i of 32 takes scale kK4Lanes[v][i] of a block's 8: the low / high nibbles of the 128 codes of load h
// (v = 2h + high) are sub-blocks 4h + high and 4h + 2 + high
alignas(64) inline const int16_t kK4Lanes[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2},
    {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6},
    {5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}};
// int16 lane i of 32 takes scale kQ6Lanes[c][i] of 16: 64 elements in order, 16 to a scale
alignas(64) inline const int16_t kQ6Lanes[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};

// per 16-bit word (32 of them): a shift for the first 32 bytes, another for the second 32
inline __m512i word_shifts(int first, int second) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(first)), _mm256_set1_epi16(static_cast<int16_t>(second)), 1);
}

inline __m512i broadcast32(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// out[m] = (weight row of Q4_K (Q5 false) or Q5_K blocks) . (activation row m), x laid out [nb][MB]
template <int MB, bool Q5>
inline void rows_k4(const uint8_t* row, int64_t nb, const XBlock* x, float* out) {
  constexpr int kBytes = Q5 ? 176 : 144;
  const __m512i m4 = _mm512_set1_epi8(0xF), bit0 = _mm512_set1_epi8(1);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * kBytes;
    prefetch_block(p, kBytes);
    const XBlock* xb = x + b * MB;
    uint8_t sc[8], mn[8];
    k4_scales(p + 4, sc, mn);
    const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
    const __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
    const uint8_t* qs = p + (Q5 ? 48 : 16);
    __m512i hb = _mm512_setzero_si512();
    if constexpr (Q5) hb = broadcast32(p + 16);
    __m512i ai[MB];
    for (int m = 0; m < MB; ++m) ai[m] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(qs + 64 * h);
      __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      if constexpr (Q5) {  // bit 2j of a high-bit byte belongs to the low nibbles of 64-element part j, 2j + 1 to the high
        const __m512i hl = _mm512_and_si512(_mm512_srlv_epi16(hb, word_shifts(4 * h, 4 * h + 2)), bit0);
        const __m512i hh = _mm512_and_si512(_mm512_srlv_epi16(hb, word_shifts(4 * h + 1, 4 * h + 3)), bit0);
        lo = _mm512_or_si512(lo, _mm512_slli_epi16(hl, 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi16(hh, 4));
      }
      const __m512i slo = _mm512_permutexvar_epi16(_mm512_load_si512(kK4Lanes[2 * h]), s16);
      const __m512i shi = _mm512_permutexvar_epi16(_mm512_load_si512(kK4Lanes[2 * h + 1]), s16);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        ai[m] = dot_scaled(ai[m], lo, xb[m].qp + 128 * h, slo);
        ai[m] = dot_scaled(ai[m], hi, xb[m].qp + 128 * h + 64, shi);
      }
    }
    const float d = half(p), dmin = half(p + 2);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m128i o = _mm_madd_epi16(m16, _mm_load_si128(reinterpret_cast<const __m128i*>(xb[m].bs32)));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[m]), _mm512_set1_ps(d * xb[m].d), acc[m]);
      acc[m] = _mm512_fnmadd_ps(_mm512_zextps128_ps512(_mm_cvtepi32_ps(o)), _mm512_set1_ps(dmin * xb[m].d), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// the same for Q6_K: codes = the stored 6 bits (value + 32), the offset taken off in the integer sum
template <int MB>
inline void rows_q6k(const uint8_t* row, int64_t nb, const XBlock* x, float* out) {
  const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
  const __m512i up = word_shifts(4, 2), down = word_shifts(0, 2);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * 210;
    prefetch_block(p, 210);
    const XBlock* xb = x + b * MB;
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
    const __m512i s16 = _mm512_castsi256_si512(sc);
    __m512i ai[MB];
    for (int m = 0; m < MB; ++m) ai[m] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i low = _mm512_loadu_si512(p + 64 * h), high = broadcast32(p + 128 + 32 * h);
      // (low & 0xF) | (two high bits at 4, 5): elements 0..31 take high bits 0, 1, elements 32..63 bits 2, 3, ...
      const __m512i c0 = _mm512_ternarylogic_epi32(low, _mm512_and_si512(_mm512_sllv_epi16(high, up), m30), m4, 0xEC);
      const __m512i c1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(low, 4), _mm512_and_si512(_mm512_srlv_epi16(high, down), m30),
                                                   m4, 0xEC);
      const __m512i s0 = _mm512_permutexvar_epi16(_mm512_load_si512(kQ6Lanes[2 * h]), s16);
      const __m512i s1 = _mm512_permutexvar_epi16(_mm512_load_si512(kQ6Lanes[2 * h + 1]), s16);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        ai[m] = dot_scaled(ai[m], c0, xb[m].q + 128 * h, s0);
        ai[m] = dot_scaled(ai[m], c1, xb[m].q + 128 * h + 64, s1);
      }
    }
    const float d = half(p + 208);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256i o = _mm256_madd_epi16(sc, _mm256_load_si256(reinterpret_cast<const __m256i*>(xb[m].bs)));
      const __m512i sum = _mm512_sub_epi32(ai[m], _mm512_zextsi256_si512(_mm256_slli_epi32(o, 5)));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * xb[m].d), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// any type open_block takes, a block at a time through its opened form, in exact integer sums (IQ4_XS rows
// outside panels: its codes reach 241, past vpmaddubsw's pairs)
template <int MB, int64_t TYPE>
inline void rows_opened(const uint8_t* row, int64_t nb, const XBlock* x, float* out) {
  const int64_t bytes = layout(TYPE).bytes;
  WBlock w;
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    open_block(TYPE, row + b * bytes, w);
    for (int m = 0; m < MB; ++m) {
      const XBlock& xb = x[b * MB + m];
      int32_t s = 0, o = 0;
      for (int i = 0; i < 16; ++i) {
        int32_t g = 0;
        for (int e = 16 * i; e < 16 * i + 16; ++e) g += w.q[e] * xb.q[e];
        s += w.sc[i] * g;
        o += w.off[i] * xb.bs[i];
      }
      out[m] += w.d * xb.d * static_cast<float>(s) - w.o * xb.d * static_cast<float>(o);
    }
  }
}

// a row of a type with no kernel of its own above (Q2_K, Q3_K; IQ4_XS's signed codes where kIQ4Signed): its blocks
// opened into a thread's buffer, then int8dot.h's dot
template <int MB, int64_t TYPE>
inline void rows_blocks(const uint8_t* row, int64_t nb, const XBlock* x, float* out) {
  static thread_local std::vector<WBlock> w;
  if (w.size() < static_cast<size_t>(nb)) w.resize(nb);
  open_row(TYPE, row, nb, w.data());
  dot_rows<MB, TYPE == IQ4_XS && kIQ4Signed>(w.data(), x, nb, out);
}

using RowKernel = void (*)(const uint8_t*, int64_t, const XBlock*, float*);

template <int MB>
inline RowKernel row_kernel_mb(int64_t type) {
  switch (type) {
    case Q4_K: return rows_k4<MB, false>;
    case Q5_K: return rows_k4<MB, true>;
    case Q6_K: return rows_q6k<MB>;
    case IQ4_XS: return kIQ4Signed ? rows_blocks<MB, IQ4_XS> : rows_opened<MB, IQ4_XS>;
    case Q2_K: return rows_blocks<MB, Q2_K>;
    case Q3_K: return rows_blocks<MB, Q3_K>;
  }
  return nullptr;
}

inline RowKernel row_kernel(int64_t type, int64_t mb) {
  switch (mb) {
    case 1: return row_kernel_mb<1>(type);
    case 2: return row_kernel_mb<2>(type);
    case 3: return row_kernel_mb<3>(type);
    case 4: return row_kernel_mb<4>(type);
    case 5: return row_kernel_mb<5>(type);
    case 6: return row_kernel_mb<6>(type);
    case 7: return row_kernel_mb<7>(type);
    default: return row_kernel_mb<8>(type);
  }
}
#endif

}  // namespace kq
}  // namespace deltaserve
