// Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL weights (blocks of 32) by integer dot products with activations rounded per 32 to
// Q8_0, the arithmetic llama.cpp runs on these files. Each block's codes open into int8, exact: q - 8 (Q4_0), q - 16
// (Q5_0), q (the _1 types, whose offset m then adds m dx sum(qx) per block, from the rounded activations), IQ4_NL's
// levels (the nibbles index kIQ4Levels; in decode's registers the levels + 128, unsigned, as a bias of 128). Decode
// reads a row's blocks straight into registers (legacy_row); prefill opens 16 rows at a time into a Q8Tile for
// int8q8.h's GEMM, 2 such tiles at a time (run_tiles; on AMX tiles where they run, 4: run_amx). Q8_0 rows beside
// them are read where they lie. Q4_0 rows are held 16 to a row panel where the K-quants' are (panels.h): decode reads
// them with panel_gemv.h's panel_q40, prefill opens a panel with open_q40_panel.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8q8.h"
#include "kquants.h"

namespace deltaserve {
namespace q8 {

// the types of 32-weight blocks these kernels take (beside the K-quants in one packed matrix: kq::linear_int8)
inline bool block32(int64_t type) {
  return type == kq::Q8_0 || type == kq::Q4_0 || type == kq::Q4_1 || type == kq::Q5_0 || type == kq::Q5_1 ||
         type == kq::IQ4_NL;
}

inline bool with_offsets(int64_t type) { return type == kq::Q4_1 || type == kq::Q5_1; }

// A row of nb blocks: codes [32 nb] int8, d [nb] (the blocks' float16), m [nb] (the _1 types' offsets as float)
template <bool ONE, bool FIVE>
inline void open_row32(const uint8_t* row, int64_t nb, int8_t* codes, at::Half* d, float* m) {
  constexpr int64_t bytes = 18 + (ONE ? 2 : 0) + (FIVE ? 4 : 0);
  constexpr int bias = ONE ? 0 : (FIVE ? 16 : 8);
  for (int64_t k = 0; k < nb; ++k) {
    const uint8_t* b = row + k * bytes;
    std::memcpy(d + k, b, 2);
    if (ONE) m[k] = kq::f16(b + 2);
    const uint8_t* qh = b + (ONE ? 4 : 2);  // Q5: bit j of this little-endian u32 is element j's fifth bit
    const uint8_t* qs = qh + (FIVE ? 4 : 0);
    uint32_t h = 0;
    if (FIVE) std::memcpy(&h, qh, 4);
    int8_t* c = codes + 32 * k;
    for (int j = 0; j < 16; ++j) {
      c[j] = static_cast<int8_t>(((qs[j] & 0xF) | ((h >> j) & 1) << 4) - bias);
      c[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4) - bias);
    }
  }
}

// An IQ4_NL row (blocks d f16 | qs[16], element j's level index the low nibble of byte j, 16 + j's the high one)
inline void open_row_iq4nl(const uint8_t* row, int64_t nb, int8_t* codes, at::Half* d) {
  for (int64_t k = 0; k < nb; ++k) {
    const uint8_t* b = row + 18 * k;
    std::memcpy(d + k, b, 2);
    for (int j = 0; j < 16; ++j) {
      codes[32 * k + j] = kq::kIQ4Levels[b[2 + j] & 0xF];
      codes[32 * k + j + 16] = kq::kIQ4Levels[b[2 + j] >> 4];
    }
  }
}

inline void open_row32(int64_t type, const uint8_t* row, int64_t nb, int8_t* codes, at::Half* d, float* m) {
  switch (type) {
    case kq::IQ4_NL: return open_row_iq4nl(row, nb, codes, d);
    case kq::Q4_0: return open_row32<false, false>(row, nb, codes, d, m);
    case kq::Q4_1: return open_row32<true, false>(row, nb, codes, d, m);
    case kq::Q5_0: return open_row32<false, true>(row, nb, codes, d, m);
    case kq::Q5_1: return open_row32<true, true>(row, nb, codes, d, m);
  }
  TORCH_CHECK(false, "open_row32: GGML type ", type, " is not Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL");
}

// sum_k m_k dx_k sum(qx of block k): a _1 row's offsets against activation row `row` of a
inline float offsets(const float* m, const Q8Acts& a, int64_t row) {
  float s = 0.f;
  for (int64_t k = 0; k < a.nb; ++k) s += m[k] * (a.d[row * a.nb + k] * static_cast<float>(-a.start[row * a.nb + k] / 128));
  return s;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The weights of one block pair (TWO) or of a lone last block at b0, 64 codes [lo0 hi0 lo1 hi1] unsigned (the Q5
// fifth bits from a mask; NL: IQ4_NL's levels + 128), and per lane its block's d and (the _1 types) m
template <bool ONE, bool FIVE, bool TWO, bool NL = false>
inline __attribute__((always_inline)) void open_pair(const uint8_t* b0, __m512i& v, __m512& d, __m512& m) {
  constexpr int64_t bytes = 18 + (ONE ? 2 : 0) + (FIVE ? 4 : 0), qh_at = ONE ? 4 : 2, qs_at = qh_at + (FIVE ? 4 : 0);
  const uint8_t* b1 = b0 + bytes;
#if defined(__AVX512VBMI__)
  // both blocks in one masked load (nothing read past them), each qs to two 128-bit lanes by one vpermb (a vpermw
  // of their d and m measured slower than scalar loads)
  constexpr __mmask64 kBytes = (__mmask64{1} << ((TWO ? 2 : 1) * bytes)) - 1;
  const __m512i both = _mm512_maskz_loadu_epi8(kBytes, b0);
  alignas(64) static const auto index = [] {
    std::array<uint8_t, 64> t{};
    for (int i = 0; i < 64; ++i) t[i] = static_cast<uint8_t>((i < 32 ? qs_at : bytes + qs_at) + i % 16);
    return t;
  }();
  const __m512i t = _mm512_permutexvar_epi8(_mm512_load_si512(index.data()), both);
#else
  const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + qs_at));
  const __m128i q1 = TWO ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + qs_at)) : _mm_setzero_si128();
  const __m512i t = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(q0), q0, 1), q1, 2), q1, 3);
#endif
  if constexpr (ONE) {  // d and m of both blocks in one conversion, then to their lanes, 8 a block (four scalar
    // conversions, broadcasts and blends had taken ~18 instructions a pair: Q4_1's rows ran at 42% of a read beside;
    // for d alone, two broadcasts and a blend measured faster than this)
    uint32_t h0, h1 = 0;
    std::memcpy(&h0, b0, 4);
    if (TWO) std::memcpy(&h1, b1, 4);
    const __m512 f = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(h0 | uint64_t{h1} << 32))));
    d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), f);  // [d0 m0 d1 m1]
    m = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), f);
  } else {
    d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(kq::half(b0)), _mm512_set1_ps(TWO ? kq::half(b1) : 0.f));
  }
  v = _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, t, _mm512_srli_epi16(t, 4)), _mm512_set1_epi8(0x0F));
  if (NL) {  // vpshufb looks up within each 128-bit lane: the 16 levels + 128 in every lane
    alignas(16) static const auto levels = [] {
      std::array<uint8_t, 16> t{};
      for (int i = 0; i < 16; ++i) t[i] = static_cast<uint8_t>(kq::kIQ4Levels[i] + 128);
      return t;
    }();
    v = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(levels.data()))), v);
  }
  if (FIVE) {
    uint32_t h0, h1 = 0;
    std::memcpy(&h0, b0 + qh_at, 4);
    if (TWO) std::memcpy(&h1, b1 + qh_at, 4);
    v = _mm512_or_si512(v, _mm512_maskz_set1_epi8(static_cast<__mmask64>(h0) | static_cast<__mmask64>(h1) << 32, 0x10));
  }
}

// acc[m] += the block pair (or lone block) k of a row at b0 . activation row m's blocks k (, k + 1)
template <int MB, bool ONE, bool FIVE, bool TWO, bool NL>
inline __attribute__((always_inline)) void legacy_pair(const uint8_t* b0, const Q8Acts& a, int64_t k, __m512* acc) {
  constexpr int shift = NL ? 0 : FIVE ? 3 : 4;  // -128 sum / 2^shift = -bias sum: bias 128 (NL), 16 (Q5_0), 8 (Q4_0)
  constexpr __mmask64 keep = TWO ? ~__mmask64{0} : 0xFFFFFFFFull;
  constexpr __mmask16 lanes = TWO ? 0xFFFF : 0xFF;
  __m512i v;
  __m512 d, mw = _mm512_setzero_ps();
  open_pair<ONE, FIVE, TWO, NL>(b0, v, d, mw);
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    const int64_t at = m * a.nb + k;
    const __m512i xv = _mm512_maskz_loadu_epi8(keep, a.q.data() + m * a.K + 32 * k);
    const __m512i starts = _mm512_maskz_loadu_epi32(lanes, a.starts.data() + at * 8);  // -128 sum(qx) per lane
    const __m512 dx = _mm512_maskz_loadu_ps(lanes, a.dl.data() + at * 8);
    if (ONE) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), v, xv));
      const __m512 xsum = _mm512_mul_ps(_mm512_cvtepi32_ps(starts), _mm512_set1_ps(-1.f / 128));
      acc[m] = _mm512_fmadd_ps(_mm512_fmadd_ps(sum, d, _mm512_mul_ps(xsum, mw)), dx, acc[m]);
    } else {
      const __m512i sum = _mm512_dpbusd_epi32(_mm512_srai_epi32(starts, shift), v, xv);
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), dx), d, acc[m]);
    }
  }
}

// out[m] = row . activation row m of a (m < MB) for a row of Q4_0 / Q4_1 / Q5_0 / Q5_1, two blocks a vpdpbusd
// (q8_block_row's lanes): bias x sum(qx) taken off through the lanes' starts (-128 sum(qx) per 4, shifted: exact),
// or the _1 types' m dx sum(qx) added per lane in float
template <int MB, bool ONE, bool FIVE, bool NL>
inline void legacy_row(const uint8_t* row, const Q8Acts& a, float* out) {
  constexpr int64_t bytes = 18 + (ONE ? 2 : 0) + (FIVE ? 4 : 0);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 1 < a.nb; k += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(row + bytes * k) + kGemvPrefetch, _MM_HINT_T0);
    legacy_pair<MB, ONE, FIVE, true, NL>(row + bytes * k, a, k, acc);
  }
  if (k < a.nb) legacy_pair<MB, ONE, FIVE, false, NL>(row + bytes * k, a, k, acc);
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// y[m * ldy + r] = (row r of `rows`, row_bytes apart) . activation row m of a (m < MB) by ROW, a run of rows a call
// (a call, a dispatch and two switches per row had held Q4_1's decode rows below 80% of a read beside)
template <int MB, void (*ROW)(const uint8_t*, const Q8Acts&, float*)>
void each_row32(const uint8_t* row, int64_t rows, int64_t row_bytes, const Q8Acts& a, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    float sums[MB];
    ROW(row + r * row_bytes, a, sums);
    for (int m = 0; m < MB; ++m) y[m * ldy + r] = sums[m];
  }
}

using Rows32Run = void (*)(const uint8_t*, int64_t, int64_t, const Q8Acts&, float*, int64_t);

template <template <int> class Row>
inline Rows32Run run_of(int64_t M) {
  switch (M) {
    case 1: return each_row32<1, Row<1>::f>;
    case 2: return each_row32<2, Row<2>::f>;
    case 3: return each_row32<3, Row<3>::f>;
    case 4: return each_row32<4, Row<4>::f>;
    case 5: return each_row32<5, Row<5>::f>;
    case 6: return each_row32<6, Row<6>::f>;
    case 7: return each_row32<7, Row<7>::f>;
    default: return each_row32<8, Row<8>::f>;
  }
}

template <bool ONE, bool FIVE, bool NL = false>
struct LegacyRow {
  template <int MB>
  struct Of {
    static constexpr auto f = legacy_row<MB, ONE, FIVE, NL>;
  };
};

template <int MB>
struct Q8Row {
  static constexpr auto f = q8_block_row<MB>;
};

// y[m * ldy + r] = (row r of `rows` of one of the block32 types, row_bytes apart) . activation row m of a, m < M <=
// kQ8Rows (decode)
inline void rows32_run(int64_t type, int64_t M, const uint8_t* row, int64_t rows, int64_t row_bytes, const Q8Acts& a,
                       float* y, int64_t ldy) {
  Rows32Run run = nullptr;
  switch (type) {
    case kq::Q8_0: run = run_of<Q8Row>(M); break;
    case kq::Q4_0: run = run_of<LegacyRow<false, false>::Of>(M); break;
    case kq::Q4_1: run = run_of<LegacyRow<true, false>::Of>(M); break;
    case kq::Q5_0: run = run_of<LegacyRow<false, true>::Of>(M); break;
    case kq::Q5_1: run = run_of<LegacyRow<true, true>::Of>(M); break;
    case kq::IQ4_NL: run = run_of<LegacyRow<false, false, true>::Of>(M); break;
    default: TORCH_CHECK(false, "rows32_run: GGML type ", type, " is not of 32-weight blocks");
  }
  run(row, rows, row_bytes, a, y, ldy);
}

// up to 16 rows of one of the block32 types, opened for the GEMM
struct Tile32 {
  Q8Tile tile;
  std::vector<int8_t> codes;
  std::vector<at::Half> d;
  std::vector<float> m;
  bool offsets_ = false;

  // `rows` rows from `first`, row_bytes apart
  void open(int64_t type, const uint8_t* first, int64_t row_bytes, int64_t rows, int64_t K) {
    offsets_ = with_offsets(type);
    if (type == kq::Q8_0) return tile.open_blocks(first, row_bytes, rows, K);
    const int64_t nb = K / 32;
    codes.resize(16 * K), d.resize(16 * nb), m.resize(16 * nb);
    for (int64_t r = 0; r < rows; ++r)
      open_row32(type, first + r * row_bytes, nb, codes.data() + r * K, d.data() + r * nb, m.data() + r * nb);
    tile.open(codes.data(), d.data(), rows, K);
  }

#if defined(__AVX512BW__)
  // the 16 rows of a Q4_0 row panel (panels.h: a head of the blocks' d, then 4 runs of 64 bytes a block) straight into
  // the tile's layout: run j holds bytes 4j .. 4j + 3 of each row's qs at 32-bit lane r, whose low nibbles are row r's
  // dword j of the block and whose high nibbles its dword 4 + j (no detour through rows for Q8Tile::open to gather).
  void open_q40_panel(const uint8_t* panel, int64_t K) {
    offsets_ = false;
    const int64_t nb = K / 32;
    tile.q.resize(16 * K);
    tile.dw.resize(16 * nb);
    const __m512i m4 = _mm512_set1_epi8(0xF), flipped = _mm512_set1_epi8(120);  // (q - 8) ^ 0x80 = q + 120
    for (int64_t b = 0; b < nb; ++b) {
      _mm512_storeu_ps(tile.dw.data() + 16 * b,
                       _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 32 * b))));
      uint8_t* q = tile.q.data() + 8 * 64 * b;
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(panel + 32 * nb + 256 * b + 64 * j);
        _mm512_storeu_si512(q + 64 * j, _mm512_add_epi8(_mm512_and_si512(v, m4), flipped));
        _mm512_storeu_si512(q + 64 * (4 + j), _mm512_add_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), flipped));
      }
    }
  }
#endif

  // the _1 types' m dx sum(qx) per block, added to y (nothing for the others)
  void add_offsets(const Q8Acts& a, float* y, int64_t ldy, int64_t rows) const {
    if (offsets_)
      for (int64_t r = 0; r < a.M; ++r)
        for (int64_t n = 0; n < rows; ++n) y[r * ldy + n] += offsets(m.data() + n * a.nb, a, r);
  }
};

constexpr int kQ8PairTiles = 2;  // opened tiles run together in registers (q8_tiles)

// up to kQ8PairTiles opened tiles whose columns lie 16 apart from y's first (the last one `last` wide), run as one in
// registers (int8q8.h q8_tiles: a broadcast of the activations for both)
inline void run_tiles(const Tile32* const* t, int nt, const Q8Acts& a, float* y, int64_t ldy, int64_t last) {
  const Q8Tile* w[kQ8PairTiles] = {&t[0]->tile, &t[nt - 1]->tile};
  q8_tiles_run(w, nt, a, y, ldy, last);
  for (int j = 0; j < nt; ++j) t[j]->add_offsets(a, y + 16 * j, ldy, j + 1 < nt ? 16 : last);
}

#if defined(DELTASERVE_AMX)
// up to kQ8AmxTiles opened tiles whose columns lie 16 apart from y's first (the last one `last` wide), run as one on
// AMX tiles (int8q8.h q8_amx_rows: a block's activations loaded once for all of them)
inline void run_amx(const Tile32* const* t, int nt, const Q8Acts& a, float* y, int64_t ldy, int64_t last) {
  const amx::Scope scope(kQ8AmxConfig);
  const Q8Tile* w[kQ8AmxTiles];
  for (int j = 0; j < nt; ++j) w[j] = &t[j]->tile;
  for (int64_t g = 0; g < a.M; g += 16) q8_amx_rows(w, nt, a, g, std::min<int64_t>(16, a.M - g), y + g * ldy, ldy, last);
  for (int j = 0; j < nt; ++j) t[j]->add_offsets(a, y + 16 * j, ldy, j + 1 < nt ? 16 : last);
}
#endif
#elif !defined(__AVX2__)
// (kq::int8_type takes these types only where the kernels above or int8legacy_avx2.h's are built)
inline void rows32_run(int64_t, int64_t, const uint8_t*, int64_t, int64_t, const Q8Acts&, float*, int64_t) {
  TORCH_CHECK(false, "integer kernels of 32-weight blocks need AVX-512 VNNI or AVX2");
}
#endif

}  // namespace q8
}  // namespace deltaserve
