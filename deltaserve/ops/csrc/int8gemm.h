// The prefill GEMM of K-quant weights on AVX-512 VNNI: 16 weight rows at a time interleaved into a panel, so that
// one vpdpbusd multiplies 4 codes of each of the 16 rows by the same 4 int8 activations (broadcast) and sums them
// in its 16 int32 lanes, one lane per weight row. The per-16 scales then apply per lane (vpmulld, once per 16
// codes), the offsets by vpdpwssd on (offset, offset) pairs against (bsum, bsum) pairs, and the float scales once
// per block: per block and activation row, 64 vpdpbusd do 4096 multiply-adds, against 16 per 256 of the
// row-at-a-time dot (int8dot.h), which stays the kernel of decode, of other ISAs, and of the panel's edges.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "int8dot.h"
#include "int8gemv.h"

namespace deltaserve {
namespace kq {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kPanelGemm = true;

// one block of 16 weight rows, interleaved (rows past the matrix's end are zero: they add nothing)
struct alignas(64) Panel {
  uint8_t q[64][16][4];    // [codes / 4][row][4 codes]
  int32_t sc[16][16];      // [group of 16][row]
  int32_t off[8][16];      // [pair of groups][row]: the two int16 offsets of groups 2p, 2p + 1
  float d[16], o[16];
};

// the panels of weight rows n0 .. n0 + rows (rows <= 16), [nb]
inline void open_panels(const Segments& seg, const uint8_t* base, int64_t n0, int64_t rows, int64_t K,
                        WBlock* scratch, Panel* p) {
  const int64_t nb = K / 256;
  std::memset(static_cast<void*>(p), 0, sizeof(Panel) * nb);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = seg.find(n0 + r);
    open_row(seg.type(s), native_row(seg, base, s, n0 + r, K, row_scratch(K)), nb, scratch);
    for (int64_t b = 0; b < nb; ++b) {
      const WBlock& w = scratch[b];
      for (int c = 0; c < 64; ++c) std::memcpy(p[b].q[c][r], w.q + 4 * c, 4);
      for (int i = 0; i < 16; ++i) p[b].sc[i][r] = w.sc[i];
      for (int i = 0; i < 8; ++i)
        p[b].off[i][r] = static_cast<int32_t>(static_cast<uint16_t>(w.off[2 * i]) | (static_cast<uint32_t>(static_cast<uint16_t>(w.off[2 * i + 1])) << 16));
      p[b].d[r] = w.d;
      p[b].o[r] = w.o;
    }
  }
}

// y[m][0 .. 16) (stride ldy, `rows` lanes stored) = the panel's rows . activation rows m < MB (x: [nb][MB])
template <int MB>
inline void panel_rows(const Panel* p, const XBlock* x, int64_t nb, float* y, int64_t ldy, int64_t rows) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Panel& pb = p[b];
    const XBlock* xb = x + b * MB;
    __m512i blk[MB];
    for (int m = 0; m < MB; ++m) blk[m] = _mm512_setzero_si512();
    for (int i = 0; i < 16; ++i) {  // a group of 16 codes: one scale per row
      __m512i sub[MB];
      for (int m = 0; m < MB; ++m) sub[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 4 * i; c < 4 * i + 4; ++c) {
        const __m512i codes = _mm512_load_si512(pb.q[c]);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          int32_t four;
          std::memcpy(&four, xb[m].q + 4 * c, 4);
          sub[m] = _mm512_dpbusd_epi32(sub[m], codes, _mm512_set1_epi32(four));
        }
      }
      const __m512i sc = _mm512_load_si512(pb.sc[i]);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) blk[m] = _mm512_add_epi32(blk[m], _mm512_mullo_epi32(sub[m], sc));
    }
    const __m512 d = _mm512_load_ps(pb.d), o = _mm512_load_ps(pb.o);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      __m512i off = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) {
        int32_t pair;
        std::memcpy(&pair, xb[m].bs + 2 * i, 4);
        off = _mm512_dpwssd_epi32(off, _mm512_load_si512(pb.off[i]), _mm512_set1_epi32(pair));
      }
      const __m512 dx = _mm512_set1_ps(xb[m].d);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(blk[m]), _mm512_mul_ps(d, dx), acc[m]);
      acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off), _mm512_mul_ps(o, dx), acc[m]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy, keep, acc[m]);
}

inline void panel_group(int64_t mb, const Panel* p, const XBlock* x, int64_t nb, float* y, int64_t ldy, int64_t rows) {
  switch (mb) {
    case 1: return panel_rows<1>(p, x, nb, y, ldy, rows);
    case 2: return panel_rows<2>(p, x, nb, y, ldy, rows);
    case 3: return panel_rows<3>(p, x, nb, y, ldy, rows);
    case 4: return panel_rows<4>(p, x, nb, y, ldy, rows);
    case 5: return panel_rows<5>(p, x, nb, y, ldy, rows);
    case 6: return panel_rows<6>(p, x, nb, y, ldy, rows);
    case 7: return panel_rows<7>(p, x, nb, y, ldy, rows);
    default: return panel_rows<8>(p, x, nb, y, ldy, rows);
  }
}

// y [M, N] = xq (quantize_rows of x [M, K]) @ W^T, threads over tiles of 16 weight rows, each opened into
// panels once and run over every group of activation rows.
inline void gemm_panels(const Segments& seg, const uint8_t* base, const XBlock* xq, int64_t M, int64_t K, float* y) {
  const int64_t nb = K / 256, N = seg.rows;
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t lo, int64_t hi) {
    std::vector<WBlock> scratch(nb);
    std::vector<Panel> panels(nb);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = 16 * t, rows = std::min<int64_t>(16, N - n0);
      open_panels(seg, base, n0, rows, K, scratch.data(), panels.data());
      for (int64_t g = 0; g < M; g += kRows)
        panel_group(std::min<int64_t>(kRows, M - g), panels.data(), xq + g * nb, nb, y + g * N + n0, N, rows);
    }
  });
}
#else
constexpr bool kPanelGemm = false;
inline void gemm_panels(const Segments&, const uint8_t*, const XBlock*, int64_t, int64_t, float*) {}
#endif

// which instructions the integer kernels of this build use (the benchmark prints it)
inline std::string int8_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "AVX-512 VNNI: prefill vpdpbusd on 16-row panels, decode vpmaddubsw + vpdpwssd";
#elif defined(__AVX512BW__)
  return "AVX-512 BW: vpmaddubsw + vpmaddwd";
#elif defined(__AVXVNNI__)
  return "AVX2 + AVX-VNNI: vpmaddubsw + vpdpwssd";
#elif defined(__AVX2__)
  return "AVX2: vpmaddubsw + vpmaddwd";
#else
  return "portable C++";
#endif
}

// y [M, N] = x [M, K] (float32, rounded to Q8_K here) @ W^T, W packed K-quant blocks (segment table as for
// linear_packed). Prefill on AVX-512 VNNI: the panels above. Otherwise threads split the output columns into
// tiles of weight rows (one for decode, opened into L1 and used at once; 16 above, opened into a per-thread
// buffer that stays in L2) multiplied by every group of rows of x.
inline void linear_int8(torch::Tensor x, torch::Tensor bytes, torch::Tensor table, torch::Tensor y) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be float32 [M, K] contiguous");
  TORCH_CHECK(bytes.dtype() == torch::kUInt8 && bytes.is_contiguous(), "packed bytes must be contiguous uint8");
  const int64_t M = x.size(0), K = x.size(1), nb = K / 256;
  const Segments seg(table, K, bytes.numel());
  const int64_t N = seg.rows;
  TORCH_CHECK(y.dtype() == torch::kFloat32 && y.is_contiguous() && y.size(0) == M && y.size(1) == N, "y must be float32 [M, N]");
  for (int64_t s = 0; s < seg.S; ++s)
    TORCH_CHECK(int8_type(seg.type(s)), "linear_int8: GGML type ", seg.type(s), " has no integer kernel");
  // decode (a step makes ~70 of these calls) reuses its thread's buffer; a prefill's is its own, freed after
  static thread_local std::vector<XBlock> decode_buf;
  std::vector<XBlock> prefill_buf;
  std::vector<XBlock>& xbuf = M <= kRows ? decode_buf : prefill_buf;
  if (xbuf.size() < static_cast<size_t>(M * nb)) xbuf.resize(M * nb);
  const XBlock* xq = xbuf.data();
  quantize_rows(x.data_ptr<float>(), M, K, xbuf.data());
  const uint8_t* base = bytes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (kPanelGemm && M > kRows) return gemm_panels(seg, base, xq, M, K, yp);
  if (kDirectGemv && M <= kRows) return gemv_direct(seg, base, xq, M, K, yp);
  const int64_t tile = M <= kRows ? 1 : 16;  // one row: opened into L1 and used at once (decode)
  at::parallel_for(0, (N + tile - 1) / tile, 1, [&](int64_t lo, int64_t hi) {
    std::vector<WBlock> w(tile * nb);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t s = seg.find(n0 + r);
        open_row(seg.type(s), native_row(seg, base, s, n0 + r, K, row_scratch(K)), nb, w.data() + r * nb);
      }
      for (int64_t g = 0; g < M; g += kRows) {
        const int64_t mb = std::min<int64_t>(kRows, M - g);
        for (int64_t r = 0; r < rows; ++r) {
          float sums[kRows];
          dot_group(mb, w.data() + r * nb, xq + g * nb, nb, sums);
          for (int64_t m = 0; m < mb; ++m) yp[(g + m) * N + n0 + r] = sums[m];
        }
      }
    }
  });
}

}  // namespace kq
}  // namespace deltaserve
