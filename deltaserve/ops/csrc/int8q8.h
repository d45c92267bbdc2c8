// Integer dot products of Q8_0 weights (int8 [N, K] with a float16 scale per 32, models/layers.py quantize_q8)
// with activations rounded per 32 to Q8_0 as llama.cpp does (quantize_row_q8_0: d = max|x| / 127 kept as float16,
// q = round(x / d) with the float32 d), the arithmetic llama.cpp runs on Q8_0 files:
//
//   row . x  =  sum_k  dw_k dx_k  sum_(e in block k) qw_e qx_e
//
// vpdpbusd multiplies unsigned by signed bytes: the weights go in with their sign bit flipped (qw + 128, one
// XOR), and 128 x the block's sum of qx is taken off again in the integer sum (exact: it starts there).
// Decode (M <= kQ8Rows): a row at a time, 64 weights a vpdpbusd, the two blocks' float factors per lane from a
// permute of 16 weight scales and the activation scales stored 8 to a block; 16 rows' lane sums added at once.
// Prefill: tiles of 16 rows interleaved per call into 4-byte runs, each vpdpbusd multiplying 4 weights of 16 rows
// by 4 broadcast activations (int32 lane per row), a block's float factors once per 32 (int8gemm.h's scheme for
// K-quants); where AMX runs, the same tiles of 16 rows are tdpbsud's weight tiles (q8_amx_rows: the same bits).
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

#include "amx.h"
#include "gemv.h"
#include "int8dot.h"
#include "int8tiles32_avx2.h"
#include "q8acts.h"
#include "shares.h"
#include "xrows.h"

namespace deltaserve {
namespace q8 {

constexpr int64_t kQ8Rows = 8;  // activation rows per pass in decode


#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kQ8Int8 = true;

inline __m512 f16x16(const at::Half* p, int64_t n) {  // n <= 16 scales, the rest zero
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p));
}

// One step of q8_row: blocks k, k + 1 of a weight row (One: block k alone, the row's last) times MB activation
// rows. Lanes 0..7 of a vpdpbusd hold block k, 8..15 block k + 1; `pair` picks those two blocks' weight scales from
// dw (16 blocks a vector).
template <int MB, bool One>
inline void q8_pair(const int8_t* w, __m512 dw, __m512i pair, const Q8Acts& a, int64_t k, __m512 (&acc)[MB]) {
  constexpr __mmask64 keep = One ? 0xFFFFFFFFull : ~__mmask64{0};
  constexpr __mmask16 lanes = One ? 0xFF : 0xFFFF;
  const int8_t* wp = w + 32 * k;
  _mm_prefetch(reinterpret_cast<const char*>(wp) + kF16Prefetch, _MM_HINT_T1);
  const __m512i v = _mm512_xor_si512(One ? _mm512_maskz_loadu_epi8(keep, wp) : _mm512_loadu_si512(wp),
                                     _mm512_set1_epi8(static_cast<char>(0x80)));
  const __m512 s = _mm512_permutexvar_ps(pair, dw);
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    const int64_t at = m * a.nb + k;
    const int8_t* xp = a.q.data() + m * a.K + 32 * k;
    const __m512i xv = One ? _mm512_maskz_loadu_epi8(keep, xp) : _mm512_loadu_si512(xp);
    const __m512i st = One ? _mm512_maskz_loadu_epi32(lanes, a.starts.data() + at * 8) : _mm512_loadu_si512(a.starts.data() + at * 8);
    const __m512 dx = One ? _mm512_maskz_loadu_ps(lanes, a.dl.data() + at * 8) : _mm512_loadu_ps(a.dl.data() + at * 8);
    acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(st, v, xv)), dx), s, acc[m]);
  }
}

// The weight scales are a stream of their own beside the codes (64 bytes a row of 1024), which the hardware's
// prefetchers left to miss: prefetched this many rows ahead, a cold 6144 x 1024 GEMV went from 34-44 to 58-68 GB/s
// on Zen 5's two cores (one core: 0.7 -> 1.0x the float16 GEMV's rate).
constexpr int64_t kQ8ScaleRows = 8;

// acc[m] (lanes to be summed) = a weight row (q int8 [K], scales [nb]) . activation row m (the first MB of a), 64
// weights a vpdpbusd
template <int MB>
inline void q8_row(const int8_t* w, const at::Half* ws, const Q8Acts& a, __m512 (&acc)[MB]) {
  const int64_t nb = a.nb;
  const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), two = _mm512_set1_epi32(2);
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < nb; k0 += 16) {
    const int64_t blocks = std::min<int64_t>(16, nb - k0);
    _mm_prefetch(reinterpret_cast<const char*>(ws + k0 + kQ8ScaleRows * nb), _MM_HINT_T0);
    const __m512 dw = f16x16(ws + k0, blocks);
    __m512i pair = first;
    int64_t p = 0;
    for (; p + 1 < blocks; p += 2, pair = _mm512_add_epi32(pair, two)) q8_pair<MB, false>(w, dw, pair, a, k0 + p, acc);
    if (p < blocks) q8_pair<MB, true>(w, dw, pair, a, k0 + p, acc);
  }
}

// y[m][n] (N apart) for weight rows n0 .. n1 and the M = MB <= kQ8Rows activation rows of a: a row at a time (one
// stream from memory: rows read side by side, sharing their activation loads, streamed slower), each 16 rows' lane
// sums added at once (gemv.h's sum16)
template <int MB>
inline void q8_decode(const int8_t* w, const at::Half* ws, const Q8Acts& a, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t K = a.K, nb = a.nb;
  for (int64_t n = n0; n < n1; n += 16) {
    const int64_t rows = std::min<int64_t>(16, n1 - n);
    __m512 lanes[MB][16];
    for (int64_t j = 0; j < 16; ++j) {
      __m512 acc[MB];
      if (j < rows) q8_row<MB>(w + (n + j) * K, ws + (n + j) * nb, a, acc);
      else
        for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
      for (int m = 0; m < MB; ++m) lanes[m][j] = acc[m];
    }
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * N + n, static_cast<__mmask16>((1u << rows) - 1), sum16(lanes[m]));
  }
}

inline void q8_decode_rows(int64_t M, const int8_t* w, const at::Half* ws, const Q8Acts& a, int64_t n0, int64_t n1,
                           int64_t N, float* y) {
  using Fn = void (*)(const int8_t*, const at::Half*, const Q8Acts&, int64_t, int64_t, int64_t, float*);
  static constexpr Fn by_rows[kQ8Rows] = {q8_decode<1>, q8_decode<2>, q8_decode<3>, q8_decode<4>,
                                          q8_decode<5>, q8_decode<6>, q8_decode<7>, q8_decode<8>};
  by_rows[M - 1](w, ws, a, n0, n1, N, y);
}

// Q8_0 rows as a GGUF file holds them, blocks of 34 bytes (float16 d, then 32 codes): the rows of that type in a
// packed matrix of several (kq::linear_int8), read where they lie. q8_row's arithmetic, two blocks a vpdpbusd.
constexpr int64_t kQ8Block = 34;

template <int MB>
inline void q8_block_row(const uint8_t* row, const Q8Acts& a, float* out) {
  const int64_t K = a.K, nb = a.nb;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < nb; k += 2) {
    const bool two = k + 1 < nb;
    const uint8_t* b = row + kQ8Block * k;
    _mm_prefetch(reinterpret_cast<const char*>(b) + kGemvPrefetch, _MM_HINT_T0);
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    const __m256i hi = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kQ8Block + 2)) : _mm256_setzero_si256();
    const __m512i v = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), flip);
    const __m512 s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(kq::half(b)), _mm512_set1_ps(two ? kq::half(b + kQ8Block) : 0.f));
    const __mmask64 keep = two ? ~__mmask64{0} : 0xFFFFFFFFull;
    const __mmask16 lanes = two ? 0xFFFF : 0xFF;
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const int64_t at = m * nb + k;
      const __m512i xv = _mm512_maskz_loadu_epi8(keep, a.q.data() + m * K + 32 * k);
      const __m512i sum = _mm512_dpbusd_epi32(_mm512_maskz_loadu_epi32(lanes, a.starts.data() + at * 8), v, xv);
      const __m512 dx = _mm512_maskz_loadu_ps(lanes, a.dl.data() + at * 8);
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), dx), s, acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// out + 64 c, c < cols: lane r = dword c of row r XOR flip, from 16 rows `stride` bytes apart (rows past `rows`: row 0
// again, their lanes never read). A 16 x 16 transpose of dwords per 64 bytes of the rows: 8x faster than gathering
// each column (vpgatherdd) on Zen 5, where the gathers had been a fifth of the Q8_0 GEMM's time. Each row is
// prefetched kTurnAhead bytes ahead: 16 streams at once are more than the hardware's prefetchers follow, and rows
// fresh from memory waited on it (Q8_0 on the Zen 5: gate_up at 9 rows 0.52-0.55 -> 0.40 ms, a 512-token prefill
// 702-823 -> 853-901 tok/s; 256 bytes ahead about the same, 384 and 512 less).
constexpr int64_t kTurnAhead = 128;
inline void transpose_rows(const uint8_t* w, int64_t stride, int64_t rows, int64_t cols, __m512i flip, uint8_t* out) {
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const int64_t n = std::min<int64_t>(16, cols - c0);
    const __mmask16 part = static_cast<__mmask16>((1u << n) - 1);
    __m512i v[16], t[16], u[16], o[16];
    for (int r = 0; r < rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + 4 * c0 + kTurnAhead), _MM_HINT_T0);
    for (int r = 0; r < 16; ++r) v[r] = _mm512_maskz_loadu_epi32(part, w + (r < rows ? r : 0) * stride + 4 * c0);
    for (int i = 0; i < 8; ++i) {  // t: per 128-bit lane L, dwords 4L, 4L + 1 (lo) or 4L + 2, 4L + 3 (hi) of a row pair
      t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int g = 0; g < 4; ++g) {  // u[4g + j], lane L: dword 4L + j of rows 4g .. 4g + 3
      u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
      u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; ++j) {  // o[4L + j]: lane L of u[j], u[4 + j], u[8 + j], u[12 + j]
      const __m512i p0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), p1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
      const __m512i q0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), q1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
      o[j] = _mm512_shuffle_i32x4(p0, q0, 0x88);
      o[4 + j] = _mm512_shuffle_i32x4(p0, q0, 0xDD);
      o[8 + j] = _mm512_shuffle_i32x4(p1, q1, 0x88);
      o[12 + j] = _mm512_shuffle_i32x4(p1, q1, 0xDD);
    }
    for (int64_t c = 0; c < n; ++c) _mm512_storeu_si512(out + 64 * (c0 + c), _mm512_xor_si512(o[c], flip));
  }
}

// 16 weight rows opened for the GEMM: q [K / 4][16][4] (sign bit flipped), dw [nb][16] floats
struct Q8Tile {
  std::vector<uint8_t> q;
  std::vector<float> dw;

  void open(const int8_t* w, const at::Half* ws, int64_t rows, int64_t K) {
    const int64_t nb = K / 32;
    q.resize(K * 16);
    dw.resize(nb * 16);
    transpose_rows(reinterpret_cast<const uint8_t*>(w), K, rows, K / 4, _mm512_set1_epi8(static_cast<char>(0x80)), q.data());
    wide.resize(16 * nb);  // the scales widened row by row, then turned as the codes were
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < nb; k += 16) {
        const int64_t n = std::min<int64_t>(16, nb - k);
        _mm512_mask_storeu_ps(wide.data() + r * nb + k, static_cast<__mmask16>((1u << n) - 1), f16x16(ws + r * nb + k, n));
      }
    transpose_rows(reinterpret_cast<const uint8_t*>(wide.data()), 4 * nb, rows, nb, _mm512_setzero_si512(),
                   reinterpret_cast<uint8_t*>(dw.data()));
  }

  // rows of Q8_0 blocks (kQ8Block bytes each) from `first`, row_bytes apart: each column gathered (the blocks' codes
  // lie 34 bytes apart)
  void open_blocks(const uint8_t* first, int64_t row_bytes, int64_t rows, int64_t K) {
    q.resize(K * 16);
    dw.assign(K / 32 * 16, 0.f);
    const __m512i at = _mm512_mullo_epi32(_mm512_maskz_mov_epi32(static_cast<__mmask16>((1u << rows) - 1),
                                                                  _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                                          _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t c = 0; c < K / 4; ++c)  // row r's dword c at first + r row_bytes + 2 + (c / 8) 34 + 4 (c % 8)
      _mm512_storeu_si512(q.data() + 64 * c, _mm512_xor_si512(_mm512_i32gather_epi32(at, first + 2 + c / 8 * kQ8Block + 4 * (c % 8), 1), flip));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K / 32; ++k) dw[k * 16 + r] = kq::half(first + r * row_bytes + k * kQ8Block);
  }

 private:
  std::vector<float> wide;
};

// y[m][16 j ..] for activation rows m0 .. m0 + MB and the NT tiles t[j] side by side (the last `rows` wide). Two
// tiles a pass (and 6 rows, the registers' bound) let each broadcast of 4 activations feed two vpdpbusd: 1.25-1.3x one
// tile's 8 rows on Zen 5 (1,450-1,500 vs 1,100-1,200 GOP/s, 840 x 1536 x 1024), where the broadcast as vpdpbusd's
// memory operand, twice, measured 1,150-1,250.
template <int NT, int MB>
[[gnu::noinline]] inline void q8_tiles(const Q8Tile* const* t, const Q8Acts& a, int64_t m0, float* y, int64_t ldy, int64_t rows) {
  const int64_t nb = a.nb, K = a.K;
  __m512 acc[NT][MB];
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < nb; ++k) {
    __m512i sum[NT][MB];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NT; ++j) sum[j][m] = _mm512_set1_epi32(a.start[(m0 + m) * nb + k]);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m512i codes[NT];
      for (int j = 0; j < NT; ++j) codes[j] = _mm512_loadu_si512(t[j]->q.data() + ((8 * k + c) * 16) * 4);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        if (NT == 1) {
          sum[0][m] = kq::dot4(sum[0][m], codes[0], a.q.data() + (m0 + m) * K + 32 * k + 4 * c);
          continue;
        }
        int32_t four;
        std::memcpy(&four, a.q.data() + (m0 + m) * K + 32 * k + 4 * c, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int j = 0; j < NT; ++j) sum[j][m] = _mm512_dpbusd_epi32(sum[j][m], codes[j], xv);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 dx = _mm512_set1_ps(a.d[(m0 + m) * nb + k]);
      for (int j = 0; j < NT; ++j)
        acc[j][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[j][m]), _mm512_mul_ps(_mm512_loadu_ps(t[j]->dw.data() + 16 * k), dx), acc[j][m]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NT; ++j) _mm512_mask_storeu_ps(y + (m0 + m) * ldy + 16 * j, j + 1 < NT ? 0xFFFF : keep, acc[j][m]);
}

constexpr int64_t kQ8PairRows = 6;  // activation rows per pass over two tiles

// y[m][..] (ldy apart) for every activation row m of a and nt (1 or 2) opened tiles side by side, the last `rows` wide
inline void q8_tiles_run(const Q8Tile* const* t, int nt, const Q8Acts& a, float* y, int64_t ldy, int64_t rows) {
  using Fn = void (*)(const Q8Tile* const*, const Q8Acts&, int64_t, float*, int64_t, int64_t);
  static constexpr Fn one[kQ8Rows] = {q8_tiles<1, 1>, q8_tiles<1, 2>, q8_tiles<1, 3>, q8_tiles<1, 4>,
                                      q8_tiles<1, 5>, q8_tiles<1, 6>, q8_tiles<1, 7>, q8_tiles<1, 8>};
  static constexpr Fn two[kQ8PairRows] = {q8_tiles<2, 1>, q8_tiles<2, 2>, q8_tiles<2, 3>,
                                          q8_tiles<2, 4>, q8_tiles<2, 5>, q8_tiles<2, 6>};
  if (nt == 2)
    for (int64_t m0 = 0; m0 < a.M; m0 += kQ8PairRows) two[std::min(kQ8PairRows, a.M - m0) - 1](t, a, m0, y, ldy, rows);
  else
    for (int64_t m0 = 0; m0 < a.M; m0 += kQ8Rows) one[std::min(kQ8Rows, a.M - m0) - 1](t, a, m0, y, ldy, rows);
}
constexpr int kQ8AmxTiles = 4;  // weight tiles a block's activations go to (q8_amx_rows)

#if defined(DELTASERVE_AMX)
// Prefill on AMX tiles where they run (amx.h): tdpbsud multiplies 16 activation rows' codes of a block (signed) by a
// weight tile's 16 rows' codes (sign bit flipped: Q8Tile's q is already tdpbsud's weight tile, 8 rows x 64 bytes a
// block) into 16 x 16 int32 sums, which start at the block's offsets (-128 x the activations' sum, for the flipped
// bits) and leave the tile for its scales: the same integer sums and float operations as q8_tiles (the same bits). A block's activations, loaded once, go to up to kQ8AmxTiles weight
// tiles in as many sum tiles (the activations read once per 64 weight rows, not per 16). Tiles: sums 0 .. 3,
// activations 4 (16 x 32 bytes), weights 6, 7 (8 x 64 bytes).
inline const amx::Config kQ8AmxConfig{{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 32}, {16, 32}, {8, 64}, {8, 64}};

// y rows m0 .. m0 + mr (mr <= 16, ldy apart) at the columns of weight tiles w[0 .. nt) (16 each; `last` in the last).
// Block k - 1's sums of weight tile j are scaled after block k's product of tile j is issued, so that the two units
// work at once: scaled after all of block k's products, Q8_0 and Q4_0 ran 1.05-1.20x slower (calls alternating in
// one process, 256-512 x 1024-6144 x 1024-3584).
inline void q8_amx_rows(const Q8Tile* const* w, int nt, const Q8Acts& a, int64_t m0, int64_t mr, float* y, int64_t ldy,
                        int64_t last) {
  const int64_t nb = a.nb, K = a.K;
  alignas(64) int32_t sums[2][kQ8AmxTiles][16][16];  // blocks k and k - 1
  alignas(64) float out[kQ8AmxTiles][16][16];
  const int8_t* x = a.q.data() + m0 * K;
  auto scale = [&](int64_t k, int j) {  // block k's sums of weight tile j, into out
    const auto& s = sums[k & 1];
    const __m512 dw = _mm512_loadu_ps(w[j]->dw.data() + 16 * k);
    for (int64_t m = 0; m < mr; ++m) {
      const int64_t at = (m0 + m) * nb + k;
      const __m512i sum = _mm512_load_si512(s[j][m]);
      const __m512 before = k ? _mm512_load_ps(out[j][m]) : _mm512_setzero_ps();
      _mm512_store_ps(out[j][m], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[at])),
                                                 before));
    }
  };
  // the sums start at the blocks' offsets (a.start: the weights' codes were flipped to unsigned), laid as a tile a
  // block ahead: row m all a.start of activation row m (rows past mr zero)
  alignas(64) int32_t starts[2][16][16];
  auto lay_starts = [&](int64_t k) {
    for (int64_t m = 0; m < 16; ++m)
      _mm512_store_si512(starts[k & 1][m], _mm512_set1_epi32(m < mr ? a.start[(m0 + m) * nb + k] : 0));
  };
  lay_starts(0);
  for (int64_t k = 0; k < nb; ++k) {
    const int32_t* st = &starts[k & 1][0][0];
    _tile_loadd(4, x + 32 * k, K);
    _tile_loadd(0, st, 64);  // (tile numbers are immediates: each tile written out)
    _tile_loadd(6, w[0]->q.data() + 8 * 64 * k, 64);
    _tile_dpbsud(0, 4, 6);
    if (k) scale(k - 1, 0);
    if (nt > 1) {
      _tile_loadd(1, st, 64);
      _tile_loadd(7, w[1]->q.data() + 8 * 64 * k, 64);
      _tile_dpbsud(1, 4, 7);
      if (k) scale(k - 1, 1);
    }
    if (nt > 2) {
      _tile_loadd(2, st, 64);
      _tile_loadd(6, w[2]->q.data() + 8 * 64 * k, 64);
      _tile_dpbsud(2, 4, 6);
      if (k) scale(k - 1, 2);
    }
    if (nt > 3) {
      _tile_loadd(3, st, 64);
      _tile_loadd(7, w[3]->q.data() + 8 * 64 * k, 64);
      _tile_dpbsud(3, 4, 7);
      if (k) scale(k - 1, 3);
    }
    if (k + 1 < nb) lay_starts(k + 1);
    auto& s = sums[k & 1];
    _tile_stored(0, s[0], 64);
    if (nt > 1) _tile_stored(1, s[1], 64);
    if (nt > 2) _tile_stored(2, s[2], 64);
    if (nt > 3) _tile_stored(3, s[3], 64);
  }
  for (int j = 0; j < nt; ++j) scale(nb - 1, j);
  for (int j = 0; j < nt; ++j) {
    const __mmask16 keep = static_cast<__mmask16>((1u << (j + 1 < nt ? 16 : last)) - 1);
    for (int64_t m = 0; m < mr; ++m) _mm512_mask_storeu_ps(y + m * ldy + 16 * j, keep, _mm512_load_ps(out[j][m]));
  }
}
#endif
#else
constexpr bool kQ8Int8 = kBlock32Avx2;  // int8legacy_avx2.h's kernels, or none (float activations)
#endif

// y [M, N] = x [M, K] (rounded per 32 to Q8_0) @ W^T, W int8 [N, K] with float16 scales [N, K / 32].
inline void linear_q8_int8(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor y) {
  TORCH_CHECK(kQ8Int8, "linear_q8_int8 needs AVX-512 VNNI or AVX2");
  check_rows(x, "linear_q8_int8");
  TORCH_CHECK(w.dtype() == at::kChar && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1), "w must be int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ldx = row_stride(x);
  TORCH_CHECK(K % 32 == 0, "Q8_0 rows must be whole blocks of 32, got ", K);
  TORCH_CHECK(scale.dtype() == at::kHalf && scale.is_contiguous() && scale.numel() == N * (K / 32), "scale must be float16 [N, K / 32]");
  TORCH_CHECK(y.dtype() == at::kFloat && y.is_contiguous() && y.size(0) == M && y.size(1) == N, "y must be float32 [M, N]");
#if defined(__AVX2__) || (defined(__AVX512VNNI__) && defined(__AVX512BW__))
  static thread_local Q8Acts decode_acts;  // reused: decode calls are many and small
  Q8Acts prefill_acts;
  Q8Acts& a = M <= kQ8Rows ? decode_acts : prefill_acts;
  a.quantize(x.data_ptr<float>(), M, K, ldx, M > kQ8Rows);
  const int8_t* wp = w.data_ptr<int8_t>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  const int64_t nb = K / 32;
  if (M <= kQ8Rows) {  // decode: a row at a time, from memory once
    at::parallel_for(0, N, std::max<int64_t>(1, (64 << 10) / K), [&](int64_t lo, int64_t hi) {
      const ShareClock clock(hi - lo);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      q8_decode_rows(M, wp, sp, a, lo, hi, N, yp);
#else
      for (int64_t n = lo; n < hi; ++n) {
        float sums[kQ8Rows];
        q8_rows(M, wp + n * K, sp + n * nb, a, 0, sums);
        for (int64_t m = 0; m < M; ++m) yp[m * N + n] = sums[m];
      }
#endif
    });
    return;
  }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#if defined(DELTASERVE_AMX)
  if (amx::enabled()) {
    const int64_t tiles = (N + 15) / 16;
    at::parallel_for(0, (tiles + kQ8AmxTiles - 1) / kQ8AmxTiles, 1, [&](int64_t lo, int64_t hi) {
      const amx::Scope scope(kQ8AmxConfig);
      Q8Tile w[kQ8AmxTiles];
      const Q8Tile* const tiles_of[kQ8AmxTiles] = {&w[0], &w[1], &w[2], &w[3]};
      for (int64_t g = lo; g < hi; ++g) {
        const int nt = static_cast<int>(std::min<int64_t>(kQ8AmxTiles, tiles - g * kQ8AmxTiles));
        const int64_t n0 = 16 * kQ8AmxTiles * g;
        for (int j = 0; j < nt; ++j)
          w[j].open(wp + (n0 + 16 * j) * K, sp + (n0 + 16 * j) * nb, std::min<int64_t>(16, N - n0 - 16 * j), K);
        const int64_t last = std::min<int64_t>(16, N - n0 - 16 * (nt - 1));
        for (int64_t m0 = 0; m0 < M; m0 += 16)
          q8_amx_rows(tiles_of, nt, a, m0, std::min<int64_t>(16, M - m0), yp + m0 * N + n0, N, last);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t lo, int64_t hi) {  // two tiles of 16 weight rows at a time
    Q8Tile w[2];
    const Q8Tile* const pair[2] = {&w[0], &w[1]};
    for (int64_t g = lo; g < hi; ++g) {
      const int64_t n0 = 32 * g, nt = N - n0 > 16 ? 2 : 1;
      for (int j = 0; j < nt; ++j)
        w[j].open(wp + (n0 + 16 * j) * K, sp + (n0 + 16 * j) * nb, std::min<int64_t>(16, N - n0 - 16 * j), K);
      q8_tiles_run(pair, static_cast<int>(nt), a, yp + n0, N, std::min<int64_t>(16, N - n0 - 16 * (nt - 1)));
    }
  });
#elif defined(__AVX2__)
  at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t lo, int64_t hi) {  // prefill: 32 weight rows at a time
    Rows32 tile;
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = 32 * t, rows = std::min<int64_t>(32, N - n0);
      tile.reset(kq::Q8_0, rows, K);
      tile.run_q8(wp + n0 * K, sp + n0 * nb, a, yp + n0, N);
    }
  });
#endif
}

}  // namespace q8
}  // namespace deltaserve
