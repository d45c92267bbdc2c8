// AVX-512 decoders of packed GGML blocks (layouts in kquants.h), used by the decode GEMV and the row dequantiser
// (packed.h): a block's codes as float vectors (4- and 5-bit codes through one permute of a constant table per
// 16 weights, which also masks the nibble) and its sub-block scales, from which block_values gives the exact
// values of kquants.h's decode_block.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kquants.h"

namespace deltaserve {
namespace kq {

#if defined(__AVX512F__)
// no FMA contraction: tables and values are the reference's products, bit for bit
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline __m512i bytes16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512 iq4_levels() { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Levels)))); }
// bits 0..3 of lo, bits 4.. of hi (vpternlog's bitwise select, 0xCA: mask ? lo : hi)
inline __m512i nibble_with(__m512i lo, __m512i hi) { return _mm512_ternarylogic_epi32(_mm512_set1_epi32(0xF), lo, hi, 0xCA); }

// A vector's lanes as scalars in memory: broadcasting them from there takes the load ports, while a permute
// per lane would queue behind the code permutes on the shuffle unit.
struct Lanes {
  alignas(64) float v[16];
  explicit Lanes(__m512 x) {
    _mm512_store_ps(v, x);
    asm("" : "+m"(v));  // opaque to the compiler, which would otherwise turn the loads back into permutes
  }
  __m512 operator[](int i) const { return _mm512_set1_ps(v[i]); }
};

// Q4_K / Q5_K: d * scale of sub-blocks 0..7 in lanes 0..7, dmin * min in lanes 8..15 (get_scale_min_k4 for
// all 16 at once: the scalar unpacking cost more than the block's multiply-adds)
inline __m512 k4_steps(const uint8_t* b) {
  const __m512i v = bytes16(b + 4);  // the 12 packed bytes; lanes 12..15 (the next bytes) go unused
  const __m512i a = _mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11), v),
                                      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4));
  const __m512i top = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7), v);
  const __m512i six = _mm512_and_si512(a, _mm512_set1_epi32(63));  // sub-blocks 0..3: 6 bits in place
  const __m512i split = _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xF)),  // 4..7: 4 + 2 bits
                                        _mm512_slli_epi32(_mm512_srli_epi32(top, 6), 4));
  const __m512 q = _mm512_cvtepi32_ps(_mm512_mask_blend_epi32(0xF0F0, six, split));
  return _mm512_mul_ps(q, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16(b)), _mm512_set1_ps(f16(b + 2))));
}

// Every visitor below describes a block as sub-blocks ("groups") of kGroup weights, weight = scale * code
// - offset: steps(b) gives the scales in lanes 0.. and (kOffsets) the offsets in lanes 8..15, or, with more
// than 8 groups (kWideOffsets), offsets(b) gives them in a vector of their own; codes(b, emit) calls
// emit(e, c, g) with c the codes of weights e .. e + 15 as floats, in group g.
template <int BLOCK, int BYTES, int GROUPS, bool OFFSETS>
struct Blocks {
  static constexpr int kBlock = BLOCK, kBytes = BYTES, kGroups = GROUPS, kGroup = BLOCK / GROUPS;
  static constexpr bool kOffsets = OFFSETS, kWideOffsets = OFFSETS && GROUPS > 8;
};

// Q4_1 / Q5_1's steps: d in lanes 0..7, -m in lanes 8..15 (scale * code - (-m) is the reference's d * q + m,
// bit for bit)
inline __m512 dm_steps(const uint8_t* b) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16(b)), _mm512_set1_ps(-f16(b + 2)));
}

// Q5_0 / Q5_1: the 5-bit codes of a block's weights 0..15 (h = 0) or 16..31 (h = 1): the nibbles of qs with bit
// 16h + i of the u32 qh moved to bit 4 of lane i (the permutes read bits 0..4)
inline __m512i q5_index(const uint8_t* qh, const uint8_t* qs, int h) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m512i v = bytes16(qs);
  const __m512i high = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(bits >> 16 * h)), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return nibble_with(h ? _mm512_srli_epi32(v, 4) : v, _mm512_slli_epi32(high, 4));
}

struct VQ4_0 : Blocks<32, 18, 1, false> {  // d * (q - 8)
  static inline __m512 steps(const uint8_t* b) { return _mm512_set1_ps(f16(b)); }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    const __m512 q8 = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.f));
    const __m512i v = bytes16(b + 2);
    emit(0, _mm512_permutexvar_ps(v, q8), 0);  // the permute reads bits 0..3: the low nibble
    emit(16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), q8), 0);
  }
};

struct VQ8_0 : Blocks<32, 34, 1, false> {  // d * q
  static inline __m512 steps(const uint8_t* b) { return _mm512_set1_ps(f16(b)); }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    emit(0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))), 0);
    emit(16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))), 0);
  }
};

struct VIQ4_NL : Blocks<32, 18, 1, false> {  // d * level(q)
  static inline __m512 steps(const uint8_t* b) { return _mm512_set1_ps(f16(b)); }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    const __m512i v = bytes16(b + 2);
    emit(0, _mm512_permutexvar_ps(v, iq4_levels()), 0);
    emit(16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), iq4_levels()), 0);
  }
};

struct VQ4_1 : Blocks<32, 20, 1, true> {  // d * q + m
  static inline __m512 steps(const uint8_t* b) { return dm_steps(b); }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    const __m512i v = bytes16(b + 4);
    emit(0, _mm512_permutexvar_ps(v, iota16()), 0);
    emit(16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), iota16()), 0);
  }
};

struct VQ5_0 : Blocks<32, 22, 1, false> {  // d * (q - 16)
  static inline __m512 steps(const uint8_t* b) { return _mm512_set1_ps(f16(b)); }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    const __m512 low = _mm512_sub_ps(iota16(), _mm512_set1_ps(16.f));  // codes 0..15; 16..31 read iota16
    emit(0, _mm512_permutex2var_ps(low, q5_index(b + 2, b + 6, 0), iota16()), 0);
    emit(16, _mm512_permutex2var_ps(low, q5_index(b + 2, b + 6, 1), iota16()), 0);
  }
};

struct VQ5_1 : Blocks<32, 24, 1, true> {  // d * q + m
  static inline __m512 steps(const uint8_t* b) { return dm_steps(b); }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    const __m512 high = _mm512_add_ps(iota16(), _mm512_set1_ps(16.f));
    emit(0, _mm512_permutex2var_ps(iota16(), q5_index(b + 4, b + 8, 0), high), 0);
    emit(16, _mm512_permutex2var_ps(iota16(), q5_index(b + 4, b + 8, 1), high), 0);
  }
};

struct VMXFP4 : Blocks<32, 17, 1, false> {  // 2^(e - 128) * level(q)
  static inline __m512 steps(const uint8_t* b) { return _mm512_set1_ps(e8m0_half(b[0])); }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    const __m512 levels = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFP4Levels))));
    const __m512i v = bytes16(b + 1);
    emit(0, _mm512_permutexvar_ps(v, levels), 0);
    emit(16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), levels), 0);
  }
};

// Q2_K / Q3_K: 2-bit fields, weights 128n + 32k + 16h + i at bits 2k of byte 32n + 16h + i of qs; a scale per 16
// weights, so group 8n + 2k + h. emit2(e, fields, g) with the fields of 16 weights shifted down to bits 0..1
// (the bits above are the next fields: the permutes' tables repeat every 4 or 8 entries).
template <class F> inline void k2_fields(const uint8_t* qs, F&& emit2) {
  #pragma GCC unroll 8
  for (int n = 0; n < 2; ++n) {
    #pragma GCC unroll 8
    for (int h = 0; h < 2; ++h) {
      const __m512i v = bytes16(qs + 32 * n + 16 * h);
      #pragma GCC unroll 8
      for (int k = 0; k < 4; ++k) emit2(128 * n + 32 * k + 16 * h, _mm512_srli_epi32(v, 2 * k), n, k, h);
    }
  }
}

struct VQ2_K : Blocks<256, 84, 16, true> {  // (d * scale) * q - dmin * min, a scale and a min per 16
  static inline __m512i nibbles(const uint8_t* b, int shift) {
    return _mm512_and_si512(_mm512_srli_epi32(bytes16(b), shift), _mm512_set1_epi32(0xF));
  }
  static inline __m512 steps(const uint8_t* b) { return _mm512_mul_ps(_mm512_set1_ps(f16(b + 80)), _mm512_cvtepi32_ps(nibbles(b, 0))); }
  static inline __m512 offsets(const uint8_t* b) { return _mm512_mul_ps(_mm512_set1_ps(f16(b + 82)), _mm512_cvtepi32_ps(nibbles(b, 4))); }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    k2_fields(b + 16, [&](int e, __m512i v, int n, int k, int h) { emit(e, _mm512_permutexvar_ps(v, q), 8 * n + 2 * k + h); });
  }
};

struct VQ3_K : Blocks<256, 110, 16, false> {  // (d * (scale - 32)) * q, q = low 2 bits - 4 unless the hmask bit
  static inline __m512 steps(const uint8_t* b) {
    alignas(16) uint8_t s[16] = {};
    std::memcpy(s, b + 96, 12);  // the block's 12 scale bytes (a 16-byte load would run past the last block)
    const __m512i v = bytes16(s);
    // q3k_scale for all 16: the low nibble of byte i % 8 (i < 8) or its high (i >= 8), bits 2 (i / 4) of byte 8 + i % 4
    const __m512i low = _mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7), v),
                                          _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4));
    const __m512i top = _mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_setr_epi32(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11), v),
                                          _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6));
    const __m512i sc = _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi32(0xF)),
                                       _mm512_slli_epi32(_mm512_and_si512(top, _mm512_set1_epi32(3)), 4));
    return _mm512_mul_ps(_mm512_set1_ps(f16(b + 108)), _mm512_cvtepi32_ps(_mm512_sub_epi32(sc, _mm512_set1_epi32(32))));
  }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    // index bits 0..1 the low field, bit 2 the hmask bit: q = index - 4
    const __m512 q = _mm512_setr_ps(-4, -3, -2, -1, 0, 1, 2, 3, -4, -3, -2, -1, 0, 1, 2, 3);
    const __m512i hm[2] = {bytes16(b), bytes16(b + 16)};
    k2_fields(b + 32, [&](int e, __m512i v, int n, int k, int h) {
      const int bit = 4 * n + k;  // hmask bit of these weights, moved to bit 2
      const __m512i high = bit >= 2 ? _mm512_srli_epi32(hm[h], bit - 2) : _mm512_slli_epi32(hm[h], 2 - bit);
      emit(e, _mm512_permutexvar_ps(_mm512_ternarylogic_epi32(_mm512_set1_epi32(3), v, high, 0xCA), q), 8 * n + 2 * k + h);
    });
  }
};

struct VQ4_K : Blocks<256, 144, 8, true> {  // d * scale * q - dmin * min
  static inline __m512 steps(const uint8_t* b) { return k4_steps(b); }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    #pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) {
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) {
        const __m512i v = bytes16(b + 16 + 32 * j + 16 * h);
        emit(64 * j + 16 * h, _mm512_permutexvar_ps(v, iota16()), 2 * j);
        emit(64 * j + 32 + 16 * h, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), iota16()), 2 * j + 1);
      }
    }
  }
};

struct VQ5_K : Blocks<256, 176, 8, true> {  // as Q4_K with 5-bit codes
  static inline __m512 steps(const uint8_t* b) { return k4_steps(b); }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    __m512i qh[2] = {bytes16(b + 16), bytes16(b + 32)};  // shifted right 2 bits a pass: bits 0, 1 are current
    const __m512 hi16 = _mm512_add_ps(iota16(), _mm512_set1_ps(16.f));
    #pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) {
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) {
        const __m512i v = bytes16(b + 48 + 32 * j + 16 * h);
        // 5-bit codes: the permute reads bits 0..4 (bit 4 picks the upper half)
        const __m512i i1 = nibble_with(v, _mm512_slli_epi32(qh[h], 4));
        const __m512i i2 = nibble_with(_mm512_srli_epi32(v, 4), _mm512_slli_epi32(qh[h], 3));
        emit(64 * j + 16 * h, _mm512_permutex2var_ps(iota16(), i1, hi16), 2 * j);
        emit(64 * j + 32 + 16 * h, _mm512_permutex2var_ps(iota16(), i2, hi16), 2 * j + 1);
        qh[h] = _mm512_srli_epi32(qh[h], 2);
      }
    }
  }
};

struct VQ6_K : Blocks<256, 210, 16, false> {  // (d * scale) * (q - 32), a scale per 16
  static inline __m512 steps(const uint8_t* b) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))),
                         _mm512_set1_ps(f16(b + 208)));
  }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    const __m512i m30 = _mm512_set1_epi32(0x30), m32 = _mm512_set1_epi32(32);
    auto code = [&](__m512i low, __m512i high) {  // q - 32, q = low | high bits 4, 5
      return _mm512_cvtepi32_ps(_mm512_sub_epi32(nibble_with(low, _mm512_and_si512(high, m30)), m32));
    };
    #pragma GCC unroll 8
    for (int n = 0; n < 2; ++n) {
      const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) {
        const __m512i a = bytes16(ql + 16 * h), c = bytes16(ql + 32 + 16 * h), hq = bytes16(qh + 16 * h);
        emit(128 * n + 16 * h, code(a, _mm512_slli_epi32(hq, 4)), 8 * n + h);
        emit(128 * n + 32 + 16 * h, code(c, _mm512_slli_epi32(hq, 2)), 8 * n + h + 2);
        emit(128 * n + 64 + 16 * h, code(_mm512_srli_epi32(a, 4), hq), 8 * n + h + 4);
        emit(128 * n + 96 + 16 * h, code(_mm512_srli_epi32(c, 4), _mm512_srli_epi32(hq, 2)), 8 * n + h + 6);
      }
    }
  }
};

struct VIQ4_XS : Blocks<256, 136, 8, false> {  // d * (scale - 32) * level(q)
  static inline __m512 steps(const uint8_t* b) {
    // iq4xs_scale for the 8 sub-blocks at once: nibble i % 2 of byte 4 + i / 2, bits 2i of the u16 at 2
    const __m512i low = _mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_setr_epi32(2, 2, 3, 3, 4, 4, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0), bytes16(b + 2)),
                                          _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0));
    uint16_t h;
    std::memcpy(&h, b + 2, 2);
    const __m512i high = _mm512_srlv_epi32(_mm512_set1_epi32(h), _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m512i ls = _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi32(0xF)),
                                       _mm512_slli_epi32(_mm512_and_si512(high, _mm512_set1_epi32(3)), 4));
    return _mm512_mul_ps(_mm512_set1_ps(f16(b)), _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
  }
  template <class F> static inline void codes(const uint8_t* b, F&& emit) {
    #pragma GCC unroll 8
    for (int ib = 0; ib < 8; ++ib) {
      const __m512i v = bytes16(b + 8 + 16 * ib);
      emit(32 * ib, _mm512_permutexvar_ps(v, iq4_levels()), ib);
      emit(32 * ib + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), iq4_levels()), ib);
    }
  }
};

// emit(e, w) with the values of weights e .. e + 15 of one block: scale * code (- offset), the reference's
// products in its order, so bit-exact.
template <class V, class F>
inline void block_values(const uint8_t* b, F&& emit) {
  const Lanes s(V::steps(b));
  if constexpr (V::kWideOffsets) {
    const Lanes o(V::offsets(b));
    V::codes(b, [&](int e, __m512 c, int g) { emit(e, _mm512_sub_ps(_mm512_mul_ps(c, s[g]), o[g])); });
  } else {
    V::codes(b, [&](int e, __m512 c, int g) {
      const __m512 w = _mm512_mul_ps(c, s[g]);
      emit(e, V::kOffsets ? _mm512_sub_ps(w, s[8 + g]) : w);
    });
  }
}

#pragma GCC pop_options
#endif

}  // namespace kq
}  // namespace deltaserve
