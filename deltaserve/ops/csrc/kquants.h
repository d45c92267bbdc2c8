// Weights kept in their GGML blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4: 32 weights a block; Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K, IQ4_XS: 256):
// the block layouts, exact scalar decoders (the reference for kquants_avx512.h's, and the path of machines
// without AVX-512) and the segment table of a packed matrix. The kernels reading them are in packed.h.
//
// A packed matrix is one byte string holding its rows one after the other; a fused projection may mix
// types (llama.cpp's Q4_K_M keeps some parts in Q6_K), so the rows come in segments described by an int64
// table [S, 4]: (GGML type id, first row, end row, byte offset of the first row), rows in order.
#pragma once
#include <c10/util/Half.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace deltaserve {
namespace kq {

// GGML type ids (ggml.h's enum ggml_type)
enum Type : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20,
  IQ4_XS = 23, MXFP4 = 39
};

struct Layout {
  int64_t block, bytes;  // weights per block, bytes per block
};

inline Layout layout(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case IQ4_NL: return {32, 18};
    case MXFP4: return {32, 17};
    case Q2_K: return {256, 84};
    case Q3_K: return {256, 110};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    case IQ4_XS: return {256, 136};
  }
  throw std::invalid_argument("packed weights: GGML type " + std::to_string(type) + " has no kernel");
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// kvalues_iq4nl: IQ4's 16 non-uniform levels
constexpr int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// kvalues_mxfp4: MXFP4's e2m1 values, doubled (the block's exponent is halved to match)
constexpr int8_t kFP4Levels[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128) as float bits; exponents 0 and 1 give the subnormals 2^-128, 2^-127
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q3_K sub-block i's scale (16 of 16 weights), 6 bits stored with an offset of 32: the low 4 in nibble i / 8 of
// byte i % 8, the top 2 in bits 2 (i / 4) of byte 8 + i % 4
inline int q3k_scale(const uint8_t* s, int i) {
  return (((s[i % 8] >> 4 * (i / 8)) & 0xF) | (((s[8 + i % 4] >> 2 * (i / 4)) & 3) << 4)) - 32;
}

// ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 packed bytes of a Q4_K / Q5_K block
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// IQ4_XS sub-block ib's scale, 6 bits stored with an offset of 32
inline int iq4xs_scale(const uint8_t* b, int ib) {
  uint16_t high;
  std::memcpy(&high, b + 2, 2);
  return (((b[4 + ib / 2] >> 4 * (ib % 2)) & 0xF) | (((high >> 2 * ib) & 3) << 4)) - 32;
}

// The decoders below take their products in the order of ggml's reference dequantisers (and of
// loader/quants.py), with FMA contraction off (-ffast-math would fuse d1 * q - m1): bit-exact results.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

inline void decode_q4_0(const uint8_t* b, float* y) {  // d f16 | qs[16]: y = (q - 8) * d
  const float d = f16(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((b[2 + j] & 0xF) - 8) * d;
    y[j + 16] = static_cast<float>((b[2 + j] >> 4) - 8) * d;
  }
}

inline void decode_q8_0(const uint8_t* b, float* y) {  // d f16 | qs int8[32]: y = q * d
  const float d = f16(b);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
}

inline void decode_iq4_nl(const uint8_t* b, float* y) {  // d f16 | qs[16]: y = d * level(q)
  const float d = f16(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(kIQ4Levels[b[2 + j] & 0xF]);
    y[j + 16] = d * static_cast<float>(kIQ4Levels[b[2 + j] >> 4]);
  }
}

inline void decode_q4_1(const uint8_t* b, float* y) {  // d f16 | m f16 | qs[16]: y = d * q + m
  const float d = f16(b), m = f16(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(b[4 + j] & 0xF) + m;
    y[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
  }
}

// Q5_0 / Q5_1 codes: element j's low 4 bits in qs (as Q4_0), its fifth in bit j of the little-endian u32 qh
inline int q5_code(const uint8_t* qh, const uint8_t* qs, int j) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  return (j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4) | (((h >> j) & 1) << 4);
}

inline void decode_q5_0(const uint8_t* b, float* y) {  // d f16 | qh[4] | qs[16]: y = d * (q - 16)
  const float d = f16(b);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q5_code(b + 2, b + 6, j) - 16);
}

inline void decode_q5_1(const uint8_t* b, float* y) {  // d f16 | m f16 | qh[4] | qs[16]: y = d * q + m
  const float d = f16(b), m = f16(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q5_code(b + 4, b + 8, j)) + m;
}

inline void decode_mxfp4(const uint8_t* b, float* y) {  // e u8 | qs[16]: y = 2^(e - 128) * level(q)
  const float d = e8m0_half(b[0]);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(kFP4Levels[b[1 + j] & 0xF]);
    y[j + 16] = d * static_cast<float>(kFP4Levels[b[1 + j] >> 4]);
  }
}

// scales[16] (scale | min << 4) | qs[64] | d f16 | dmin f16: per 128-element half, element 32k + l is bits 2k of
// qs[l]; a scale and min per 16 elements: y = (d * scale) * q - dmin * min
inline void decode_q2_k(const uint8_t* b, float* y) {
  const float d = f16(b + 80), dmin = f16(b + 82);
  for (int e = 0; e < 256; ++e) {
    const int n = e / 128, k = e % 128 / 32, l = e % 32, sc = b[e / 16];
    const float dl = d * static_cast<float>(sc & 0xF), ml = dmin * static_cast<float>(sc >> 4);
    y[e] = dl * static_cast<float>((b[16 + 32 * n + l] >> 2 * k) & 3) - ml;
  }
}

// hmask[32] | qs[64] | scales[12] | d f16: the low 2 bits as Q2_K's, the third is bit 4n + k of hmask[l] (element
// 128n + 32k + l), set meaning q, clear q - 4: y = (d * (scale - 32)) * q
inline void decode_q3_k(const uint8_t* b, float* y) {
  const float d = f16(b + 108);
  for (int e = 0; e < 256; ++e) {
    const int n = e / 128, k = e % 128 / 32, l = e % 32;
    const float dl = d * static_cast<float>(q3k_scale(b + 96, e / 16));
    const int q = ((b[32 + 32 * n + l] >> 2 * k) & 3) - (((b[l] >> (4 * n + k)) & 1) ? 0 : 4);
    y[e] = dl * static_cast<float>(q);
  }
}

// d f16 | dmin f16 | scales[12] | qs[128]: each 32 bytes hold sub-blocks 2j (low nibbles) and 2j + 1
inline void decode_q4_k(const uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* q = b + 16;
  for (int j = 0; j < 4; ++j, q += 32, y += 64) {
    int sc1, m1, sc2, m2;
    scale_min_k4(2 * j, b + 4, sc1, m1);
    scale_min_k4(2 * j + 1, b + 4, sc2, m2);
    const float d1 = d * sc1, o1 = dmin * m1, d2 = d * sc2, o2 = dmin * m2;
    for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>(q[l] & 0xF) - o1;
    for (int l = 0; l < 32; ++l) y[l + 32] = d2 * static_cast<float>(q[l] >> 4) - o2;
  }
}

// d f16 | dmin f16 | scales[12] | qh[32] | qs[128]: as Q4_K, with bit j of qh[l] the fifth bit of sub-block j
inline void decode_q5_k(const uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t *qh = b + 16, *q = b + 48;
  for (int j = 0; j < 4; ++j, q += 32, y += 64) {
    int sc1, m1, sc2, m2;
    scale_min_k4(2 * j, b + 4, sc1, m1);
    scale_min_k4(2 * j + 1, b + 4, sc2, m2);
    const float d1 = d * sc1, o1 = dmin * m1, d2 = d * sc2, o2 = dmin * m2;
    for (int l = 0; l < 32; ++l)
      y[l] = d1 * static_cast<float>((q[l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4)) - o1;
    for (int l = 0; l < 32; ++l)
      y[l + 32] = d2 * static_cast<float>((q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) - o2;
  }
}

// ql[128] | qh[64] | scales int8[16] | d f16: per 128-element half, element 32k + l takes nibble k / 2 of
// ql[l + 32 (k % 2)] and bits 2k of qh[l]; a scale per 16 elements
inline void decode_q6_k(const uint8_t* b, float* y) {
  const float d = f16(b + 208);
  for (int n = 0; n < 2; ++n, y += 128) {
    const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * n);
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      y[l] = d * sc[is] * static_cast<float>(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
      y[l + 32] = d * sc[is + 2] * static_cast<float>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
      y[l + 64] = d * sc[is + 4] * static_cast<float>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      y[l + 96] = d * sc[is + 6] * static_cast<float>(((ql[l + 32] >> 4) | ((qh[l] >> 6) << 4)) - 32);
    }
  }
}

// d f16 | scales_h u16 | scales_l[4] | qs[128]: sub-block ib's 16 bytes hold elements 0..15 (low nibbles)
// and 16..31 (high)
inline void decode_iq4_xs(const uint8_t* b, float* y) {
  const float d = f16(b);
  for (int ib = 0; ib < 8; ++ib, y += 32) {
    const float dl = d * static_cast<float>(iq4xs_scale(b, ib));
    const uint8_t* q = b + 8 + 16 * ib;
    for (int j = 0; j < 16; ++j) {
      y[j] = dl * static_cast<float>(kIQ4Levels[q[j] & 0xF]);
      y[j + 16] = dl * static_cast<float>(kIQ4Levels[q[j] >> 4]);
    }
  }
}

#pragma GCC pop_options

// One block of `type` at b, decoded into y[0 .. block).
inline void decode_block(int64_t type, const uint8_t* b, float* y) {
  switch (type) {
    case Q4_0: return decode_q4_0(b, y);
    case Q4_1: return decode_q4_1(b, y);
    case Q5_0: return decode_q5_0(b, y);
    case Q5_1: return decode_q5_1(b, y);
    case Q8_0: return decode_q8_0(b, y);
    case IQ4_NL: return decode_iq4_nl(b, y);
    case MXFP4: return decode_mxfp4(b, y);
    case Q2_K: return decode_q2_k(b, y);
    case Q3_K: return decode_q3_k(b, y);
    case Q4_K: return decode_q4_k(b, y);
    case Q5_K: return decode_q5_k(b, y);
    case Q6_K: return decode_q6_k(b, y);
    case IQ4_XS: return decode_iq4_xs(b, y);
  }
  layout(type);  // throws, naming the type
}

// the types panels.h lays out 16 rows to a panel (IQ4_XS where its panel kernels' vpdpbusd runs: AVX-512 VNNI)
inline bool panel_type(int64_t type) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  constexpr bool iq4_xs = true;
#else
  constexpr bool iq4_xs = false;
#endif
  return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K || (iq4_xs && type == IQ4_XS) || type == Q4_0;
}

// The segment table of a packed matrix, checked once per call against its bytes.
struct Segments {
  static constexpr int64_t kCols = 5;
  const int64_t* t;  // [S, 5]: type, first row, end row, byte offset, panel rows (16: row panels, see panels.h; 0)
  int64_t S, rows;

  Segments(const at::Tensor& table, int64_t K, int64_t nbytes)
      : t(table.data_ptr<int64_t>()), S(table.size(0)), rows(S ? t[kCols * (S - 1) + 2] : 0) {
    TORCH_CHECK(table.dim() == 2 && table.size(1) == kCols && table.is_contiguous(), "segment table must be [S, 5]");
    for (int64_t s = 0; s < S; ++s) {
      const Layout l = layout(type(s));
      TORCH_CHECK(K % l.block == 0, "packed rows of ", K, " weights are not whole blocks of ", l.block);
      TORCH_CHECK(first(s) == (s ? end(s - 1) : 0) && end(s) >= first(s), "segments out of order");
      TORCH_CHECK(t[kCols * s + 3] + (end(s) - first(s)) * (K / l.block) * l.bytes <= nbytes,
                  "segment ", s, " runs past the packed bytes");
      TORCH_CHECK(t[kCols * s + 4] == 0 || (t[kCols * s + 4] == 16 && panel_type(type(s))),
                  "segment ", s, ": panels of ", t[kCols * s + 4], " rows of type ", type(s));
    }
  }

  // index of the segment holding row n (S is a handful: a linear scan)
  int64_t find(int64_t n) const {
    int64_t s = 0;
    while (s + 1 < S && n >= end(s)) ++s;
    return s;
  }
  int64_t type(int64_t s) const { return t[kCols * s]; }
  int64_t first(int64_t s) const { return t[kCols * s + 1]; }
  int64_t end(int64_t s) const { return t[kCols * s + 2]; }
  // rows of segment s held in panels of 16 (its first ones; the rest are native)
  int64_t panel_rows(int64_t s) const { return t[kCols * s + 4] ? (end(s) - first(s)) / 16 * 16 : 0; }
  bool panels(int64_t s) const { return panel_rows(s) > 0; }
  // the bytes of row n (native rows), or of the panel starting at row n
  const uint8_t* row(const uint8_t* base, int64_t s, int64_t n, int64_t K) const {
    const Layout l = layout(type(s));
    return base + t[kCols * s + 3] + (n - first(s)) * (K / l.block) * l.bytes;
  }
};

}  // namespace kq
}  // namespace deltaserve
