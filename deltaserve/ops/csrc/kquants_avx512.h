// AVX-512 decoders of packed GGML blocks (layouts in kquants.h): each visitor hands emit(e, w) the 16-weight
// vectors of one block (w = weights e .. e + 15) with the exact values of kquants.h's decode_block. 4- and 5-bit
// codes index a 16- or 32-entry table of their sub-block's values: one permute per 16 weights instead of a
// mask, a convert and a multiply-add. Used by the decode GEMV and the row dequantiser (packed.h).
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

// the values of sub-block j's 16 codes from k4_steps: d * scale * q - dmin * min
inline __m512 k4_table(const Lanes& steps, int j, __m512 codes) {
  return _mm512_sub_ps(_mm512_mul_ps(codes, steps[j]), steps[8 + j]);
}

template <int BLOCK, int BYTES>
struct Blocks {
  static constexpr int kBlock = BLOCK, kBytes = BYTES;
};

struct VQ4_0 : Blocks<32, 18> {
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    const __m512 tbl = _mm512_mul_ps(_mm512_sub_ps(iota16(), _mm512_set1_ps(8.f)), _mm512_set1_ps(f16(b)));
    const __m512i v = bytes16(b + 2);
    emit(0, _mm512_permutexvar_ps(v, tbl));  // the permute reads bits 0..3: the low nibble
    emit(16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl));
  }
};

struct VIQ4_NL : Blocks<32, 18> {
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    const __m512 tbl = _mm512_mul_ps(iq4_levels(), _mm512_set1_ps(f16(b)));
    const __m512i v = bytes16(b + 2);
    emit(0, _mm512_permutexvar_ps(v, tbl));
    emit(16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl));
  }
};

struct VQ4_K : Blocks<256, 144> {
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    const Lanes steps(k4_steps(b));
    #pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) {
      const __m512 t1 = k4_table(steps, 2 * j, iota16()), t2 = k4_table(steps, 2 * j + 1, iota16());
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) {
        const __m512i v = bytes16(b + 16 + 32 * j + 16 * h);
        emit(64 * j + 16 * h, _mm512_permutexvar_ps(v, t1));
        emit(64 * j + 32 + 16 * h, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t2));
      }
    }
  }
};

struct VQ5_K : Blocks<256, 176> {
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    const Lanes steps(k4_steps(b));
    __m512i qh[2] = {bytes16(b + 16), bytes16(b + 32)};  // shifted right 2 bits a pass: bits 0, 1 are current
    const __m512 hi16 = _mm512_add_ps(iota16(), _mm512_set1_ps(16.f));
    #pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) {
      const __m512 lo1 = k4_table(steps, 2 * j, iota16()), hi1 = k4_table(steps, 2 * j, hi16);
      const __m512 lo2 = k4_table(steps, 2 * j + 1, iota16()), hi2 = k4_table(steps, 2 * j + 1, hi16);
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) {
        const __m512i v = bytes16(b + 48 + 32 * j + 16 * h);
        // 5-bit codes: the permute reads bits 0..4 (bit 4 picks the upper table)
        const __m512i i1 = nibble_with(v, _mm512_slli_epi32(qh[h], 4));
        const __m512i i2 = nibble_with(_mm512_srli_epi32(v, 4), _mm512_slli_epi32(qh[h], 3));
        emit(64 * j + 16 * h, _mm512_permutex2var_ps(lo1, i1, hi1));
        emit(64 * j + 32 + 16 * h, _mm512_permutex2var_ps(lo2, i2, hi2));
        qh[h] = _mm512_srli_epi32(qh[h], 2);
      }
    }
  }
};

struct VQ6_K : Blocks<256, 210> {
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    const __m512i m30 = _mm512_set1_epi32(0x30), m32 = _mm512_set1_epi32(32);
    // d * scale for the 16 runs of 16 weights
    const Lanes steps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))),
                                    _mm512_set1_ps(f16(b + 208))));
    auto value = [&](__m512i low, __m512i high, int run) {  // (d * scale) * (q - 32), q = low | high bits 4, 5
      const __m512i q = nibble_with(low, _mm512_and_si512(high, m30));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, m32)), steps[run]);
    };
    #pragma GCC unroll 8
    for (int n = 0; n < 2; ++n) {
      const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) {
        const __m512i a = bytes16(ql + 16 * h), c = bytes16(ql + 32 + 16 * h), hq = bytes16(qh + 16 * h);
        emit(128 * n + 16 * h, value(a, _mm512_slli_epi32(hq, 4), 8 * n + h));
        emit(128 * n + 32 + 16 * h, value(c, _mm512_slli_epi32(hq, 2), 8 * n + h + 2));
        emit(128 * n + 64 + 16 * h, value(_mm512_srli_epi32(a, 4), hq, 8 * n + h + 4));
        emit(128 * n + 96 + 16 * h, value(_mm512_srli_epi32(c, 4), _mm512_srli_epi32(hq, 2), 8 * n + h + 6));
      }
    }
  }
};

struct VIQ4_XS : Blocks<256, 136> {
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    // iq4xs_scale for the 8 sub-blocks at once: nibble i % 2 of byte 4 + i / 2, bits 2i of the u16 at 2
    const __m512i low = _mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_setr_epi32(2, 2, 3, 3, 4, 4, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0), bytes16(b + 2)),
                                          _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0));
    uint16_t h;
    std::memcpy(&h, b + 2, 2);
    const __m512i high = _mm512_srlv_epi32(_mm512_set1_epi32(h), _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m512i ls = _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi32(0xF)),
                                       _mm512_slli_epi32(_mm512_and_si512(high, _mm512_set1_epi32(3)), 4));
    const Lanes steps(_mm512_mul_ps(_mm512_set1_ps(f16(b)), _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32)))));
    const __m512 levels = iq4_levels();
    #pragma GCC unroll 8
    for (int ib = 0; ib < 8; ++ib) {
      const __m512 tbl = _mm512_mul_ps(levels, steps[ib]);
      const __m512i v = bytes16(b + 8 + 16 * ib);
      emit(32 * ib, _mm512_permutexvar_ps(v, tbl));
      emit(32 * ib + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl));
    }
  }
};

#pragma GCC pop_options
#endif

}  // namespace kq
}  // namespace deltaserve
