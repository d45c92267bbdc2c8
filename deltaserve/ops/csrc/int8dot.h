// Integer dot products for K-quant weights (Q4_K, Q5_K, Q6_K), the arithmetic llama.cpp uses on these files:
// the activations are rounded per 256 to int8 with one float scale (llama.cpp's Q8_K: int8 q, scale d, int16
// sums per 16), each weight block is opened once into unsigned 8-bit codes with int16 scales and offsets per 16
// weights, and code x activation products are summed in integers (vpmaddubsw: u8 x s8 pairs to int16, then
// vpdpwssd / vpmaddwd: times the scale, to int32), a float multiply-add per block and row.
//
//   block . x  =  d_w d_x sum_i sc_i sum_(e in i) code_e q_e  -  o_w d_x sum_i off_i bsum_i      (i: groups of 16)
//
// Q4_K / Q5_K: sc = 6-bit scale, off = 6-bit min, o_w = dmin; Q6_K: code = the stored 6 bits (0..63, the value's
// q - 32 plus 32), off = 32 sc, o_w = d.
// The ISA (AVX-512 BW with or without VNNI, AVX2 with or without AVX-VNNI, portable C++) is the build's:
// ops/fused.py compiles for the CPU it runs on (-march=native, cached per CPU flags).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv.h"
#include "kquants.h"

namespace deltaserve {
namespace kq {

// one weight block opened: codes in element order, int16 scale and offset per 16 elements
struct alignas(64) WBlock {
  uint8_t q[256];
  int16_t sc[16], off[16];
  float d, o;
};

// one row's 256 activations rounded to int8 (Q8_K): x ~ d * q; bs[i] = sum of q over elements 16i .. 16i + 15,
// bs32[i] over 32i .. 32i + 31. qp: q in the order the build's decode GEMV opens its codes. With AVX-512 BW, that
// of Q4_K / Q5_K codes as one 64-byte load of their nibbles opens them (int8gemv.h): per 128 elements, quarters 0, 2
// (the low nibbles), then 1, 3 (the high ones). On AVX2, that of IQ4_XS's 32 bytes of nibbles (int8gemv_avx2.h):
// per 64 elements, sixteens 0, 2 (the low nibbles of sub-blocks 2k, 2k + 1), then 1, 3; and qa = |qp| beside it.
// (The portable build reads neither.)
struct alignas(64) XBlock {
  int8_t q[256];
  int8_t qp[256];
#if defined(__AVX2__) && !defined(__AVX512BW__)
  uint8_t qa[256];
#endif
  int16_t bs[16];
  int16_t bs32[8];
  float d;
};

#if defined(__AVX512BW__)
// acc += codes (u8, 16 rows x 4) . the 4 int8 at p, broadcast by vpdpbusd's memory operand (a separate broadcast
// would take a shuffle slot per instruction)
inline __m512i dot4(__m512i acc, __m512i codes, const int8_t* p) {
#if defined(__AVX512VNNI__)
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
#else
  int32_t four;
  std::memcpy(&four, p, 4);
  const __m512i pairs = _mm512_maddubs_epi16(codes, _mm512_set1_epi32(four));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}

// Register helpers for the panel GEMM (int8gemm.h panel_rows). Left to itself GCC keeps one zero register and copies
// it into each group's sums, and puts each new block sum in another register and copies it back: 30 vector moves per
// 50 products and scalings, which took issue slots (Q4_K scaled per 16 ran 0.96-0.99x the vpmulld per 32 with them).
inline __m512i fresh_zero() {  // a zeroing idiom of its own (volatile: not merged with the others into one and copied)
  __m512i z;
  asm volatile("vpxord %0, %0, %0" : "=v"(z));
  return z;
}

#if defined(__AVX512VNNI__)
inline void add_scaled16(__m512i& acc, __m512i sums, __m512i sc) {  // acc += sums' low halves x sc's (vpdpwssd)
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(sums), "v"(sc));
}
#endif

inline void add_to(__m512i& acc, __m512i v) { asm("vpaddd %1, %0, %0" : "+v"(acc) : "v"(v)); }

constexpr int kRows = 8;  // activation rows per pass over a weight row: int32 + float accumulators in registers
#else
constexpr int kRows = 4;  // 16 ymm registers
#endif

// IQ4_XS's codes: where vpdpbusd runs (AVX-512 VNNI: its panels), its levels + 128 (up to 241) with an offset of
// 128 x its scale; elsewhere the levels themselves, signed (|level| <= 127), which the AVX2 kernels multiply as
// llama.cpp does (|code| unsigned, the activations with the code's sign): + 128 would pass int16 in vpmaddubsw's pairs.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kIQ4Signed = false;
#else
constexpr bool kIQ4Signed = true;
#endif
inline bool signed_codes(int64_t type) { return kIQ4Signed && type == IQ4_XS; }

// Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and Q8_0 (beside others: a MoE Q4_K_M file's attention inputs) take int8legacy.h's
// kernels, built with VNNI, or int8legacy_avx2.h's
#if defined(__AVX2__) || (defined(__AVX512VNNI__) && defined(__AVX512BW__))
constexpr bool kBlock32Int8 = true;
#else
constexpr bool kBlock32Int8 = false;
#endif

inline bool int8_type(int64_t type) {
  return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS ||
         (kBlock32Int8 &&
          (type == Q8_0 || type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == IQ4_NL));
}

inline float half(const uint8_t* p) {
#if defined(__F16C__)
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
#else
  return f16(p);
#endif
}

// -- activations -----------------------------------------------------------------------------------

inline void quantize_block(const float* x, XBlock& out) {
#if defined(__AVX512F__)
  __m512 amax = _mm512_setzero_ps();
  for (int c = 0; c < 16; ++c) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * c)));
  const float a = _mm512_reduce_max_ps(amax);
  const __m512 is = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
  for (int c = 0; c < 16; ++c) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * c), is));  // nearest
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + 16 * c), _mm512_cvtepi32_epi8(q));
    out.bs[c] = static_cast<int16_t>(_mm512_reduce_add_epi32(q));
  }
#else
  float a = 0.f;
  for (int e = 0; e < 256; ++e) a = std::max(a, std::fabs(x[e]));
  const float is = a > 0.f ? 127.f / a : 0.f;
  for (int c = 0; c < 16; ++c) {
    int s = 0;
    for (int e = 16 * c; e < 16 * c + 16; ++e) s += out.q[e] = static_cast<int8_t>(std::nearbyint(x[e] * is));
    out.bs[c] = static_cast<int16_t>(s);
  }
#endif
  out.d = a / 127.f;
#if defined(__AVX512BW__)
  for (int h = 0; h < 2; ++h)
    for (int quarter = 0; quarter < 4; ++quarter)
      std::memcpy(out.qp + 128 * h + 32 * quarter, out.q + 128 * h + 32 * ((quarter % 2) * 2 + quarter / 2), 32);
#elif defined(__AVX2__)
  for (int e = 0; e < 256; e += 16) {
    const int s = e % 64 / 16;  // sixteen s of its 64 at position 0, 2, 1, 3
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(out.q + e - 16 * s + 16 * (s % 2 * 2 + s / 2)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.qp + e), v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.qa + e), _mm_abs_epi8(v));  // -128 as 128, unsigned
  }
#endif
  for (int i = 0; i < 8; ++i) out.bs32[i] = static_cast<int16_t>(out.bs[2 * i] + out.bs[2 * i + 1]);
}

// x [M, K] (rows ldx floats apart) as XBlocks into out [M * K / 256], rows in groups of `group` (kRows; the VNNI panel GEMM's kPanelRows),
// fewer in the last, each group [K / 256][rows]: a group's rows for one weight block lie together.
// where row m's block b lies in that layout
inline int64_t xblock_at(int64_t M, int64_t nb, int64_t m, int64_t b, int64_t group = kRows) {
  const int64_t g = m / group * group, rows = std::min<int64_t>(group, M - g);
  return g * nb + b * rows + m - g;
}

inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, XBlock* out, int64_t group = kRows) {
  const int64_t nb = K / 256;
  at::parallel_for(0, M, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m)
      for (int64_t b = 0; b < nb; ++b) quantize_block(x + m * ldx + 256 * b, out[xblock_at(M, nb, m, b, group)]);
  });
}

// -- weight blocks ---------------------------------------------------------------------------------

// the 8 scales and 8 mins of a Q4_K / Q5_K block, a byte each of two words (ggml's get_scale_min_k4 for all at once,
// on 32-bit words), in registers
inline void k4_scale_words(const uint8_t* packed, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  std::memcpy(u, packed, 12);
  const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  sc = (u[0] & m6) | static_cast<uint64_t>((u[2] & m4) | (((u[0] >> 6) & m2) << 4)) << 32;
  mn = (u[1] & m6) | static_cast<uint64_t>(((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4)) << 32;
}

// the same as bytes: each array written by one 8-byte store, so that an 8-byte load of it is forwarded from the store
// (where GCC had written 4 bytes at a time, each block's load of them waited for the stores to retire: the AVX2
// decode GEMVs of Q4_K rows ran at half their rate)
inline void k4_scales(const uint8_t* packed, uint8_t* sc, uint8_t* mn) {
  uint64_t s, m;
  k4_scale_words(packed, s, m);
  std::memcpy(sc, &s, 8);
  std::memcpy(mn, &m, 8);
}

// sc / off per 16 elements from 8 values per 32 (each twice)
inline void per16(const uint8_t* v32, int16_t* v16) {
#if defined(__AVX2__)
  uint64_t eight;
  std::memcpy(&eight, v32, 8);
  const __m128i v = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(eight)));
  _mm_store_si128(reinterpret_cast<__m128i*>(v16), _mm_unpacklo_epi16(v, v));
  _mm_store_si128(reinterpret_cast<__m128i*>(v16 + 8), _mm_unpackhi_epi16(v, v));
#else
  for (int i = 0; i < 16; ++i) v16[i] = v32[i / 2];
#endif
}

// Q4_K / Q5_K (hbits: Q5_K's 32 bytes of fifth bits, or null)
inline void open_k4(const uint8_t* b, const uint8_t* qs, const uint8_t* hbits, WBlock& w) {
  uint8_t sc[8], mn[8];
  k4_scales(b + 4, sc, mn);
  per16(sc, w.sc);
  per16(mn, w.off);
  w.d = half(b);
  w.o = half(b + 2);
#if defined(__AVX2__)
  const __m256i m4 = _mm256_set1_epi8(0xF), bit4 = _mm256_set1_epi8(0x10);
  const __m256i hb = hbits ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hbits)) : _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    // bit 2j (2j + 1) of each hbits byte to bit 4: the shifts move whole 16-bit words, the mask keeps the byte's own
    const __m256i h0 = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hb, 2 * j), 4), bit4);
    const __m256i h1 = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hb, 2 * j + 1), 4), bit4);
    _mm256_store_si256(reinterpret_cast<__m256i*>(w.q + 64 * j), _mm256_or_si256(_mm256_and_si256(v, m4), h0));
    _mm256_store_si256(reinterpret_cast<__m256i*>(w.q + 64 * j + 32),
                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), h1));
  }
#else
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      const int h = hbits ? hbits[l] >> (2 * j) : 0;
      w.q[64 * j + l] = (qs[32 * j + l] & 0xF) | ((h & 1) << 4);
      w.q[64 * j + 32 + l] = (qs[32 * j + l] >> 4) | (((h >> 1) & 1) << 4);
    }
#endif
}

// Q6_K: ql[128] | qh[64] | scales int8[16] | d; codes kept as q + 32 (0..63), offset 32 sc
inline void open_q6_k(const uint8_t* b, WBlock& w) {
#if defined(__AVX2__)
  const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  _mm256_store_si256(reinterpret_cast<__m256i*>(w.sc), sc);
  _mm256_store_si256(reinterpret_cast<__m256i*>(w.off), _mm256_slli_epi16(sc, 5));
#else
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int i = 0; i < 16; ++i) {
    w.sc[i] = sc[i];
    w.off[i] = static_cast<int16_t>(32 * sc[i]);
  }
#endif
  w.d = w.o = half(b + 208);
  for (int n = 0; n < 2; ++n) {
    const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
    uint8_t* q = w.q + 128 * n;
#if defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    auto put = [&](int at, __m256i low, __m256i high) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + at), _mm256_or_si256(_mm256_and_si256(low, m4), _mm256_and_si256(high, m30)));
    };
    put(0, l0, _mm256_slli_epi16(h, 4));
    put(32, l1, _mm256_slli_epi16(h, 2));
    put(64, _mm256_srli_epi16(l0, 4), h);
    put(96, _mm256_srli_epi16(l1, 4), _mm256_srli_epi16(h, 2));
#else
    for (int l = 0; l < 32; ++l) {
      q[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
      q[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
      q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
      q[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) << 4);
    }
#endif
  }
}

// IQ4_XS: d f16 | scales_h u16 | scales_l[4] | qs[128]; codes = level + 128, scale = 6-bit scale - 32 per 32
// (twice per 16), offset 128 scale (kIQ4Signed: codes = the levels' bytes, offset 0)
inline void open_iq4_xs(const uint8_t* b, WBlock& w) {
  constexpr int bias = kIQ4Signed ? 0 : 128;
  for (int ib = 0; ib < 8; ++ib) {
    const int sc = iq4xs_scale(b, ib);
    w.sc[2 * ib] = w.sc[2 * ib + 1] = static_cast<int16_t>(sc);
    w.off[2 * ib] = w.off[2 * ib + 1] = static_cast<int16_t>(bias * sc);
#if defined(__AVX2__)
    // the 32 nibbles (low ones elements 0..15, high ones 16..31) looked up in the levels (vpshufb per 128-bit half)
    const __m256i levels = _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Levels))),
                                           _mm256_set1_epi8(static_cast<char>(bias)));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8 + 16 * ib));
    const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0xF));
    _mm256_store_si256(reinterpret_cast<__m256i*>(w.q + 32 * ib), _mm256_shuffle_epi8(levels, nibbles));
#else
    for (int j = 0; j < 16; ++j) {
      w.q[32 * ib + j] = static_cast<uint8_t>(kIQ4Levels[b[8 + 16 * ib + j] & 0xF] + bias);
      w.q[32 * ib + 16 + j] = static_cast<uint8_t>(kIQ4Levels[b[8 + 16 * ib + j] >> 4] + bias);
    }
#endif
  }
  w.d = w.o = half(b);
}

// Q2_K: scales[16] (4-bit scale | 4-bit min) | qs[64] | d | dmin: y = d scale q - dmin min, q = 2 bits (element
// 32j + l of a 128-element half: bits 2j of byte l)
inline void open_q2_k(const uint8_t* b, WBlock& w) {
  for (int i = 0; i < 16; ++i) {
    w.sc[i] = static_cast<int16_t>(b[i] & 0xF);
    w.off[i] = static_cast<int16_t>(b[i] >> 4);
  }
  for (int n = 0; n < 2; ++n) {
#if defined(__AVX2__)
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * n)), m3 = _mm256_set1_epi8(3);
    for (int j = 0; j < 4; ++j)  // (16-bit shifts: the mask keeps each byte's own bits)
      _mm256_store_si256(reinterpret_cast<__m256i*>(w.q + 128 * n + 32 * j), _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), m3));
#else
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) w.q[128 * n + 32 * j + l] = (b[16 + 32 * n + l] >> (2 * j)) & 3;
#endif
  }
  w.d = half(b + 80);
  w.o = half(b + 82);
}

// Q3_K: hmask[32] | qs[64] | scales[12] | d: y = d (scale - 32) (q - 4 where the element's hmask bit is clear), q
// the low 2 bits as in Q2_K, the third bit of element 32g + l bit g of hmask byte l; codes kept as q + 4 hbit
// (0..7), offset 4 (scale - 32). Six-bit scales: low nibbles in bytes 0..7 (scales 0..7 low, 8..15 high), the top 2
// bits of scale i bits 2 (i / 4) of byte 8 + i % 4.
inline void open_q3_k(const uint8_t* b, WBlock& w) {
  const uint8_t* s = b + 96;
  for (int i = 0; i < 16; ++i) {
    const int low = (s[i % 8] >> (4 * (i / 8))) & 0xF, top = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    w.sc[i] = static_cast<int16_t>((low | top << 4) - 32);
    w.off[i] = static_cast<int16_t>(4 * w.sc[i]);
  }
#if defined(__AVX2__)
  const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), m3 = _mm256_set1_epi8(3),
                bit2 = _mm256_set1_epi8(4);
  for (int g = 0; g < 8; ++g) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * (g / 4)));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (g % 4)), m3);
    // bit g of each hmask byte moved to bit 2: left for g < 2, right above (16-bit shifts, masked per byte)
    const __m256i h = g < 2 ? _mm256_slli_epi16(hm, 2 - g) : _mm256_srli_epi16(hm, g - 2);
    _mm256_store_si256(reinterpret_cast<__m256i*>(w.q + 32 * g), _mm256_or_si256(low, _mm256_and_si256(h, bit2)));
  }
#else
  for (int g = 0; g < 8; ++g)
    for (int l = 0; l < 32; ++l)
      w.q[32 * g + l] = static_cast<uint8_t>(((b[32 + 32 * (g / 4) + l] >> (2 * (g % 4))) & 3) | (((b[l] >> g) & 1) << 2));
#endif
  w.d = w.o = half(b + 108);
}

inline void open_block(int64_t type, const uint8_t* b, WBlock& w) {
  switch (type) {
    case Q4_K: return open_k4(b, b + 16, nullptr, w);
    case Q5_K: return open_k4(b, b + 48, b + 16, w);
    case Q6_K: return open_q6_k(b, w);
    case IQ4_XS: return open_iq4_xs(b, w);
    case Q2_K: return open_q2_k(b, w);
    case Q3_K: return open_q3_k(b, w);
  }
  layout(type);  // throws, naming the type
}

// nb blocks of a row of `type` opened into w, the stream prefetched ahead
inline void open_row(int64_t type, const uint8_t* row, int64_t nb, WBlock* w) {
  const int64_t bytes = layout(type).bytes;
  for (int64_t b = 0; b < nb; ++b) {
    const char* p = reinterpret_cast<const char*>(row + b * bytes) + kGemvPrefetch;
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    open_block(type, row + b * bytes, w[b]);
  }
}

// -- the dot products ------------------------------------------------------------------------------

// out[m] = (weight row w) . (activation row m of x), MB rows, x laid out [nb][MB]; SIGNED: codes are signed bytes
// (IQ4_XS's levels where kIQ4Signed). The portable build's decode: AVX-512 decodes from registers (panel_gemv.h,
// int8gemv.h), AVX2 too (int8gemv_avx2.h), and their prefills take tiles (int8gemm.h, int8ktile_avx2.h).
template <int MB, bool SIGNED>
inline void dot_rows(const WBlock* w, const XBlock* x, int64_t nb, float* out) {
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  for (int64_t b = 0; b < nb; ++b)
    for (int m = 0; m < MB; ++m) {
      const XBlock& xb = x[b * MB + m];
      int32_t s = 0, o = 0;
      for (int i = 0; i < 16; ++i) {
        int32_t g = 0;
        for (int e = 16 * i; e < 16 * i + 16; ++e) g += (SIGNED ? static_cast<int8_t>(w[b].q[e]) : w[b].q[e]) * xb.q[e];
        s += w[b].sc[i] * g;
        o += w[b].off[i] * xb.bs[i];
      }
      out[m] += w[b].d * xb.d * s - w[b].o * xb.d * o;
    }
}

template <bool SIGNED>
inline void dot_group(int64_t mb, const WBlock* w, const XBlock* x, int64_t nb, float* out) {
  switch (mb) {
    case 1: return dot_rows<1, SIGNED>(w, x, nb, out);
    case 2: return dot_rows<2, SIGNED>(w, x, nb, out);
    case 3: return dot_rows<3, SIGNED>(w, x, nb, out);
#if defined(__AVX512BW__)
    case 4: return dot_rows<4, SIGNED>(w, x, nb, out);
    case 5: return dot_rows<5, SIGNED>(w, x, nb, out);
    case 6: return dot_rows<6, SIGNED>(w, x, nb, out);
    case 7: return dot_rows<7, SIGNED>(w, x, nb, out);
    default: return dot_rows<8, SIGNED>(w, x, nb, out);
#else
    default: return dot_rows<4, SIGNED>(w, x, nb, out);
#endif
  }
}

// out[m] = (rows of `type` opened into w) . activation rows m < mb of x
inline void dot_group(int64_t type, int64_t mb, const WBlock* w, const XBlock* x, int64_t nb, float* out) {
  if (signed_codes(type)) dot_group<true>(mb, w, x, nb, out);
  else dot_group<false>(mb, w, x, nb, out);
}

}  // namespace kq
}  // namespace deltaserve
