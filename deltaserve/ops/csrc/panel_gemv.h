// The decode GEMV of K-quant, IQ4_XS and Q4_0 weights held in row panels (panels.h) on AVX-512 BW: 16 weight rows a
// pass, one int32 lane per row, their codes opened in registers as they stream in; and gemv_direct, the decode call,
// which gives a matrix's panels to these kernels and its other rows to int8gemv.h's row kernels (int8legacy.h's for
// rows of 32-weight blocks). Threads take contiguous runs of weight rows (one each: no sync inside a call),
// prefetching their stream.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "int8dot.h"
#include "int8gemv.h"
#include "int8legacy.h"
#include "panels.h"
#include "shares.h"

namespace deltaserve {
namespace kq {

#if defined(__AVX512BW__)
constexpr bool kDirectGemv = true;

// -- row panels (panels.h): 16 rows a pass, one int32 lane per row --------------------------------------------

inline __m512i dot_pairs(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// The panel kernels prefetch their stream a distance ahead, a code run's line as the run is read: the same prefetches
// issued a block at a time (36 for Q4_K, then its 64 vpdpbusd) streamed 22.3 GB/s where spread among the loads 26.4
// (cold Q4_K, two Xeon cores). A block's first bytes (its scales, which every run's sums need) are prefetched into L2
// as it starts. The distance must cover memory's latency in the time a core takes to read it: 4 KB on the Xeon (4 beat
// 1-3 and 5-8 there), 8 KB on AMD, whose Zen 5 cores go through a block faster (one core, cold rows, against the
// float16 GEMV in the same process: Q4_K 0.63-0.67 -> 0.72-0.73, Q5_K 0.56-0.63 -> 0.66-0.74, Q3_K 0.60-0.69 ->
// 0.74-0.89, IQ4_XS 0.86-0.99 -> 1.03-1.08, Q4_0 0.61-0.71 -> 0.68-0.74); Q6_K's, three runs a block, stream faster at
// 4 KB there too (0.69-0.88 against 0.63-0.68). The runs' lines go into L2 (T1) on Intel, where the AMX Xeon's L1 fill
// buffers capped prefetches into L1 (T0: 16.2 against 22.5 GB/s, cold Q4_K, two cores), and into L1 on AMD, measured
// once the prefetches were spread (load_run): Zen 5, two cores, cold 48K x 1024 matrices, the two alternating in one
// process, T0 against T1: Q4_K +19%, Q5_K +28%, Q6_K +19%, Q3_K +26%, Q4_0 +17%, IQ4_XS +10%, Q2_K +1% (one core
// +3-12%); decode of whole files Q4_K_M +7%, Q5_K_M +5%, Q6_K +6%, the MoE +6%, IQ4_XS +1%. The kernels take the
// choice as a template flag (L1), made once as the module loads; DELTASERVE_PANEL_PREFETCH=l1 or l2 makes it instead
// (so that one CPU's tests run both).
constexpr int64_t kPanelNear = 4096;
inline const int64_t kPanelAhead = __builtin_cpu_is("amd") ? 8192 : kPanelNear;
inline const bool kPanelL1 = [] {
  const char* set = std::getenv("DELTASERVE_PANEL_PREFETCH");
  return set ? std::string(set) == "l1" : static_cast<bool>(__builtin_cpu_is("amd"));
}();

template <bool L1>
inline void prefetch_line(const char* p) {
  if constexpr (L1) _mm_prefetch(p, _MM_HINT_T0);
  else _mm_prefetch(p, _MM_HINT_T1);
}

template <bool Near = false>
inline void prefetch_span(const uint8_t* p, int64_t bytes) {
  const int64_t ahead = Near ? kPanelNear : kPanelAhead;
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + ahead + o, _MM_HINT_T1);
}

// A run's load with its line's prefetch, kept in place: the compiler otherwise hoists every prefetch of a fully
// unrolled block to the block's start (Q4_K, Q5_K, Q6_K, Q2_K, Q3_K: 20-36 in a row), which is the block-at-a-time
// issue measured slower above. An empty asm with a memory clobber pins the order. Zen 5, cold rows, the same process
// alternating: one core Q4_K 30.1 -> 34.5 GB/s, Q5_K 26.3 -> 31.6, Q6_K 32.1 -> 35.4, Q2_K 37.2 -> 42.9 (IQ4_XS, Q3_K,
// Q4_0, whose loops issue 4-8 at a time, the same); two cores Q6_K +16%, Q4_K and Q5_K +3-5%; decode of whole files
// (alternating every 16 tokens) Q4_K_M +13%, Q5_K_M +17%, Q6_K +15%, IQ4_XS +5%.
//
// The prefetches walk each panel's bytes in order, a line per line read (`at`: the line in that order; by default the
// line read). Where a kernel reads a block out of order, or its d's from a head at the panel's start (Q3_K, Q4_0),
// prefetching each line at its own address skipped the head's bytes (Q4_0 at K = 1024: the last 1 KB of every 9 KB
// panel never prefetched) or sent the prefetches back and forth between a block's parts (Q5_K's and Q3_K's high bits
// beside the codes). In order, one process alternating, cold matrices, Zen 5: Q4_0 +33% on one and two cores at 6144
// x 1024 (the rate of a plain read of its panels, prefetched the same way), +41% at 48K x 1024; Q3_K +15-24%; Q5_K
// +1-5%. (Q6_K, whose head is 1% of its panels, measured the same either way.)
template <bool L1, bool Near = false>
inline __m512i load_run(const uint8_t* p, const uint8_t* at = nullptr) {
  prefetch_line<L1>(reinterpret_cast<const char*>(at ? at : p) + (Near ? kPanelNear : kPanelAhead));
  asm volatile("" ::: "memory");
  return _mm512_loadu_si512(p);
}

// per dword (a row): bytes (k, 0, k + 1, 0) of its own 4, k = 0 or 2: two u8 scales as an int16 pair
inline __m512i scale_pairs(__m512i bytes, int k) {
  auto ctl = [k](int t) { return (4 * t + k) | 0x80 << 8 | (4 * t + k + 1) << 16 | 0x80 << 24; };  // in-lane byte indices
  return _mm512_shuffle_epi8(bytes, _mm512_setr_epi32(ctl(0), ctl(1), ctl(2), ctl(3), ctl(0), ctl(1), ctl(2), ctl(3),
                                                      ctl(0), ctl(1), ctl(2), ctl(3), ctl(0), ctl(1), ctl(2), ctl(3)));
}

// acc[m] += d dx_m sums[m] - dmin dx_m mins[m] (a lane per weight row): a block's integer sums and mins into the float
// accumulators, x the block's activation rows
template <int MB>
inline void add_block(__m512* acc, const __m512i* sums, const __m512i* mins, __m512 d, __m512 dmin, const XBlock* x) {
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) {
    const __m512 xd = _mm512_set1_ps(x[m].d);
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m]), _mm512_mul_ps(d, xd), acc[m]);
    acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[m]), _mm512_mul_ps(dmin, xd), acc[m]);
  }
}

// out[m * 16 + r] = (row r of a Q4_K / Q5_K panel) . (activation row m), x[b * xs + m]
template <int MB, bool Q5, bool L1>
inline void panel_k4(const uint8_t* panel, int64_t nb, const XBlock* x, int64_t xs, float* out) {
  constexpr int64_t kBlock = k4_codes(Q5) + 2048, kCodes = k4_codes(Q5);
  const __m512i m4 = _mm512_set1_epi8(0xF), m6 = _mm512_set1_epi8(0x3F), m30 = _mm512_set1_epi8(0x30), bit4 = _mm512_set1_epi8(0x10);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = panel + b * kBlock;
    prefetch_span(p, kQ5High);
    // get_scale_min_k4 for 16 rows at once, on the scale words u0, u1, u2 (a dword per row)
    const __m512i u0 = _mm512_loadu_si512(p + kK4Scales), u1 = _mm512_loadu_si512(p + kK4Scales + 64), u2 = _mm512_loadu_si512(p + kK4Scales + 128);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kK4D)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kK4Dmin)));
    const __m512i sc03 = _mm512_and_si512(u0, m6), mn03 = _mm512_and_si512(u1, m6);
    const __m512i sc47 = _mm512_ternarylogic_epi32(u2, m4, _mm512_and_si512(_mm512_srli_epi32(u0, 2), m30), 0xEA);
    const __m512i mn47 = _mm512_ternarylogic_epi32(_mm512_srli_epi32(u2, 4), m4, _mm512_and_si512(_mm512_srli_epi32(u1, 2), m30), 0xEA);
    __m512i blk[MB], mins[MB];
    for (int m = 0; m < MB; ++m) blk[m] = mins[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // 64 elements: sub-blocks 2j (low nibbles), 2j + 1 (high)
      const __m512i sc = scale_pairs(j < 2 ? sc03 : sc47, 2 * (j % 2)), mn = scale_pairs(j < 2 ? mn03 : mn47, 2 * (j % 2));
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {  // 16 elements of each: sums below 2^15, packed in pairs
        __m512i lo_sum[MB], hi_sum[MB];
        for (int m = 0; m < MB; ++m) lo_sum[m] = hi_sum[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int l = 0; l < 4; ++l) {
          const int l4 = 4 * half + l;
          // in order (Q5_K): the first quarter reads a code line and a high-bit line by turns, 16 lines after the scales
          const uint8_t* at = Q5 ? p + kQ5High + 64 * (j == 0 ? 2 * l4 : 16 + 8 * (j - 1) + l4) : nullptr;
          const __m512i v = load_run<L1>(p + kCodes + (j * 8 + l4) * 64, at);
          __m512i lo, hi;
          if constexpr (Q5) {  // bit 2j (2j + 1) of the high bits to bit 4
            const __m512i h = j == 0 ? load_run<L1>(p + kQ5High + l4 * 64, at + 64) : _mm512_loadu_si512(p + kQ5High + l4 * 64);
            const __m512i hl = 2 * j <= 4 ? _mm512_slli_epi16(h, 4 - 2 * j) : _mm512_srli_epi16(h, 2 * j - 4);
            const __m512i hh = 2 * j + 1 <= 4 ? _mm512_slli_epi16(h, 3 - 2 * j) : _mm512_srli_epi16(h, 2 * j - 3);
            lo = _mm512_ternarylogic_epi32(v, m4, _mm512_and_si512(hl, bit4), 0xEA);
            hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), m4, _mm512_and_si512(hh, bit4), 0xEA);
          } else {
            lo = _mm512_and_si512(v, m4);
            hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
          }
#pragma GCC unroll 4
          for (int m = 0; m < MB; ++m) {
            lo_sum[m] = dot4(lo_sum[m], lo, x[b * xs + m].q + 64 * j + 4 * l4);
            hi_sum[m] = dot4(hi_sum[m], hi, x[b * xs + m].q + 64 * j + 32 + 4 * l4);
          }
        }
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m)  // (lo, hi) int16 pairs times (scale 2j, scale 2j + 1)
          blk[m] = dot_pairs(blk[m], _mm512_ternarylogic_epi32(lo_sum[m], low16, _mm512_slli_epi32(hi_sum[m], 16), 0xEA), sc);
      }
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        int32_t pair;
        std::memcpy(&pair, x[b * xs + m].bs32 + 2 * j, 4);
        mins[m] = dot_pairs(mins[m], mn, _mm512_set1_epi32(pair));
      }
    }
    add_block<MB>(acc, blk, mins, d, dmin, x + b * xs);
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

// the same for a Q6_K panel: codes (value + 32) per 16 elements summed, less 32 x the activations' sum, times the
// row's int8 scale (vpmulld: 16-element sums of 6-bit codes pass 2^15)
template <int MB, bool L1>
inline void panel_q6k(const uint8_t* panel, int64_t nb, const XBlock* x, int64_t xs, float* out) {
  const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* blocks = panel + panel_head(Q6_K, nb);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = blocks + b * 3328;
    __m512i ai[MB];
    for (int m = 0; m < MB; ++m) ai[m] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        __m512i sum[MB][4];
        for (int m = 0; m < MB; ++m)
          for (int q = 0; q < 4; ++q) sum[m][q] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int l = 0; l < 4; ++l) {
          const int l4 = 4 * half + l;
          const uint8_t* run = p + (2 * n + half) * 832 + l * 192;  // ql (quarters 0, 2), ql + 32 (1, 3), qh
          if (l == 0) prefetch_span<true>(p + (2 * n + half) * 832 + 768, 64);  // the section's scales
          const __m512i a = load_run<L1, true>(run), c = load_run<L1, true>(run + 64), h = load_run<L1, true>(run + 128);
          // quarter q of the half: a nibble of a (q even) or c (odd), high bits 2q, 2q + 1 of h at bits 4, 5
          __m512i codes[4];
          codes[0] = _mm512_ternarylogic_epi32(a, m4, _mm512_and_si512(_mm512_slli_epi16(h, 4), m30), 0xEA);
          codes[1] = _mm512_ternarylogic_epi32(c, m4, _mm512_and_si512(_mm512_slli_epi16(h, 2), m30), 0xEA);
          codes[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 4), m4, _mm512_and_si512(h, m30), 0xEA);
          codes[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(c, 4), m4, _mm512_and_si512(_mm512_srli_epi16(h, 2), m30), 0xEA);
#pragma GCC unroll 4
          for (int m = 0; m < MB; ++m)
            for (int q = 0; q < 4; ++q) sum[m][q] = dot4(sum[m][q], codes[q], x[b * xs + m].q + 128 * n + 32 * q + 4 * l4);
        }
        for (int q = 0; q < 4; ++q) {
          const int g = 8 * n + 2 * q + half;  // the 16 elements' scale
          const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (2 * n + half) * 832 + 768 + 16 * q)));
#pragma GCC unroll 4
          for (int m = 0; m < MB; ++m) {
            const __m512i centred = _mm512_sub_epi32(sum[m][q], _mm512_set1_epi32(32 * x[b * xs + m].bs[g]));
            ai[m] = _mm512_add_epi32(ai[m], _mm512_mullo_epi32(centred, sc));
          }
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 32 * b)));
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[m]), _mm512_mul_ps(d, _mm512_set1_ps(x[b * xs + m].d)), acc[m]);
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

// the same for an IQ4_XS panel: codes looked up (vpshufb) as level + 128, each 32's sum less 128 x the activations'
// sum, times the row's scale - 32 (vpmulld), a float multiply-add per block
template <int MB, bool L1>
inline void panel_iq4xs(const uint8_t* panel, int64_t nb, const XBlock* x, int64_t xs, float* out) {
  const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi32(3), m4d = _mm512_set1_epi32(0xF);
  alignas(16) uint8_t levels[16];
  for (int i = 0; i < 16; ++i) levels[i] = static_cast<uint8_t>(kIQ4Levels[i] + 128);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(levels)));
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = panel + b * (kIQ4Codes + 2048);
    prefetch_span(p, kIQ4Codes);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kIQ4D)));
    const __m512i low = _mm512_loadu_si512(p + kIQ4Low);  // scales_l: a dword per row
    const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kIQ4High)));
    __m512i ai[MB];
    for (int m = 0; m < MB; ++m) ai[m] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int ib = 0; ib < 8; ++ib) {
      const __m512i sc = _mm512_sub_epi32(
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(low, 8 * (ib / 2) + 4 * (ib % 2)), m4d),
                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * ib), m3), 4)),
          _mm512_set1_epi32(32));
      __m512i sum[MB];
      for (int m = 0; m < MB; ++m) sum[m] = _mm512_set1_epi32(-128 * x[b * xs + m].bs32[ib]);
#pragma GCC unroll 4
      for (int l4 = 0; l4 < 4; ++l4) {
        const __m512i v = load_run<L1>(p + kIQ4Codes + (ib * 4 + l4) * 64);
        const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, m4));
        const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
          sum[m] = dot4(sum[m], lo, x[b * xs + m].q + 32 * ib + 4 * l4);
          sum[m] = dot4(sum[m], hi, x[b * xs + m].q + 32 * ib + 16 + 4 * l4);
        }
      }
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) ai[m] = _mm512_add_epi32(ai[m], _mm512_mullo_epi32(sum[m], sc));
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[m]), _mm512_mul_ps(d, _mm512_set1_ps(x[b * xs + m].d)), acc[m]);
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

// the same for a Q2_K (Q3 false) or Q3_K panel: codes = 2 bits (Q3_K: | its hmask bit at 2, the value + 4); each
// 16's sum (|sum| <= 16 x 4 x 127: an int16) times its scale per lane by one vpdpwssd, a float multiply-add per
// block. Q3_K's offset of 4 is at the scale: each sum starts at -4 x the activations' sum. Q2_K's mins (the high
// nibbles of its scale bytes) are at dmin: (min, min) pairs against pairs of the activations' sums.
template <int MB, bool Q3, bool L1>
inline void panel_q23k(const uint8_t* panel, int64_t nb, const XBlock* x, int64_t xs, float* out) {
  constexpr int64_t kBlock = Q3 ? kQ3Block : kQ2Block, kCodes = Q3 ? kQ3Codes : kQ2Codes;
  const __m512i m3 = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4), m4d = _mm512_set1_epi32(0xF), m3d = _mm512_set1_epi32(3);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = panel + panel_head(Q3 ? Q3_K : Q2_K, nb) + b * kBlock;
    if constexpr (!Q3) prefetch_span(p + kQ2D, 64);
    // the scale bytes a dword per row: Q3_K's 12 (u[2] the top bits), Q2_K's 16
    __m512i u[4];
    // Q3_K in order: 27.5 lines a block, its d's half a line of the head, the 28th prefetched after odd blocks
    const uint8_t* at = Q3 ? panel + (kQ3Block + 32) * b : p;
    for (int w = 0; w < (Q3 ? 3 : 4); ++w) u[w] = load_run<L1>(p + 64 * w, at + 64 * w);
    if (Q3 && b % 2) prefetch_line<L1>(reinterpret_cast<const char*>(at) + kQ3Block + kPanelAhead);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(Q3 ? panel + 32 * b : p + kQ2D)));
    __m512i ai[MB];
    for (int m = 0; m < MB; ++m) ai[m] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {  // elements 128n + 32k + 16 half + (0 .. 15): sub-block 2 (4n + k) + half
        __m512i sum[MB][4];
        for (int m = 0; m < MB; ++m)
          for (int k = 0; k < 4; ++k)
            sum[m][k] = Q3 ? _mm512_set1_epi32(-4 * x[b * xs + m].bs[2 * (4 * n + k) + half]) : _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int l = 0; l < 4; ++l) {
          const int l4 = 4 * half + l;
          // in order (Q3_K): after the scales' 3 lines, the first half reads a code line and a high-bit line by turns
          const int64_t line = Q3 ? (n == 0 ? 3 + 2 * l4 : 19 + l4) : kCodes / 64 + 8 * n + l4;
          const __m512i qs = load_run<L1>(p + kCodes + (8 * n + l4) * 64, at + 64 * line);
          __m512i hm = _mm512_setzero_si512();
          if constexpr (Q3) hm = n == 0 ? load_run<L1>(p + kQ3High + l4 * 64, at + 64 * line + 64) : _mm512_loadu_si512(p + kQ3High + l4 * 64);
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k) {
            const int g = 4 * n + k;  // 32 elements: bits 2k of qs, bit g of hm
            __m512i c = _mm512_and_si512(k ? _mm512_srli_epi16(qs, 2 * k) : qs, m3);
            if constexpr (Q3) c = _mm512_mask_add_epi8(c, _mm512_test_epi8_mask(hm, _mm512_set1_epi8(static_cast<char>(1 << g))), c, four);
#pragma GCC unroll 4
            for (int m = 0; m < MB; ++m) sum[m][k] = dot4(sum[m][k], c, x[b * xs + m].q + 32 * g + 4 * l4);
          }
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const int i = 2 * (4 * n + k) + half;
          __m512i sc;
          if constexpr (Q3) {  // nibble i / 8 of byte i % 8, bits 2 (i / 4) of byte 8 + i % 4, less 32: the low word
            const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(u[(i % 8) / 4], 8 * (i % 4) + 4 * (i / 8)), m4d);
            const __m512i top = _mm512_and_si512(_mm512_srli_epi32(u[2], 8 * (i % 4) + 2 * (i / 4)), m3d);
            sc = _mm512_and_si512(_mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(top, 4)), _mm512_set1_epi32(32)), low16);
          } else {
            sc = _mm512_and_si512(_mm512_srli_epi32(u[i / 4], 8 * (i % 4)), m4d);
          }
#pragma GCC unroll 4
          for (int m = 0; m < MB; ++m) ai[m] = dot_pairs(ai[m], sum[m][k], sc);
        }
      }
    }
    if constexpr (Q3) {
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[m]), _mm512_mul_ps(d, _mm512_set1_ps(x[b * xs + m].d)), acc[m]);
    } else {
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kQ2Dmin)));
      __m512i mins[MB];
      for (int m = 0; m < MB; ++m) mins[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {  // mins of sub-blocks 2j, 2j + 1: the high nibbles of bytes 2j, 2j + 1
        const __m512i mn = _mm512_srli_epi16(scale_pairs(u[j / 2], 2 * (j % 2)), 4);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
          int32_t pair;
          std::memcpy(&pair, x[b * xs + m].bs + 2 * j, 4);
          mins[m] = dot_pairs(mins[m], mn, _mm512_set1_epi32(pair));
        }
      }
      add_block<MB>(acc, ai, mins, d, dmin, x + b * xs);
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

using PanelKernel = void (*)(const uint8_t*, int64_t, const XBlock*, int64_t, float*);

template <int MB, bool L1>
inline PanelKernel panel_kernel_of(int64_t type) {
  switch (type) {
    case Q4_K: return panel_k4<MB, false, L1>;
    case Q5_K: return panel_k4<MB, true, L1>;
    case Q6_K: return panel_q6k<MB, L1>;
    case IQ4_XS: return panel_iq4xs<MB, L1>;
    case Q2_K: return panel_q23k<MB, false, L1>;
    case Q3_K: return panel_q23k<MB, true, L1>;
  }
  return nullptr;
}

template <int MB>
inline PanelKernel panel_kernel_mb(int64_t type) {
  return kPanelL1 ? panel_kernel_of<MB, true>(type) : panel_kernel_of<MB, false>(type);
}

// out[m * 16 + r] = (row r of a Q4_0 panel: nb blocks of 32) . (activation row m0 + m of a, rounded per 32 as
// llama.cpp's Q8_0): per block, the codes' low nibbles (elements 4j ..) and high ones (16 + 4j ..) of each run j
// through vpdpbusd, the bias of 8 as -8 x the block's activation sum (a.start / 16, exact), then d dx per lane
template <int MB, bool L1>
inline void panel_q40(const uint8_t* panel, int64_t nb, const q8::Q8Acts& a, int64_t m0, float* out) {
  const __m512i m4 = _mm512_set1_epi8(0xF);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = panel + 32 * nb + b * kQ40Block;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 32 * b)));
    __m512i sum[MB];
    for (int m = 0; m < MB; ++m) sum[m] = _mm512_set1_epi32(a.start[(m0 + m) * nb + b] / 16);
    const uint8_t* at = panel + (kQ40Block + 32) * b;  // in order: 4.5 lines a block, its d's half a line of the head
    if (b % 2) prefetch_line<L1>(reinterpret_cast<const char*>(at) + kQ40Block + kPanelAhead);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = load_run<L1>(p + 64 * j, at + 64 * j);
      const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const int8_t* x = a.q.data() + (m0 + m) * a.K + 32 * b + 4 * j;
        sum[m] = dot4(dot4(sum[m], lo, x), hi, x + 16);
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum[m]), _mm512_set1_ps(a.d[(m0 + m) * nb + b])), d, acc[m]);
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

using Q40Kernel = void (*)(const uint8_t*, int64_t, const q8::Q8Acts&, int64_t, float*);
template <bool L1>
inline Q40Kernel panel_q40_of(int64_t mb) {
  switch (mb) {
    case 1: return panel_q40<1, L1>;
    case 2: return panel_q40<2, L1>;
    case 3: return panel_q40<3, L1>;
    default: return panel_q40<4, L1>;
  }
}

inline Q40Kernel panel_q40_kernel(int64_t mb) { return kPanelL1 ? panel_q40_of<true>(mb) : panel_q40_of<false>(mb); }

// activation rows are taken 4 at a time (more would spill the accumulators)
inline PanelKernel panel_kernel(int64_t type, int64_t mb) {
  switch (mb) {
    case 1: return panel_kernel_mb<1>(type);
    case 2: return panel_kernel_mb<2>(type);
    case 3: return panel_kernel_mb<3>(type);
    default: return panel_kernel_mb<4>(type);
  }
}

// The rows where `shares` contiguous runs of a matrix's rows (segments of different types) hold equal bytes: [shares + 1]
inline std::vector<int64_t> byte_shares(const Segments& seg, int64_t K, int64_t shares) {
  std::vector<int64_t> bytes(seg.S);  // a row's, per segment
  double total = 0;
  for (int64_t s = 0; s < seg.S; ++s) {
    const Layout l = layout(seg.type(s));
    bytes[s] = K / l.block * l.bytes;
    total += static_cast<double>(bytes[s]) * (seg.end(s) - seg.first(s));
  }
  std::vector<int64_t> cut(shares + 1, seg.rows);
  cut[0] = 0;
  double before = 0;  // bytes of the segments before s
  for (int64_t i = 1, s = 0; i < shares; ++i) {
    const double target = total * i / shares;
    while (s + 1 < seg.S && before + static_cast<double>(bytes[s]) * (seg.end(s) - seg.first(s)) < target)
      before += static_cast<double>(bytes[s]) * (seg.end(s) - seg.first(s)), ++s;
    cut[i] = std::min(seg.end(s), seg.first(s) + static_cast<int64_t>((target - before) / bytes[s] + 0.5));
  }
  return cut;
}

// Calls of up to this many activation rows take gemv_direct, kRows at a time (the server's batched decode, speculative
// verify passes, a chat turn's few new tokens): there it costs less than gemm_panels, which opens every weight tile
// once per call (a 7168 x 1024 gate_up on the Zen 5, 9 rows: Q4_K_M 0.54 -> 0.14 ms, IQ4_XS 0.44 -> 0.13; 16 rows:
// 0.65 -> 0.22, 0.52 -> 0.20). Up to 48 rows it was still faster (gate_up at 48: 0.64 against 0.87 ms), but the two
// paths round differently (Q6_K's offsets: one integer sum here, a float term there), and the parity tests' prompts
// of 17-48 tokens then part from llama.cpp's greedy text on its tiny random models: those stay with the GEMM they
// were checked on.
constexpr int64_t kDirectRows = 16;

// y [M, N] = xq (quantize_rows of x [M, K] in groups of kRows, M <= kDirectRows) @ W^T. Threads take contiguous runs
// of rows of equal bytes (a matrix may mix Q4_K and Q6_K rows; a panel goes to the thread whose run holds its first
// row); panels of 16 rows through the panel kernels, native rows through the row kernels, rows of 32-weight blocks
// (int8legacy.h) with x rounded per 32 (x8); each panel or row goes through every group of x while it is in L1.
inline void gemv_direct(const Segments& seg, const uint8_t* base, const XBlock* xq, const q8::Q8Acts& x8, int64_t M,
                        int64_t K, float* y) {
  const int64_t nb = K / 256, N = seg.rows;
  const int64_t grain = std::max<int64_t>(16, (64 << 10) / (nb * 144) / 16 * 16);  // a share of at least ~64 KB
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / grain));
  const std::vector<int64_t> cut = byte_shares(seg, K, shares);
  std::vector<q8::Q8Acts> x8g;  // x8's groups of kRows rows
  for (int64_t g = 0; g < M && x8.M; g += kRows) x8g.push_back(x8.rows(g, std::min<int64_t>(kRows, M - g)));
  at::parallel_for(0, shares, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t lo = cut[i], hi = cut[i + 1];
      const ShareClock clock(hi - lo);
      for (int64_t s = seg.find(lo); s < seg.S && seg.first(s) < hi; ++s) {
        const int64_t type = seg.type(s), first = seg.first(s), pend = first + seg.panel_rows(s), end = std::min(hi, seg.end(s));
        for (int64_t n = first + (std::max(lo, first) - first + kPanel - 1) / kPanel * kPanel; n < std::min(hi, pend); n += kPanel) {
          const uint8_t* panel = seg.row(base, s, n, K);
          for (int64_t g = 0; g < M; g += kRows) {
            const int64_t rows = std::min<int64_t>(kRows, M - g);
            for (int64_t m0 = 0; m0 < rows; m0 += 4) {
              const int64_t mb = std::min<int64_t>(4, rows - m0);
              alignas(64) float out[4 * kPanel];
              if (type == Q4_0) panel_q40_kernel(mb)(panel, K / 32, x8, g + m0, out);
              else panel_kernel(type, mb)(panel, nb, xq + g * nb + m0, rows, out);
              for (int64_t m = 0; m < mb; ++m) std::memcpy(y + (g + m0 + m) * N + n, out + m * kPanel, kPanel * sizeof(float));
            }
          }
        }
        const int64_t from = std::max(lo, pend);
        if (q8::block32(type) && from < end) {  // a run of rows a call
          for (int64_t g = 0; g < M; g += kRows)
            q8::rows32_run(type, std::min<int64_t>(kRows, M - g), seg.row(base, s, from, K), end - from,
                           K / 32 * layout(type).bytes, x8g[g / kRows], y + g * N + from, N);
          continue;
        }
        for (int64_t n = from; n < end; ++n)
          for (int64_t g = 0; g < M; g += kRows) {
            const int64_t rows = std::min<int64_t>(kRows, M - g);
            float sums[kRows];
            row_kernel(type, rows)(seg.row(base, s, n, K), nb, xq + g * nb, sums);
            for (int64_t m = 0; m < rows; ++m) y[(g + m) * N + n] = sums[m];
          }
      }
    }
  });
}
#else
constexpr bool kDirectGemv = false;
constexpr int64_t kDirectRows = kRows;
inline void gemv_direct(const Segments&, const uint8_t*, const XBlock*, const q8::Q8Acts&, int64_t, int64_t, float*) {}
#endif

}  // namespace kq
}  // namespace deltaserve

