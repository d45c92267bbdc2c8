// The prefill GEMM of K-quant weights (Q2_K .. Q6_K) on AVX2, for CPUs without AVX-512 VNNI: tiles of 8 weight rows,
// one int32 lane per row, as int8legacy_avx2.h's Rows32 for the 32-weight blocks. Each row's blocks are opened as
// int8dot.h opens them (unsigned codes, int16 scales and offsets per 16, d and o) and then laid out so that one
// vpmaddubsw multiplies 4 codes of 8 rows by 4 activations broadcast; the products of a 16-code group are summed in
// int16 over its steps (4, or 2 for Q6_K's codes up to 63: a pair of products is at most 2 x 63 x 127; Q4_K's
// codes up to 15 over its sub-block's 8, one scale for two groups: 8 x 2 x 15 x 127 = 30,480) before one
// vpmaddwd times the rows' scales widens them, where the row-at-a-time dot (int8dot.h dot_rows) takes a vpmaddwd
// and an add per step and reloads every activation row per weight row.
//
//   block . x  =  d dx sum_g sc_g sum_(e in g) code_e q_e  -  o dx sum_g off_g bsum_g      (g: groups of 16)
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8dot.h"
#include "int8tiles32_avx2.h"

namespace deltaserve {
namespace kq {

#if defined(DELTASERVE_BLOCK32_AVX2)

// up to 8 opened rows: codes [nb][64 steps][8 rows][4], scales [nb][16 groups][8 rows][2] (each row's twice, for
// vpmaddwd's pairs), offsets [nb][8 pairs of groups][8 rows][2] and, for the types whose mins are per 32 (Q4_K,
// Q5_K: a group's equals its neighbour's), off32 [nb][4 pairs of sub-blocks][8 rows][2], d and o [nb][8]
struct KTile8 {
  std::vector<uint8_t> q;
  std::vector<int16_t> sc, off, off32;
  std::vector<float> d, o;
  int64_t nb = 0, rows = 0;

  // from w [n][blocks] (int8dot.h open_row's), n <= 8
  void open(const WBlock* w, int64_t n, int64_t blocks) {
    nb = blocks, rows = n;
    q.resize(nb * 2048), sc.assign(nb * 256, 0), off.assign(nb * 128, 0), off32.assign(nb * 64, 0), d.assign(nb * 8, 0.f),
        o.assign(nb * 8, 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      for (int c = 0; c < 8; ++c) {  // 32 codes of the 8 rows into 8 steps of 4 codes x 8 rows
        __m256i v[8];
        for (int r = 0; r < 8; ++r)
          v[r] = r < rows ? _mm256_load_si256(reinterpret_cast<const __m256i*>(w[r * nb + b].q + 32 * c)) : _mm256_setzero_si256();
        q8::transpose8(v);
        for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + b * 2048 + (8 * c + j) * 32), v[j]);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const WBlock& wb = w[r * nb + b];
        for (int g = 0; g < 16; ++g) sc[b * 256 + g * 16 + 2 * r] = sc[b * 256 + g * 16 + 2 * r + 1] = wb.sc[g];
        for (int p = 0; p < 8; ++p) {
          off[b * 128 + p * 16 + 2 * r] = wb.off[2 * p];
          off[b * 128 + p * 16 + 2 * r + 1] = wb.off[2 * p + 1];
        }
        for (int p = 0; p < 4; ++p) {
          off32[b * 64 + p * 16 + 2 * r] = wb.off[4 * p];
          off32[b * 64 + p * 16 + 2 * r + 1] = wb.off[4 * p + 2];
        }
        d[b * 8 + r] = wb.d, o[b * 8 + r] = wb.o;
      }
    }
  }

  // y[m][8 t .. 8 t + tiles[t].rows) (ldy apart) for activation rows m of xq (quantize_rows of M rows), tiles in
  // turn (NV at a time) for each MB rows of xq, so that those stay in L1 across the tiles (one tile at a time over
  // all of xq read it from L3 at every tile where it outgrows L2: 512 x 3584 activations are 2 MB); STEPS: see the
  // top. NV 2 x MB 3 against 1 x 4 (same bits), 2 threads at 512 x 3584 x 1024: Q4_K 343-346 -> 366 GOP/s, Q3_K
  // 299-309 -> 335, IQ4_XS 207-208 -> 227-231; Q6_K's sums leave int16 every 2 steps, and its 12 sums of two tiles
  // spilled there (286-299 -> 239-241), so it keeps one tile. The float sums live in memory (once a block), which
  // measured neutral for these and let IQ4_XS take 2 x 4.
  // SIGNED: codes are signed bytes (IQ4_XS's levels where int8dot.h's kIQ4Signed): |code| into vpmaddubsw, the
  // activations given the code's sign (a pair of products then reaches 2 x 127 x 127: STEPS 1, each step's pairs
  // widened into the row's sums at once); NV 2 x MB 4 against 2 x 3, calls alternating in one process: IQ4_XS
  // 1.03-1.05x (61 x 200 x 1024 to 512 x 1024 x 3584), the IQ4_XS file's prefill 1.02-1.05x (the K-quants
  // 0.97-1.03x, the Q4_K_M file's prefill 0.985-1.006x)
  // MINS32: offsets per 32 (off32 by the activations' bs32: half the vpmaddwd of off by bs)
  template <int STEPS, bool SIGNED = false, bool MINS32 = false>
  static void run(const KTile8* tiles, int64_t count, const XBlock* xq, int64_t M, float* y, int64_t ldy) {
    constexpr int NV = STEPS == 2 ? 1 : 2, MB = NV == 2 && !SIGNED ? 3 : 4;
    for (int64_t g = 0; g < M; g += MB)
      for (int64_t t = 0; t < count; t += NV) {
        float* out = y + g * ldy + 8 * t;
        if (t + NV <= count) rows_by<MB, NV, STEPS, SIGNED, MINS32>(tiles + t, xq, M, g, out, ldy);
        else rows_by<MB, 1, STEPS, SIGNED, MINS32>(tiles + t, xq, M, g, out, ldy);
      }
  }

 private:
  // rows_of for min(MB, M - m0) activation rows
  template <int MB, int NV, int STEPS, bool SIGNED, bool MINS32>
  static void rows_by(const KTile8* t, const XBlock* xq, int64_t M, int64_t m0, float* y, int64_t ldy) {
    switch (std::min<int64_t>(MB, M - m0)) {
      case 1: return rows_of<1, NV, STEPS, SIGNED, MINS32>(t, xq, M, m0, y, ldy);
      case 2: return rows_of<2, NV, STEPS, SIGNED, MINS32>(t, xq, M, m0, y, ldy);
      case 3: return rows_of<3, NV, STEPS, SIGNED, MINS32>(t, xq, M, m0, y, ldy);
      default: return rows_of<MB, NV, STEPS, SIGNED, MINS32>(t, xq, M, m0, y, ldy);
    }
  }

  // s[i][v] += the products of STEPS steps from `first` (summed in int16) times their group's scales (tile v's at
  // `group`); each activation broadcast serves NV tiles
  template <int MB, int NV, int STEPS, bool SIGNED>
  static inline __attribute__((always_inline)) void add_steps(const KTile8* t, int64_t b, const XBlock* const* xb, int first,
                                                              int group, __m256i* s) {
    if constexpr (SIGNED) {  // STEPS 1: each pair of products widened at once into its row's sum (no int16 sums)
      for (int v = 0; v < NV; ++v) {
        const __m256i cv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[v].q.data() + b * 2048 + first * 32));
        const __m256i mag = _mm256_sign_epi8(cv, cv);
        const __m256i scv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[v].sc.data() + b * 256 + group * 16));
#pragma GCC unroll 4
        for (int i = 0; i < MB; ++i) {
          const __m256i sx = _mm256_sign_epi8(q8::broadcast4(xb[i]->q + 4 * first), cv);
          s[i * NV + v] = _mm256_add_epi32(s[i * NV + v], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, sx), scv));
          asm("" : "+x"(s[i * NV + v]));  // in step order
        }
      }
      return;
    }
    __m256i p[MB * NV];
    for (int i = 0; i < MB * NV; ++i) p[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int step = first; step < first + STEPS; ++step) {
      __m256i cv[NV], mag[NV];
      for (int v = 0; v < NV; ++v) {
        cv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[v].q.data() + b * 2048 + step * 32));
        mag[v] = SIGNED ? _mm256_sign_epi8(cv[v], cv[v]) : cv[v];
      }
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = q8::broadcast4(xb[i]->q + 4 * step);
        for (int v = 0; v < NV; ++v) {
          p[i * NV + v] = _mm256_add_epi16(p[i * NV + v], _mm256_maddubs_epi16(mag[v], SIGNED ? _mm256_sign_epi8(xv, cv[v]) : xv));
          asm("" : "+x"(p[i * NV + v]));  // the sums in step order: GCC's reassociated tree held every product and spilled
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m256i scv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[v].sc.data() + b * 256 + group * 16));
      for (int i = 0; i < MB; ++i) s[i * NV + v] = _mm256_add_epi32(s[i * NV + v], _mm256_madd_epi16(p[i * NV + v], scv));
    }
  }

  // activation rows m0 .. m0 + MB by the NV tiles t[0 .. NV) (8 NV weight rows): one broadcast of 4 activations
  // multiplies 8 NV rows' codes, fewer loads a product than one tile (on the AMX Xeon's AVX2 build, a loop of Q4_K
  // steps in L1: NV 2 x MB 3 ~126 G products/s a core, NV 1 x MB 4 ~115)
  template <int MB, int NV, int STEPS, bool SIGNED, bool MINS32>
  static void rows_of(const KTile8* t, const XBlock* xq, int64_t M, int64_t m0, float* y, int64_t ldy) {
    const int64_t nb = t[0].nb;
    alignas(32) float acc[MB * NV][8] = {};  // in memory: the int32 sums fill the registers (touched once a block)
    for (int64_t b = 0; b < nb; ++b) {
      const XBlock* xb[MB];
      for (int i = 0; i < MB; ++i) xb[i] = xq + xblock_at(M, nb, m0 + i, b);
      __m256i s[MB * NV];
      for (int i = 0; i < MB * NV; ++i) s[i] = _mm256_setzero_si256();
      if constexpr (STEPS == 8) {  // Q4_K: a scale per 2 groups
#pragma GCC unroll 2
        for (int grp = 0; grp < 16; grp += 2) add_steps<MB, NV, 8, SIGNED>(t, b, xb, 4 * grp, grp, s);
      } else {
        for (int grp = 0; grp < 16; ++grp)
#pragma GCC unroll 2
          for (int h = 0; h < 4; h += STEPS) add_steps<MB, NV, STEPS, SIGNED>(t, b, xb, 4 * grp + h, grp, s);
      }
      for (int v = 0; v < NV; ++v) {
        const __m256 db = _mm256_loadu_ps(t[v].d.data() + 8 * b), ob = _mm256_loadu_ps(t[v].o.data() + 8 * b);
        const int16_t* ob16 = MINS32 ? t[v].off32.data() + b * 64 : t[v].off.data() + b * 128;
#pragma GCC unroll 4
        for (int i = 0; i < MB; ++i) {
          float* at = acc[i * NV + v];
          const __m256 dx = _mm256_set1_ps(xb[i]->d);
          __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i * NV + v]), _mm256_mul_ps(db, dx), _mm256_load_ps(at));
          if constexpr (SIGNED) {  // IQ4_XS's levels: no offsets (o = 0)
            _mm256_store_ps(at, a);
            continue;
          }
          __m256i offs = _mm256_setzero_si256();
          for (int p = 0; p < (MINS32 ? 4 : 8); ++p) {
            int32_t pair;
            std::memcpy(&pair, (MINS32 ? xb[i]->bs32 : xb[i]->bs) + 2 * p, 4);
            offs = _mm256_add_epi32(offs, _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ob16 + p * 16)),
                                                            _mm256_set1_epi32(pair)));
          }
          _mm256_store_ps(at, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(offs), _mm256_mul_ps(ob, dx), a));
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      __m256 out[MB];
      for (int i = 0; i < MB; ++i) out[i] = _mm256_load_ps(acc[i * NV + v]);
      q8::store_lanes(out, MB, y + 8 * v, ldy, t[v].rows);
    }
  }
};
#endif

}  // namespace kq
}  // namespace deltaserve
