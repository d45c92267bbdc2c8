// The prefill GEMM of 32-weight blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) on AVX2, for CPUs without AVX-512
// VNNI: up to 32 weight rows opened into tiles of 8 (Rows32), one int32 lane per row, so that the float scales apply
// once per 32 codes and 8 rows, and every 4 activation rows (8 for the signed codes) pass over them (the tiles stay
// in L1 / L2). The blocks, their products and the decode are int8legacy_avx2.h's.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8legacy_avx2.h"

namespace deltaserve {
namespace q8 {

#if defined(DELTASERVE_BLOCK32_AVX2)
// codes whose products with activations need the sign trick (signed levels); the others' tiles hold them unsigned
// (kBias32) and sum kPairs16 steps of products in int16
template <int64_t TYPE>
constexpr bool kSigned32 = TYPE == kq::Q8_0 || TYPE == kq::IQ4_NL;
constexpr int kPairs16 = 4;

inline __m256i broadcast4(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, 4);
  return _mm256_set1_epi32(four);
}

// y + i ldy [0 .. n) = lanes 0 .. n of acc[i], i < mb: a tile's 8 rows, the last tile's first n
inline void store_lanes(const __m256* acc, int mb, float* y, int64_t ldy, int64_t n) {
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int i = 0; i < mb; ++i) _mm256_maskstore_ps(y + i * ldy, keep, acc[i]);
}

// the 8 x 8 dwords v[r][j] transposed in place: v[j][r]
inline void transpose8(__m256i* v) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h) {
      u[4 * i + 2 * h] = _mm256_unpacklo_epi64(t[4 * i + h], t[4 * i + 2 + h]);  // dwords 2h, 4 + 2h of 4 rows
      u[4 * i + 2 * h + 1] = _mm256_unpackhi_epi64(t[4 * i + h], t[4 * i + 2 + h]);  // 2h + 1, 5 + 2h
    }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    v[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

// Up to 32 weight rows opened for the prefill as tiles of 8: per block k and 4 codes j, one vector of the 8 rows'
// 4 codes (c [tile][K / 4][8][4]: kSigned32's signed, the others' unsigned, see kBias32), so that one vpmaddubsw
// multiplies 4 codes of 8 rows by 4 activations broadcast, with the rows' d (and m) per block [tile][nb][8]: the
// scales then apply once per 32 codes and 8 rows.
struct Rows32 {
  std::vector<int8_t> c, rowwise;  // rowwise: [rows][K] as opened, before the tiles
  std::vector<float> d, m;
  int64_t K = 0, rows = 0, type = 0;

  void reset(int64_t of_type, int64_t n, int64_t cols) {
    type = of_type, rows = n, K = cols;
    const int64_t slots = (rows + 7) / 8 * 8;  // rows past the last: zero codes (lay), their lanes never stored
    c.resize(slots * K), d.assign(slots * K / 32, 0.f), m.assign(slots * K / 32, 0.f), rowwise.clear();
  }

  // row r (< rows) from a file's row of `type`
  void open(int64_t r, const uint8_t* row) {
    rowwise.resize(rows * K);
    switch (type) {
      case kq::Q8_0: return open_as<kq::Q8_0>(r, row);
      case kq::Q4_0: return open_as<kq::Q4_0>(r, row);
      case kq::Q4_1: return open_as<kq::Q4_1>(r, row);
      case kq::Q5_0: return open_as<kq::Q5_0>(r, row);
      case kq::Q5_1: return open_as<kq::Q5_1>(r, row);
      case kq::IQ4_NL: return open_as<kq::IQ4_NL>(r, row);
    }
    TORCH_CHECK(false, "Rows32: GGML type ", type, " is not of 32-weight blocks");
  }

  // y[m][0 .. rows) (ldy apart) for every activation row m of a, the rows from open()
  void run(const Q8Acts& a, float* y, int64_t ldy) {
    lay(rowwise.data());
    switch (type) {
      case kq::Q8_0: return run_as<kq::Q8_0>(a, y, ldy);
      case kq::Q4_0: return run_as<kq::Q4_0>(a, y, ldy);
      case kq::Q4_1: return run_as<kq::Q4_1>(a, y, ldy);
      case kq::Q5_0: return run_as<kq::Q5_0>(a, y, ldy);
      case kq::IQ4_NL: return run_as<kq::IQ4_NL>(a, y, ldy);
      default: return run_as<kq::Q5_1>(a, y, ldy);
    }
  }

  // the same for rows of a Q8_0 matrix held as int8 codes [rows][K] with float16 scales [rows][K / 32]
  // (models/layers.py quantize_q8), laid out from where they lie
  void run_q8(const int8_t* codes, const at::Half* scales, const Q8Acts& a, float* y, int64_t ldy) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K / 32; ++k) d[r / 8 * K / 4 + k * 8 + r % 8] = static_cast<float>(scales[r * (K / 32) + k]);
    lay(codes);
    run_as<kq::Q8_0>(a, y, ldy);
  }

 private:
  // the `rows` rows of codes at rows_at (K apart) into the tiles c, per block of 8 rows 8 vectors of 4 codes x 8 rows
  // (the last tile's rows past them zero)
  void lay(const int8_t* rows_at) {
    for (int64_t t = 0; t < rows; t += 8)
      for (int64_t k = 0; k < K / 32; ++k) {
        __m256i v[8];
        for (int r = 0; r < 8; ++r)
          v[r] = t + r < rows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows_at + (t + r) * K + 32 * k)) : _mm256_setzero_si256();
        transpose8(v);
        for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(c.data() + t * K + 256 * k + 32 * j), v[j]);
      }
  }

  template <int64_t TYPE>
  void open_as(int64_t r, const uint8_t* row) {
    const int64_t nb = K / 32, at = r / 8 * K / 4 + r % 8;  // block k's d: d[at + 8 k]
    for (int64_t k = 0; k < nb; ++k) {
      const Block32 w = open_block32<TYPE, true>(row + k * kBytes32<TYPE>);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rowwise.data() + r * K + 32 * k), w.c);
      d[at + 8 * k] = w.d, m[at + 8 * k] = w.m;
    }
  }

  template <int64_t TYPE>
  void run_as(const Q8Acts& a, float* y, int64_t ldy) const {
    constexpr int64_t MB = kSigned32<TYPE> ? kSignedRows : 4;
    for (int64_t g = 0; g < a.M; g += MB)
      for (int64_t t = 0; t < rows; t += 8) {
        const int64_t n = std::min<int64_t>(8, rows - t);
        float* out = y + g * ldy + t;
        if constexpr (kSigned32<TYPE>) {
          switch (std::min<int64_t>(MB, a.M - g)) {
            case 1: signed_rows<1>(t, a, g, out, ldy, n); break;
            case 2: signed_rows<2>(t, a, g, out, ldy, n); break;
            case 3: signed_rows<3>(t, a, g, out, ldy, n); break;
            case 4: signed_rows<4>(t, a, g, out, ldy, n); break;
            case 5: signed_rows<5>(t, a, g, out, ldy, n); break;
            case 6: signed_rows<6>(t, a, g, out, ldy, n); break;
            case 7: signed_rows<7>(t, a, g, out, ldy, n); break;
            default: signed_rows<kSignedRows>(t, a, g, out, ldy, n);
          }
        } else {
          switch (std::min<int64_t>(MB, a.M - g)) {
            case 1: tile_rows<1, TYPE>(t, a, g, out, ldy, n); break;
            case 2: tile_rows<2, TYPE>(t, a, g, out, ldy, n); break;
            case 3: tile_rows<3, TYPE>(t, a, g, out, ldy, n); break;
            default: tile_rows<4, TYPE>(t, a, g, out, ldy, n);
          }
        }
      }
  }

  // Q8_0's and IQ4_NL's signed codes (the sign trick, add_dot32) by up to kSignedRows activation rows a pass, their float
  // sums in memory so that the registers hold the 8 int32 sums: against 4 rows with both in registers, 1.09-1.11x
  // at 63 x 200 x 1024 to 512 x 1024 x 3584 on the AMX Xeon's AVX2 build (10 or 12 rows spilled sums: 0.8x)
  static constexpr int kSignedRows = 8;
  template <int MB>
  void signed_rows(int64_t t, const Q8Acts& a, int64_t m0, float* y, int64_t ldy, int64_t n) const {
    const int64_t nb = K / 32;
    const int8_t* tile = c.data() + t * K;
    const float* dt = d.data() + t / 8 * (K / 4);  // [tile][nb][8]
    alignas(32) float acc[MB][8] = {};
    for (int64_t k = 0; k < nb; ++k) {
      const int8_t* xk = a.q.data() + m0 * K + 32 * k;
      __m256i sum[MB];
      for (int i = 0; i < MB; ++i) sum[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i cv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 256 * k + 32 * j));
        const __m256i mag = _mm256_sign_epi8(cv, cv);
#pragma GCC unroll 8
        for (int i = 0; i < MB; ++i) {
          sum[i] = add_dot32(sum[i], cv, mag, broadcast4(xk + i * K + 4 * j));
          asm("" : "+x"(sum[i]));  // in step order, as tile_rows'
        }
      }
      const __m256 dw = _mm256_loadu_ps(dt + 8 * k);
      for (int i = 0; i < MB; ++i) {
        const __m256 dwx = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[(m0 + i) * nb + k]));
        _mm256_store_ps(acc[i], _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), dwx, _mm256_load_ps(acc[i])));
      }
    }
    __m256 out[MB];
    for (int i = 0; i < MB; ++i) out[i] = _mm256_load_ps(acc[i]);
    store_lanes(out, MB, y, ldy, n);
  }

  // y[m][0 .. n) (ldy apart) = rows t .. t + n of the tile . activation rows m0 + m (m < MB); the unsigned codes
  template <int MB, int64_t TYPE>
  void tile_rows(int64_t t, const Q8Acts& a, int64_t m0, float* y, int64_t ldy, int64_t n) const {
    constexpr bool one = TYPE == kq::Q4_1 || TYPE == kq::Q5_1;
    const int64_t nb = K / 32;
    const int8_t* tile = c.data() + t * K;
    const float* dt = d.data() + t / 8 * (K / 4);  // [tile][nb][8]
    const float* mt = m.data() + t / 8 * (K / 4);
    __m256 acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb; ++k) {
      const int8_t* xk = a.q.data() + m0 * K + 32 * k;
      __m256i sum[MB];
      for (int i = 0; i < MB; ++i) sum[i] = _mm256_set1_epi32(a.start[(m0 + i) * nb + k] / 128 * kBias32<TYPE>);  // -bias sum(qx)
#pragma GCC unroll 2
      for (int j0 = 0; j0 < 8; j0 += kPairs16) {  // int16 pair sums over kPairs16 steps, then widened once
        __m256i p[MB];
        for (int i = 0; i < MB; ++i) p[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = j0; j < j0 + kPairs16; ++j) {
          const __m256i cv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 256 * k + 32 * j));
#pragma GCC unroll 4
          for (int i = 0; i < MB; ++i) {
            p[i] = _mm256_add_epi16(p[i], _mm256_maddubs_epi16(cv, broadcast4(xk + i * K + 4 * j)));
            asm("" : "+x"(p[i]));  // in step order (GCC's tree of the sums held every product: spills)
          }
        }
        for (int i = 0; i < MB; ++i) sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(p[i], _mm256_set1_epi16(1)));
      }
      const __m256 dw = _mm256_loadu_ps(dt + 8 * k);
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const int64_t at = (m0 + i) * nb + k;
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[at])), acc[i]);
        if (one)  // m dx sum(qx): start = -128 sum(qx), exactly
          acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(mt + 8 * k), _mm256_set1_ps(a.d[at] * static_cast<float>(-a.start[at] / 128)), acc[i]);
      }
    }
    store_lanes(acc, MB, y, ldy, n);
  }
};
#endif

}  // namespace q8
}  // namespace deltaserve
