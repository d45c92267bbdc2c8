// The prefill GEMM of K-quant weights on AVX-512 VNNI: 16 weight rows at a time opened into Panels (int8panel.h), so
// that one vpdpbusd multiplies 4 codes of each of the 16 rows by the same 4 int8 activations (broadcast) and sums
// them in its 16 int32 lanes, one lane per weight row. The scales then apply per lane (vpdpwssd per 16 codes where
// their sums fit int16, else in float32 per 16 or 32: narrow_sums), the offsets by vpdpwssd on (offset, offset) pairs
// against (bsum, bsum) pairs, and the float scales once per block: per block and activation row, 64 vpdpbusd do 4096
// multiply-adds, against 16 per 256 of the row-at-a-time dot (int8dot.h), which stays the kernel of decode, of other
// ISAs, and of the panel's edges. Where AMX runs (amx.h) the same Panels, their codes multiplied by their scales, are
// the tiles' weights (int8gemm_amx.h). A thread opens up to 8 weight tiles at a time and passes every group of
// activation rows over all of them, so the activations come from L1 / L2, not L3. linear_int8 below is the call
// (decode: panel_gemv.h's gemv_direct).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "amx.h"
#include "int8dot.h"
#include "int8gemm_amx.h"
#include "int8gemv_avx2.h"
#include "int8ktile_avx2.h"
#include "int8panel.h"
#include "panel_gemv.h"
#include "shares.h"
#include "xrows.h"

namespace deltaserve {
namespace kq {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kPanelGemm = true;
// activation rows per pass over a panel: 10 chains of vpdpbusd (latency 4, two a cycle on Zen 5) and their sums in
// registers; against 8: +2-4% at 256-512 x 1024-6144 x 1024-3584 (Q4_K, IQ4_XS, Q6_K; the same bits), where 12
// spilled (-1% to +5%). x is quantised in groups of this many rows for it (xblock_at's group).
constexpr int64_t kPanelRows = 10;

// whether a type's codes times 16 activations fit in int16 (codes < 16, |x| <= 127: 16 x 15 x 127 = 30,480), so that
// one vpdpwssd scales the 16 codes' int32 sums (their low halves) and adds them: 1 uop per 4 vpdpbusd, where vpmulld
// and vpaddd per 32 codes take 3 per 8 (vpmulld is 2 uops on Intel). On the AMX Xeon's vpdpbusd path (DELTASERVE_AMX=0,
// 256 x 6144 x 1024 and 256 x 1024 x 3584): Q4_K 1.03-1.07x, Q2_K and Q3_K 1.14-1.23x; the Q4_K_M 0.8B file's
// prefill 1.03x. Q5_K's codes reach 31, Q6_K's 63, IQ4_XS's 241: their group sums are scaled in float32
// (vcvtdq2ps + vfmadd, 2 uops, where vpmulld + vpaddd took 3: Q5_K, Q6_K and IQ4_XS GEMMs 1.02-1.11x). Each group's
// product is exact in float32 (below 2^24: 16 x 63 x 127 x 128 for Q6_K); their sum over a block rounds where it
// passes 2^24, as the int32 block sum's conversion did.
inline bool narrow_sums(int64_t type) { return type == Q2_K || type == Q3_K || type == Q4_K; }

// y[m][0 .. 16) (stride ldy, `rows` lanes stored) = the panel's rows . activation rows m < MB (x: [nb][MB]). G: codes
// per offset: 32 for the per32 types (Q4_K, Q5_K, IQ4_XS), whose panels pair their offsets by 32, which halves the
// multiplies by offsets; 16 for the others. Narrow (narrow_sums): the scales apply per 16 codes by vpdpwssd; else per G
// in float32.
template <int MB, int G, bool Narrow>
inline void panel_rows(const Panel* p, const XBlock* x, int64_t nb, float* y, int64_t ldy, int64_t rows) {
  constexpr int S = Narrow ? 16 : G;  // codes per scale step
  constexpr int kChunks = S / 4;      // vpdpbusd steps (4 codes a lane) per scale step
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Panel& pb = p[b];
    const XBlock* xb = x + b * MB;
    __m512i blk[MB];  // the block's sums: Narrow int32, else float32
    __m512 blkf[MB];
    for (int m = 0; m < MB; ++m) {
      if constexpr (Narrow) blk[m] = _mm512_setzero_si512();
      else blkf[m] = _mm512_setzero_ps();
    }
#pragma GCC unroll 1
    for (int i = 0; i < 256 / S; ++i) {  // a group of S codes: one scale per row
      __m512i sub[MB];
      for (int m = 0; m < MB; ++m) sub[m] = fresh_zero();
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; ++c) {
        const __m512i codes = _mm512_load_si512(pb.q[kChunks * i + c]);
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) sub[m] = dot4(sub[m], codes, xb[m].q + 4 * (kChunks * i + c));
      }
      const __m512i sc = _mm512_load_si512(pb.sc[i * S / 16]);
      if constexpr (Narrow) {
        const __m512i sc16 = _mm512_and_si512(sc, _mm512_set1_epi32(0xFFFF));  // (Q3_K's are signed: high halves of ones)
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) add_scaled16(blk[m], sub[m], sc16);
      } else {
        const __m512 scf = _mm512_cvtepi32_ps(sc);
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) blkf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sub[m]), scf, blkf[m]);
      }
    }
    const __m512 d = _mm512_load_ps(pb.d), o = _mm512_load_ps(pb.o);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      __m512i off = _mm512_setzero_si512();
      for (int i = 0; i < 128 / G; ++i) {  // pairs of offsets (int8panel.h) times pairs of the activations' sums
        int32_t pair;
        std::memcpy(&pair, (G == 32 ? xb[m].bs32 : xb[m].bs) + 2 * i, 4);
        off = _mm512_dpwssd_epi32(off, _mm512_load_si512(pb.off[i]), _mm512_set1_epi32(pair));
      }
      const __m512 dx = _mm512_set1_ps(xb[m].d);
      acc[m] = _mm512_fmadd_ps(Narrow ? _mm512_cvtepi32_ps(blk[m]) : blkf[m], _mm512_mul_ps(d, dx), acc[m]);
      acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off), _mm512_mul_ps(o, dx), acc[m]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy, keep, acc[m]);
}

template <int G, bool Narrow>
inline void panel_group(int64_t mb, const Panel* p, const XBlock* x, int64_t nb, float* y, int64_t ldy, int64_t rows) {
  using Fn = void (*)(const Panel*, const XBlock*, int64_t, float*, int64_t, int64_t);
  static constexpr Fn by_rows[kPanelRows] = {
      panel_rows<1, G, Narrow>, panel_rows<2, G, Narrow>, panel_rows<3, G, Narrow>, panel_rows<4, G, Narrow>,
      panel_rows<5, G, Narrow>, panel_rows<6, G, Narrow>, panel_rows<7, G, Narrow>, panel_rows<8, G, Narrow>,
      panel_rows<9, G, Narrow>, panel_rows<10, G, Narrow>};
  by_rows[std::min<int64_t>(mb, kPanelRows) - 1](p, x, nb, y, ldy, rows);
}

// the tiles a thread of gemm_panels opens: scratch per row, Panels, and their widened form (AMX only)
struct Opened {
  std::vector<WBlock> scratch;
  std::vector<Panel> panels;
#if defined(DELTASERVE_AMX)
  std::vector<WidePanel> wide;
#endif
};

// y [M, N] = xq (quantize_rows of x [M, K]) @ W^T, threads over tiles of up to 16 weight rows of one segment (its
// row panels, then its other rows 16 at a time), each opened into Panels once (a segment of 32-weight blocks': into
// a q8::Tile32, multiplied by x rounded per 32, x8) and run over every group of activation rows.
inline void gemm_panels(const Segments& seg, const uint8_t* base, const XBlock* xq, const q8::Q8Acts& x8, int64_t M,
                        int64_t K, float* y, int64_t group) {
  const int64_t nb = K / 256, N = seg.rows;
  struct Tile {
    int64_t s, n0, rows;
    bool panel;
  };
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < seg.S; ++s) {
    const int64_t pend = seg.first(s) + seg.panel_rows(s);
    for (int64_t n = seg.first(s); n < pend; n += kPanel) tiles.push_back({s, n, kPanel, true});
    for (int64_t n = pend; n < seg.end(s); n += kPanel) tiles.push_back({s, n, std::min(kPanel, seg.end(s) - n), false});
  }
#if defined(DELTASERVE_AMX)
  const bool tiled = amx::enabled();
  const std::vector<int8_t> codes = tiled ? amx_codes(xq, M, K) : std::vector<int8_t>{};
#endif
  constexpr size_t kOpen = 8;  // weight tiles opened at a time: each group of activation rows passes over all of them
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t lo, int64_t hi) {
    // each thread's, kept across calls (every opening writes all it reads): made per call, in sizes that vary with
    // K, they left the worker thread's glibc arena (never trimmed after loading, loader/memory.py) 9 MB of freed
    // blocks, a 0.8B IQ4_XS model's peak RSS 810 -> 799 MB on the AMX Xeon
    static thread_local Opened mine;
    std::vector<WBlock>& scratch = mine.scratch;
    std::vector<Panel>& panels = mine.panels;
    scratch.resize(nb);
    panels.resize(kOpen * nb);
#if defined(DELTASERVE_AMX)
    std::vector<WidePanel>& wide = mine.wide;
    wide.resize(tiled ? kOpen * nb : 0);
#endif
    q8::Tile32 tile32[q8::kQ8AmxTiles];
    const int cap32 = amx::enabled() ? q8::kQ8AmxTiles : q8::kQ8PairTiles;
    int n32 = 0;  // tiles opened in tile32 and not yet run: adjacent columns from first32, the last `last32` wide
    int64_t first32 = 0, last32 = 0;
    const q8::Tile32* const t32[q8::kQ8AmxTiles] = {&tile32[0], &tile32[1], &tile32[2], &tile32[3]};
    auto run32 = [&] {
      if (!n32) return;
#if defined(DELTASERVE_AMX)
      if (tiled) q8::run_amx(t32, n32, x8, y + first32, N, last32);
      else
#endif
        q8::run_tiles(t32, n32, x8, y + first32, N, last32);
      n32 = 0;
    };
    std::vector<std::pair<int64_t, int64_t>> open;  // the opened tiles' (first column, columns), all of one kind:
    // offsets per 32 (Q4_K, Q5_K, IQ4_XS; else 16), offsets at dmin (Q2_K, Q4_K, Q5_K), narrow_sums
    bool by32 = false, mins = false, narrow = false;
    // the bytes of the next tiles to open (those of tile `from`'s segment), read into L2 while the open ones run: the
    // opening reads them in bursts, after which memory's prefetchers start cold (Q4_K_M gate_up on the Zen 5 at 17-128
    // rows: 6-9% less time; a 512-token prefill the same)
    auto ahead = [&](int64_t from) -> std::pair<const uint8_t*, int64_t> {
      if (from >= hi) return {nullptr, 0};
      const int64_t s = tiles[from].s, type = seg.type(s), row_bytes = K / layout(type).block * layout(type).bytes;
      int64_t rows = 0;
      for (int64_t t = from; t < hi && t < from + static_cast<int64_t>(kOpen) && tiles[t].s == s; ++t) rows += tiles[t].rows;
      return {seg.row(base, s, tiles[from].n0, K), rows * row_bytes};
    };
    auto run = [&](int64_t next) {  // the open tiles over every group of x; `next`: the tile to open after them
#if defined(DELTASERVE_AMX)
      if (tiled && !open.empty())
        amx_group(panels.data(), wide.data(), mins ? (by32 ? 32 : 16) : 0, open, codes.data(), xq, M, K, y, N);
      else
#endif
      {
        const auto [p, bytes] = ahead(next);
        const int64_t groups = (M + group - 1) / group;
        const auto rows_of = by32 ? (narrow ? panel_group<32, true> : panel_group<32, false>)
                                  : (narrow ? panel_group<16, true> : panel_group<16, false>);
        for (int64_t g = 0; g < M; g += group) {
          if (p)
            for (int64_t o = bytes * (g / group) / groups / 64 * 64; o < bytes * (g / group + 1) / groups; o += 64)
              _mm_prefetch(reinterpret_cast<const char*>(p) + o, _MM_HINT_T1);
          for (size_t j = 0; j < open.size(); ++j)
            rows_of(std::min<int64_t>(group, M - g), panels.data() + j * nb, xq + g * nb, nb,
                    y + g * N + open[j].first, N, open[j].second);
        }
      }
      open.clear();
    };
    for (int64_t t = lo; t < hi; ++t) {
      const Tile& tile = tiles[t];
      const int64_t type = seg.type(tile.s);
      if (q8::block32(type)) {
        const uint8_t* rows = seg.row(base, tile.s, tile.n0, K);
        const int64_t row_bytes = K / 32 * layout(type).bytes;
        // adjacent tiles run together: 4 on AMX (one tile per activation load measured slower than the registers),
        // 2 in registers (a short tile ends a group: the next segment's rows may start 16 after it, past other types')
        if (n32 && (n32 == cap32 || last32 != 16 || tile.n0 != first32 + 16 * n32)) run32();
        if (!n32) first32 = tile.n0;
        if (tile.panel) tile32[n32++].open_q40_panel(rows, K);  // (Q4_0: the only such panels)
        else tile32[n32++].open(type, rows, row_bytes, tile.rows, K);
        last32 = tile.rows;
        continue;
      }
      const bool tile32s = per32(type), tile_mins = panel_bias(type) == 0, tile_narrow = narrow_sums(type);
      const bool other_kind = tile32s != by32 || tile_mins != mins || tile_narrow != narrow;
      if (!open.empty() && (other_kind || open.size() == kOpen)) run(t);
      by32 = tile32s;
      mins = tile_mins;
      narrow = tile_narrow;
      Panel* p = panels.data() + open.size() * nb;
      if (tile.panel)
        for (int64_t b = 0; b < nb; ++b) open_row_panel(type, seg.row(base, tile.s, tile.n0, K), nb, b, p[b]);
      else
        open_panels(seg, base, tile.n0, tile.rows, K, scratch.data(), p);
#if defined(DELTASERVE_AMX)
      if (tiled)
        for (int64_t b = 0; b < nb; ++b) widen_panel(p[b], panel_bias(type), wide[open.size() * nb + b]);
#endif
      open.emplace_back(tile.n0, tile.rows);
    }
    run(hi);
    run32();
  });
}
#else
constexpr bool kPanelGemm = false;
constexpr int64_t kPanelRows = kRows;
inline void gemm_panels(const Segments&, const uint8_t*, const XBlock*, const q8::Q8Acts&, int64_t, int64_t, float*,
                        int64_t) {}
#endif

// y[m][n0 .. n1) (N apart) for rows n0 .. n1 of segment s, of 32-weight blocks, and every activation row m of x8:
// decode reads the rows' blocks straight from memory; prefill (AVX2, no AVX-512 VNNI) opens them into tiles
inline void block32_rows(const Segments& seg, const uint8_t* base, int64_t s, int64_t n0, int64_t n1, int64_t K,
                         const q8::Q8Acts& x8, float* y, int64_t N) {
  const int64_t type = seg.type(s);
  if (x8.M <= kRows) {
    TORCH_CHECK(!seg.panels(s), "block32_rows: decode of rows in panels takes gemv_direct");
    q8::rows32_run(type, x8.M, seg.row(base, s, n0, K), n1 - n0, K / 32 * layout(type).bytes, x8, y + n0, N);
    return;
  }
#if defined(DELTASERVE_BLOCK32_AVX2)
  static thread_local q8::Rows32 opened;
  opened.reset(type, n1 - n0, K);
  for (int64_t n = n0; n < n1; ++n) opened.open(n - n0, native_row(seg, base, s, n, K, row_scratch(K)));
  opened.run(x8, y + n0, N);
#else
  TORCH_CHECK(false, "block32_rows: prefill of 32-weight blocks here takes gemm_panels");
#endif
}

#if defined(__AVX2__) && !defined(__AVX512BW__)
// decode on AVX2 (M <= kRows): each thread a run of output columns, taken a segment's part at a time, K-quant and
// IQ4_XS rows by int8gemv_avx2.h's kernels (codes opened in registers as they stream in), Q4_0 / Q4_1 / Q5_0 / Q5_1
// and IQ4_NL rows two blocks a vector (int8legacy_avx2.h rows_pairs), Q8_0 a block a vector (rows32_run). (No AVX2
// build holds rows in panels: those are the AVX-512 kernels' layout.)
inline void decode_avx2(const Segments& seg, const uint8_t* base, const XBlock* xq, const q8::Q8Acts& x8, int64_t M,
                        int64_t K, float* y) {
  const int64_t N = seg.rows, nb = K / 256;
  static thread_local std::vector<q8::XPair> pairs;  // (the workers read this thread's: xp)
  for (int64_t s = 0; s < seg.S; ++s)
    if (q8::pairs_decode(seg.type(s))) {
      q8::pair_up(x8, pairs);
      break;
    }
  const q8::XPair* xp = pairs.data();
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    const ShareClock clock(hi - lo);
    for (int64_t n0 = lo, n1; n0 < hi; n0 = n1) {
      const int64_t s = seg.find(n0), type = seg.type(s);
      n1 = std::min(hi, seg.end(s));
      if (q8::pairs_decode(type)) {
        for (int64_t g = 0; g < M; g += kRows)
          q8::pair_rows_kernel(type, std::min<int64_t>(kRows, M - g))(seg.row(base, s, n0, K), n1 - n0,
                                                                      K / 32 * layout(type).bytes, x8, xp, g, y + g * N + n0, N);
        continue;
      }
      if (q8::block32(type)) {
        q8::rows32_run(type, M, seg.row(base, s, n0, K), n1 - n0, K / 32 * layout(type).bytes, x8, y + n0, N);
        continue;
      }
      TORCH_CHECK(rows_avx2(type) && !seg.panels(s), "linear_int8: segment ", s, " (GGML type ", type, ") has no AVX2 decode kernel");
      for (int64_t g = 0; g < M; g += kRows)
        rows_avx2_kernel(type, std::min<int64_t>(kRows, M - g))(seg.row(base, s, n0, K), n1 - n0, nb * layout(type).bytes, nb,
                                                                xq + g * nb, y + g * N + n0, N);
    }
  });
}
#endif

// which instructions the integer kernels of this build use (the benchmark prints it)
inline std::string int8_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return std::string(amx::enabled() ? "AMX tiles (tdpbsud) for K-quant and Q8_0 prefill, " : "") +
         "AVX-512 VNNI: vpdpbusd on 16-row panels, decode straight from the row panels held at load";
#elif defined(__AVX512BW__)
  return "AVX-512 BW: decode from 16-row panels, vpmaddubsw + vpmaddwd; 32-weight blocks: vpsignb + vpmaddubsw";
#elif defined(__AVXVNNI__)
  return "AVX2 + AVX-VNNI: vpmaddubsw + vpdpwssd; 32-weight blocks: vpsignb + vpdpbusd";
#elif defined(__AVX2__)
  return "AVX2: vpmaddubsw + vpmaddwd; 32-weight blocks: vpsignb + vpmaddubsw";
#else
  return "portable C++";
#endif
}

// y [M, N] = x [M, K] (float32, rounded here to Q8_K for K-quant / IQ4_XS rows, to Q8_0 for rows of 32-weight blocks)
// @ W^T, W packed blocks (segment table as for linear_packed). Prefill on AVX-512 VNNI: the panels above; decode on
// AVX-512 BW: panel_gemv.h. Otherwise threads split the output columns into tiles of weight rows (one for decode,
// opened into L1 and used at once; 32 above, opened into a per-thread buffer that stays in L2) multiplied by every
// group of rows of x; there rows of 32-weight blocks take int8legacy_avx2.h's kernels, and (AVX2) K-quant prefill
// int8ktile_avx2.h's tiles of 8 rows.
inline void linear_int8(at::Tensor x, at::Tensor bytes, at::Tensor table, at::Tensor y) {
  check_rows(x, "linear_int8");
  TORCH_CHECK(bytes.dtype() == at::kByte && bytes.is_contiguous(), "packed bytes must be contiguous uint8");
  const int64_t M = x.size(0), K = x.size(1), nb = K / 256, ldx = row_stride(x);
  const Segments seg(table, K, bytes.numel());
  const int64_t N = seg.rows;
  TORCH_CHECK(y.dtype() == at::kFloat && y.is_contiguous() && y.size(0) == M && y.size(1) == N, "y must be float32 [M, N]");
  bool round32 = false, round256 = false;  // which roundings of x the segments read
  for (int64_t s = 0; s < seg.S; ++s) {
    TORCH_CHECK(int8_type(seg.type(s)), "linear_int8: GGML type ", seg.type(s), " has no integer kernel");
    (q8::block32(seg.type(s)) ? round32 : round256) = true;
  }
  // decode (a step makes ~70 of these calls) reuses its thread's buffers; a prefill's are its own, freed after, and
  // taken from torch's allocator (blocks.h once a model has loaded): from glibc's heap, these 1-4 MB buffers taken and
  // freed at every call grew it by 30 MB over prefills of 2,048 tokens, other allocations splitting their holes
  static thread_local std::vector<XBlock> decode_buf;
  at::Tensor prefill_buf;
  XBlock* xbuf;
  if (M <= kRows) {
    if (decode_buf.size() < static_cast<size_t>(M * nb)) decode_buf.resize(M * nb);
    xbuf = decode_buf.data();
  } else {  // 64-byte aligned, as XBlock asks
    prefill_buf = at::empty({M * nb * static_cast<int64_t>(sizeof(XBlock))}, at::kByte);
    xbuf = reinterpret_cast<XBlock*>(prefill_buf.data_ptr<uint8_t>());
  }
  const XBlock* xq = xbuf;
  const bool direct = kDirectGemv && M <= kDirectRows;
  // (the AMX tiles, the direct GEMV and the other ISAs' kernels read x in groups of kRows)
  const int64_t group = kPanelGemm && !direct && M > kRows && !amx::enabled() ? kPanelRows : kRows;
  // (x's rows may lie apart: the MLP's down projection reads swiglu's product written over the gate half of gate_up)
  if (round256) quantize_rows(x.data_ptr<float>(), M, K, ldx, xbuf, group);
  static thread_local q8::Q8Acts decode_x8;  // x rounded per 32, for rows of 32-weight blocks
  q8::Q8Acts prefill_x8;
  q8::Q8Acts& x8 = M <= kRows ? decode_x8 : prefill_x8;
  if (round32) x8.quantize(x.data_ptr<float>(), M, K, ldx, M > kRows);
  const uint8_t* base = bytes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (direct) return gemv_direct(seg, base, xq, x8, M, K, yp);
  if (kPanelGemm && M > kRows) return gemm_panels(seg, base, xq, x8, M, K, yp, group);
#if defined(__AVX2__) && !defined(__AVX512BW__)
  if (M <= kRows) return decode_avx2(seg, base, xq, x8, M, K, yp);
#endif
  // decode (the portable build): one row, opened into L1 and used at once; prefill: 32, so that each few rows of x are
  // read from L1 by 32 weight rows (at 16 the AVX2 build's 512 x 3584 K-quant GEMMs ran 10% slower, x from L3)
  const int64_t tile = M <= kRows ? 1 : 32;
  at::parallel_for(0, (N + tile - 1) / tile, 1, [&](int64_t lo, int64_t hi) {
    std::vector<WBlock> w(tile * nb);
#if defined(DELTASERVE_BLOCK32_AVX2)
    std::vector<KTile8> ktiles((tile + 7) / 8);
#endif
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t n0 = t * tile, end = std::min(n0 + tile, N), n1; n0 < end; n0 = n1) {  // a segment's rows at a time
        const int64_t s = seg.find(n0), type = seg.type(s);
        n1 = std::min(end, seg.end(s));
        if (q8::block32(type)) {
          block32_rows(seg, base, s, n0, n1, K, x8, yp, N);
          continue;
        }
        for (int64_t n = n0; n < n1; ++n) open_row(type, native_row(seg, base, s, n, K, row_scratch(K)), nb, w.data() + (n - n0) * nb);
#if defined(DELTASERVE_BLOCK32_AVX2)
        if (M > kRows) {  // prefill: tiles of 8 rows (int8ktile_avx2.h)
          const int64_t count = (n1 - n0 + 7) / 8;
          for (int64_t i = 0; i < count; ++i)
            ktiles[i].open(w.data() + 8 * i * nb, std::min<int64_t>(8, n1 - n0 - 8 * i), nb);
          if (signed_codes(type)) KTile8::run<1, true>(ktiles.data(), count, xq, M, yp + n0, N);
          else if (type == Q6_K) KTile8::run<2>(ktiles.data(), count, xq, M, yp + n0, N);
          else if (type == Q4_K) KTile8::run<8, false, true>(ktiles.data(), count, xq, M, yp + n0, N);
          else if (type == Q5_K) KTile8::run<4, false, true>(ktiles.data(), count, xq, M, yp + n0, N);
          else KTile8::run<4>(ktiles.data(), count, xq, M, yp + n0, N);
          continue;
        }
#endif
        for (int64_t g = 0; g < M; g += kRows) {
          const int64_t mb = std::min<int64_t>(kRows, M - g);
          for (int64_t n = n0; n < n1; ++n) {
            float sums[kRows];
            dot_group(type, mb, w.data() + (n - n0) * nb, xq + g * nb, nb, sums);
            for (int64_t m = 0; m < mb; ++m) yp[(g + m) * N + n] = sums[m];
          }
        }
      }
  });
}

}  // namespace kq
}  // namespace deltaserve
