// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL weights (blocks of 32) by integer dot products on AVX2, for CPUs without
// AVX-512 VNNI (AMD Zen 2 and 3, Intel's client cores, Skylake-SP Xeons), with activations rounded per 32 (q8acts.h):
// the arithmetic llama.cpp runs on these files there. Where AVX-512 VNNI is built, int8q8.h and int8legacy.h take them.
//
// A block's 32 codes open into signed bytes c: q - 8 (Q4_0), q - 16 (Q5_0), q (the _1 types, whose offset m adds
// m dx sum(qx) per block), Q8_0's own, IQ4_NL's levels (looked up by vpshufb). vpmaddubsw multiplies unsigned by
// signed bytes, so |c| goes in unsigned and the activations take c's sign (vpsignb): a pair of products is at most
// 2 x 128 x 127, inside int16 (an offset code, c + 128, would not be); vpmaddwd (or AVX-VNNI's vpdpbusd) sums 4
// products into each of 8 int32 lanes, exactly. Per block and activation row the lanes take d dx in float. (The
// prefill's tiles hold the 4- and 5-bit types' codes unsigned instead: kBias32.)
//
// Decode reads a row's blocks where they lie, up to 8 activation rows a pass; the prefill's tiles are
// int8tiles32_avx2.h's.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv.h"
#include "kquants.h"
#include "q8acts.h"

namespace deltaserve {
namespace q8 {

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#define DELTASERVE_BLOCK32_AVX2 1
constexpr bool kBlock32Avx2 = true;
constexpr int64_t kRows32 = 8;  // activation rows a pass: 8 float accumulators, the codes and their magnitudes

// a block of 32 weights: its codes as signed bytes (element order), d, and the _1 types' m
struct Block32 {
  __m256i c;
  float d, m;
};

// a Q5 block's fifth bits (bit j of the little-endian u32 at qh: element j) as 0x10 in byte j
inline __m256i fifth_bits(const uint8_t* qh) {
  int32_t h;
  std::memcpy(&h, qh, 4);
  // byte j takes byte j / 8 of h (vpshufb within each 128-bit half, where h is broadcast), then keeps bit j % 8
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(h), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

template <int64_t TYPE>
constexpr int64_t kBytes32 = TYPE == kq::Q8_0 ? 34 : TYPE == kq::Q4_0 || TYPE == kq::IQ4_NL ? 18 : TYPE == kq::Q4_1 ? 20
                             : TYPE == kq::Q5_0 ? 22 : 24;

// what the prefill tiles multiply for TYPE: the 4- and 5-bit types their codes q unsigned (the bias, 8 or 16, taken
// off once per block as bias x sum(qx)), whose products in pairs stay small enough (at most 2 x 31 x 127) that 4
// vpmaddubsw results are summed in int16 before one vpmaddwd widens them (Q4_0 at 512 x 1024 x 3584: 223 -> 264
// GOP/s against a vpmaddwd a step). Q8_0's codes and IQ4_NL's levels stay signed (vpsignb).
template <int64_t TYPE>
constexpr int kBias32 = TYPE == kq::Q4_0 ? 8 : TYPE == kq::Q5_0 ? 16 : 0;

// a file's block of TYPE at b: d f16 | (_1: m f16) | (Q5: qh[4]) | qs[16] (element j low nibble of byte j, 16 + j
// its high nibble); Q8_0: d f16 | 32 int8; IQ4_NL: d f16 | qs[16] as Q4_0's, each nibble a level's index.
// UNSIGNED: the 4- and 5-bit types' codes q, before their bias.
template <int64_t TYPE, bool UNSIGNED = false>
inline Block32 open_block32(const uint8_t* b) {
  if constexpr (TYPE == kq::Q8_0) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), kq::half(b), 0.f};
  } else if constexpr (TYPE == kq::IQ4_NL) {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0xF));
    const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kq::kIQ4Levels));
    return {_mm256_shuffle_epi8(_mm256_set_m128i(levels, levels), q), kq::half(b), 0.f};
  } else {
    constexpr bool one = TYPE == kq::Q4_1 || TYPE == kq::Q5_1, five = TYPE == kq::Q5_0 || TYPE == kq::Q5_1;
    constexpr int qh_at = one ? 4 : 2, qs_at = qh_at + (five ? 4 : 0);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qs_at));
    __m256i c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0xF));
    if (five) c = _mm256_or_si256(c, fifth_bits(b + qh_at));
    if (!UNSIGNED && !one) c = _mm256_sub_epi8(c, _mm256_set1_epi8(kBias32<TYPE>));
    return {c, kq::half(b), one ? kq::half(b + 2) : 0.f};
  }
}

// sum + 8 int32 lanes, each the sum of 4 products of signed bytes c and x (mag = |c|)
inline __m256i add_dot32(__m256i sum, __m256i c, __m256i mag, __m256i x) {
  const __m256i sx = _mm256_sign_epi8(x, c);  // x with c's sign (0 where c is 0, whose product is 0 anyway)
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(sum, mag, sx);
#else
  return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(mag, sx), _mm256_set1_epi16(1)));
#endif
}

inline __m256i dot32(__m256i c, __m256i mag, __m256i x) { return add_dot32(_mm256_setzero_si256(), c, mag, x); }

inline float sum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// out[m] = a row . activation row m0 + m of a (m < MB), its block k from open(k); ONE: the _1 types' offsets
template <int MB, bool ONE, class Open>
inline void dot_row32(const Q8Acts& a, int64_t m0, Open&& open, float* out) {
  __m256 acc[MB];
  float off[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps(), off[m] = 0.f;
  for (int64_t k = 0; k < a.nb; ++k) {
    const Block32 w = open(k);
    const __m256i mag = _mm256_sign_epi8(w.c, w.c);  // |c|: -128 (Q8_0 only) stays 0x80, 128 unsigned
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const int64_t at = (m0 + m) * a.nb + k;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m0 + m) * a.K + 32 * k));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(w.c, mag, x)), _mm256_set1_ps(w.d * a.d[at]), acc[m]);
      if (ONE) off[m] += w.m * a.d[at] * static_cast<float>(-a.start[at] / 128);  // start = -128 sum(qx), exactly
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = sum8(acc[m]) + off[m];
}

template <bool ONE, class Open>
inline void dot_rows32(int64_t mb, const Q8Acts& a, int64_t m0, Open&& open, float* out) {
  switch (mb) {
    case 1: return dot_row32<1, ONE>(a, m0, open, out);
    case 2: return dot_row32<2, ONE>(a, m0, open, out);
    case 3: return dot_row32<3, ONE>(a, m0, open, out);
    case 4: return dot_row32<4, ONE>(a, m0, open, out);
    case 5: return dot_row32<5, ONE>(a, m0, open, out);
    case 6: return dot_row32<6, ONE>(a, m0, open, out);
    case 7: return dot_row32<7, ONE>(a, m0, open, out);
    default: return dot_row32<kRows32, ONE>(a, m0, open, out);
  }
}

// out[m] = a Q8_0 matrix's row (int8 codes w [K], float16 scales ws [K / 32]) . activation row m0 + m of a (m < mb)
inline void q8_rows(int64_t mb, const int8_t* w, const at::Half* ws, const Q8Acts& a, int64_t m0, float* out) {
  dot_rows32<false>(mb, a, m0, [&](int64_t k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 32 * k) + kGemvPrefetch, _MM_HINT_T0);
    return Block32{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * k)), static_cast<float>(ws[k]), 0.f};
  }, out);
}

// y[m * ldy + r] = (row r of `rows` of TYPE, row_bytes apart) . activation row m of a (m < MB): a
// run of rows, one call (a call and two switches a row had cost IQ4_NL's decode rows a tenth of their time)
template <int64_t TYPE, int MB>
void file_run32(const uint8_t* row, int64_t rows, int64_t row_bytes, const Q8Acts& a, float* y, int64_t ldy) {
  constexpr bool one = TYPE == kq::Q4_1 || TYPE == kq::Q5_1;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* w = row + r * row_bytes;
    float sums[MB];
    dot_row32<MB, one>(a, 0, [&](int64_t k) {
      const uint8_t* b = w + kBytes32<TYPE> * k;
      _mm_prefetch(reinterpret_cast<const char*>(b) + kGemvPrefetch, _MM_HINT_T0);
      return open_block32<TYPE>(b);
    }, sums);
    for (int m = 0; m < MB; ++m) y[m * ldy + r] = sums[m];
  }
}

using Run32 = void (*)(const uint8_t*, int64_t, int64_t, const Q8Acts&, float*, int64_t);

template <int64_t TYPE>
inline Run32 file_run32_of(int64_t M) {
  switch (M) {
    case 1: return file_run32<TYPE, 1>;
    case 2: return file_run32<TYPE, 2>;
    case 3: return file_run32<TYPE, 3>;
    case 4: return file_run32<TYPE, 4>;
    case 5: return file_run32<TYPE, 5>;
    case 6: return file_run32<TYPE, 6>;
    case 7: return file_run32<TYPE, 7>;
    default: return file_run32<TYPE, kRows32>;
  }
}

// y[m * ldy + r] = (row r of `rows` of a file, row_bytes apart) . activation row m of a, m < M <= kRows32, a block a
// vector: the AVX2 build's decode of Q8_0 rows, the Skylake-SP build's (AVX-512 BW, no VNNI) gemv_direct
inline void rows32_run(int64_t type, int64_t M, const uint8_t* row, int64_t rows, int64_t row_bytes, const Q8Acts& a,
                       float* y, int64_t ldy) {
  Run32 run = nullptr;
  switch (type) {
    case kq::Q8_0: run = file_run32_of<kq::Q8_0>(M); break;
    case kq::Q4_0: run = file_run32_of<kq::Q4_0>(M); break;
    case kq::Q4_1: run = file_run32_of<kq::Q4_1>(M); break;
    case kq::Q5_0: run = file_run32_of<kq::Q5_0>(M); break;
    case kq::Q5_1: run = file_run32_of<kq::Q5_1>(M); break;
    case kq::IQ4_NL: run = file_run32_of<kq::IQ4_NL>(M); break;
    default: TORCH_CHECK(false, "rows32_run: GGML type ", type, " is not of 32-weight blocks");
  }
  run(row, rows, row_bytes, a, y, ldy);
}

// -- decode of Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL rows, two blocks a vector -----------------------------------------
// Their codes go in unsigned (q, not q - bias: no vpsignb), two blocks' halves side by side: lo holds elements 0..15
// of blocks 2P and 2P + 1 (128-bit halves), hi their elements 16..31, against the activations laid out to match
// (XPair a, b). The bias (8 or 16) comes off each int32 lane as bias x its 8 activations' sum, and the _1 types'
// m x that sum goes in beside d x the lane. IQ4_NL's codes index signed levels (up to 127 in size, so no bias
// keeps a pair inside int16): |level| x the activations given the level's sign. A run of rows a call. (Before: a
// block a vector, its codes signed, a call a row: 36-57% of a read beside on the AMX Xeon's x86-64-v3 build; Q4_0
// now 86-90%.)

// activation row pairs of blocks 2P, 2P + 1: a = elements 0..15 of each, b = 16..31; sum: the activations' sum over
// the elements each int32 lane of vpmaddwd(lo . a + hi . b) covers (lane j < 4: block 2P's 4j .. 4j + 3 and
// 16 + 4j .. 16 + 4j + 3; lanes 4..7 block 2P + 1's); dx: each block's d 4 times
struct alignas(64) XPair {
  int8_t a[32], b[32];
  int32_t sum[8];
  float dx[8];
};

// a's rows as XPairs [M][nb / 2] (an odd last block stays in a)
inline void pair_up(const Q8Acts& a, std::vector<XPair>& out) {
  const int64_t np = a.nb / 2;
  if (static_cast<int64_t>(out.size()) < a.M * np) out.resize(a.M * np);
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t P = 0; P < np; ++P) {
      XPair& x = out[m * np + P];
      for (int h = 0; h < 2; ++h) {
        const int8_t* q = a.q.data() + m * a.K + 32 * (2 * P + h);
        std::memcpy(x.a + 16 * h, q, 16);
        std::memcpy(x.b + 16 * h, q + 16, 16);
        for (int j = 0; j < 4; ++j) {
          x.sum[4 * h + j] = 0;
          for (int e = 0; e < 4; ++e) x.sum[4 * h + j] += q[4 * j + e] + q[16 + 4 * j + e];
          x.dx[4 * h + j] = a.d[m * a.nb + 2 * P + h];
        }
      }
    }
}

inline bool pairs_decode(int64_t type) {
  return type == kq::Q4_0 || type == kq::Q4_1 || type == kq::Q5_0 || type == kq::Q5_1 || type == kq::IQ4_NL;
}

// the float16 values at b and b + step as [4 x b's | 4 x b + step's]
inline __m256 two_halves(const uint8_t* b, int64_t step) {
  uint16_t h0, h1;
  std::memcpy(&h0, b, 2);
  std::memcpy(&h1, b + step, 2);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int32_t>(h0 | uint32_t{h1} << 16)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// the fifth bits of two Q5 blocks (qh at b and b + step), 0x10 in byte j of each 128-bit half for its block's
// element j + 16 * upper (upper: the hi vector's elements 16..31)
inline __m256i two_fifths(const uint8_t* b, int64_t step, bool upper) {
  int32_t h0, h1;
  std::memcpy(&h0, b, 4);
  std::memcpy(&h1, b + step, 4);
  const __m256i h = _mm256_set_m128i(_mm_cvtsi32_si128(h1), _mm_cvtsi32_si128(h0));
  const char u = upper ? 2 : 0, v = upper ? 3 : 1;  // byte j takes byte (16 upper + j) / 8 of its half's qh
  const __m256i spread = _mm256_shuffle_epi8(h, _mm256_setr_epi8(u, u, u, u, u, u, u, u, v, v, v, v, v, v, v, v,
                                                                 u, u, u, u, u, u, u, u, v, v, v, v, v, v, v, v));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// y[m * ldy + r] = (row r of `rows` of TYPE, row_bytes apart) . (activation row m0 + m), m < MB
template <int64_t TYPE, int MB>
void rows_pairs(const uint8_t* row0, int64_t rows, int64_t row_bytes, const Q8Acts& a, const XPair* pairs, int64_t m0,
                float* y, int64_t ldy) {
  constexpr bool one = TYPE == kq::Q4_1 || TYPE == kq::Q5_1, five = TYPE == kq::Q5_0 || TYPE == kq::Q5_1;
  constexpr bool nl = TYPE == kq::IQ4_NL;
  constexpr int64_t bytes = kBytes32<TYPE>, qh_at = one ? 4 : 2, qs_at = qh_at + (five ? 4 : 0);
  constexpr int bias_shift = TYPE == kq::Q4_0 ? 3 : 4;  // x 8, x 16 (the _1 types have none)
  const int64_t nb = a.nb, np = nb / 2;
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kq::kIQ4Levels)));
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = row0 + r * row_bytes;
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t P = 0; P < np; ++P) {
      const uint8_t* b = row + 2 * bytes * P;
      _mm_prefetch(reinterpret_cast<const char*>(b) + kGemvPrefetch, _MM_HINT_T0);
      const __m256 dw = two_halves(b, bytes), mw = one ? two_halves(b + 2, bytes) : _mm256_setzero_ps();
      const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qs_at))),
                                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + bytes + qs_at)), 1);
      __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if constexpr (five) {
        lo = _mm256_or_si256(lo, two_fifths(b + qh_at, bytes, false));
        hi = _mm256_or_si256(hi, two_fifths(b + qh_at, bytes, true));
      }
      __m256i lo_mag = lo, hi_mag = hi;
      if constexpr (nl) {  // the levels, signed; their magnitudes go in unsigned, their signs to the activations
        lo = _mm256_shuffle_epi8(levels, lo), hi = _mm256_shuffle_epi8(levels, hi);
        lo_mag = _mm256_abs_epi8(lo), hi_mag = _mm256_abs_epi8(hi);
      }
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const XPair& x = pairs[(m0 + m) * np + P];
        const __m256i xa = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.a));
        const __m256i xb = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.b));
        const __m256i sum = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.sum));
        const __m256i start = one || nl ? _mm256_setzero_si256() : _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sum, bias_shift));
        __m256i dot;
        if constexpr (nl) {  // signed levels: |level| x the activations given the level's sign
          dot = add_dot32(dot32(lo, lo_mag, xa), hi, hi_mag, xb);
        } else {
#if defined(__AVXVNNI__)
          dot = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(start, lo, xa), hi, xb);
#else  // a pair of products at most 2 x 31 x 128: lo's and hi's pairs add up inside int16
          dot = _mm256_add_epi32(
              start, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb)), _mm256_set1_epi16(1)));
#endif
        }
        const __m256 dx = _mm256_load_ps(x.dx);
        if constexpr (one)  // (d dot + m sum) dx
          acc[m] = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dw, _mm256_mul_ps(mw, _mm256_cvtepi32_ps(sum))), dx, acc[m]);
        else
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, dx), acc[m]);
      }
    }
    float off[MB] = {};
    if (nb % 2) {  // the last block alone, as dot_row32 takes it
      const Block32 w = open_block32<TYPE>(row + bytes * (nb - 1));
      const __m256i mag = _mm256_sign_epi8(w.c, w.c);
      for (int m = 0; m < MB; ++m) {
        const int64_t at = (m0 + m) * nb + nb - 1;
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m0 + m) * a.K + 32 * (nb - 1)));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(w.c, mag, x)), _mm256_set1_ps(w.d * a.d[at]), acc[m]);
        if (one) off[m] = w.m * a.d[at] * static_cast<float>(-a.start[at] / 128);  // start = -128 sum(qx), exactly
      }
    }
    for (int m = 0; m < MB; ++m) y[m * ldy + r] = sum8(acc[m]) + off[m];
  }
}

using PairRows = void (*)(const uint8_t*, int64_t, int64_t, const Q8Acts&, const XPair*, int64_t, float*, int64_t);

template <int64_t TYPE>
inline PairRows pair_rows_of(int64_t mb) {
  switch (mb) {
    case 1: return rows_pairs<TYPE, 1>;
    case 2: return rows_pairs<TYPE, 2>;
    case 3: return rows_pairs<TYPE, 3>;
    default: return rows_pairs<TYPE, 4>;
  }
}

// the kernel for a pairs_decode type and mb <= 4 activation rows
inline PairRows pair_rows_kernel(int64_t type, int64_t mb) {
  switch (type) {
    case kq::Q4_0: return pair_rows_of<kq::Q4_0>(mb);
    case kq::Q4_1: return pair_rows_of<kq::Q4_1>(mb);
    case kq::Q5_0: return pair_rows_of<kq::Q5_0>(mb);
    case kq::IQ4_NL: return pair_rows_of<kq::IQ4_NL>(mb);
    default: return pair_rows_of<kq::Q5_1>(mb);
  }
}
#else
constexpr bool kBlock32Avx2 = false;
#endif

}  // namespace q8
}  // namespace deltaserve
