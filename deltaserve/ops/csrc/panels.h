// Row panels: K-quant, IQ4_XS and Q4_0 rows (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, Q4_0) held 16 to a panel, the
// file's bytes only moved, so that one vector instruction multiplies 4 codes of each of 16 rows by the same 4
// activations broadcast (vpdpbusd, one int32 lane per row) and each row's scales and float factors apply per lane:
// no per-row reduction, scale shuffle or horizontal sum, about a third of the row-at-a-time kernel's instructions.
// A panel takes the bytes of its 16 rows.
//
// Within a panel, per block b of the rows (nb a row), every native 4-byte (2, 1) piece of a block lands in a run
// of 16, one per row: piece (native offset o, length len) of row r at region(b) + base + r * len, region(b) being
// b times the panel block's bytes (Q2_K 1344, Q4_K 2304, Q5_K 2816, IQ4_XS 2176; Q3_K 1728, Q6_K 3328 and Q4_0 256
// after a head holding the d of every block, nb x 32 bytes, so that their blocks stay whole cache lines). Each block is laid out
// in the order its kernel reads it, front to back (the hardware prefetchers here lost half their rate to a stream
// that skips ahead and comes back):
//
//   Q4_K block: scale words u = 0..2 [3 x 64 B] | d [32 B] | dmin [32 B] | qs runs (j, l4) [32 x 64 B]
//   Q5_K block: scale words | d | dmin | qh runs l4 [8 x 64 B] | qs runs (j, l4)
//   Q6_K block: 4 sections (n, half of l4): 4 x (ql run, ql + 32 run, qh run) [768 B] | 4 scales [64 B]
//   IQ4_XS block: d [32 B] | scales_h [32 B] | scales_l [64 B] | qs runs (ib, l4) [32 x 64 B]
//   Q2_K block: scale words u = 0..3 [4 x 64 B] | d [32 B] | dmin [32 B] | qs runs (n, l4) [16 x 64 B]
//   Q3_K block: scale words u = 0..2 [3 x 64 B] | hmask runs l4 [8 x 64 B] | qs runs (n, l4) [16 x 64 B]
//   Q4_0 block (32 weights, after the head of d): qs runs r = 0..3 [4 x 64 B]
//
// A segment of a panel type with the table's panel flag holds rows / 16 panels, then its rows % 16 last rows
// native. Every reader of packed bytes takes either (native_row gives a row's file bytes back).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kquants.h"

namespace deltaserve {
namespace kq {

constexpr int64_t kPanel = 16;

struct Piece {
  int16_t native, len, base;  // native offset in the block, bytes, offset of the run of 16 in the panel block
};

struct PanelLayout {
  std::vector<Piece> pieces;
  int64_t block;  // panel bytes per block (Q3_K, Q6_K: after the head)
  int16_t head;   // Q3_K, Q6_K: the native offset of d, its runs first in the panel, 32 bytes a block (-1: none)
};

// where a Q4_K / Q5_K / IQ4_XS panel block's parts start (its kernels read them there)
constexpr int64_t kK4Scales = 0, kK4D = 192, kK4Dmin = 224, kQ5High = 256;
inline constexpr int64_t k4_codes(bool q5) { return q5 ? 768 : 256; }
constexpr int64_t kIQ4D = 0, kIQ4High = 32, kIQ4Low = 64, kIQ4Codes = 128;
constexpr int64_t kQ2D = 256, kQ2Dmin = 288, kQ2Codes = 320, kQ2Block = 1344;
constexpr int64_t kQ3High = 192, kQ3Codes = 704, kQ3Block = 1728;  // both: scale words first
constexpr int64_t kQ40Block = 256;  // Q4_0: after a head of the blocks' d, as Q3_K's and Q6_K's

inline PanelLayout make_layout(int64_t type) {
  PanelLayout l{{}, 0, -1};
  auto add = [&](int native, int len, int base) { l.pieces.push_back({static_cast<int16_t>(native), static_cast<int16_t>(len), static_cast<int16_t>(base)}); };
  switch (type) {
    case Q4_K:
    case Q5_K: {
      const bool q5 = type == Q5_K;
      for (int u = 0; u < 3; ++u) add(4 + 4 * u, 4, kK4Scales + 64 * u);
      add(0, 2, kK4D);
      add(2, 2, kK4Dmin);
      if (q5)
        for (int l4 = 0; l4 < 8; ++l4) add(16 + 4 * l4, 4, kQ5High + 64 * l4);
      for (int j = 0; j < 4; ++j)
        for (int l4 = 0; l4 < 8; ++l4) add((q5 ? 48 : 16) + 32 * j + 4 * l4, 4, k4_codes(q5) + (j * 8 + l4) * 64);
      l.block = k4_codes(q5) + 2048;
      return l;
    }
    case Q6_K: {
      for (int n = 0; n < 2; ++n)
        for (int l4 = 0; l4 < 8; ++l4) {
          const int at = (2 * n + l4 / 4) * 832 + (l4 % 4) * 192;
          add(64 * n + 4 * l4, 4, at);
          add(64 * n + 32 + 4 * l4, 4, at + 64);
          add(128 + 32 * n + 4 * l4, 4, at + 128);
        }
      for (int g = 0; g < 16; ++g) add(192 + g, 1, (2 * (g / 8) + g % 2) * 832 + 768 + 16 * ((g % 8) / 2));
      l.block = 3328;
      l.head = 208;
      return l;
    }
    case IQ4_XS: {
      add(0, 2, kIQ4D);
      add(2, 2, kIQ4High);
      add(4, 4, kIQ4Low);
      for (int ib = 0; ib < 8; ++ib)
        for (int l4 = 0; l4 < 4; ++l4) add(8 + 16 * ib + 4 * l4, 4, kIQ4Codes + (ib * 4 + l4) * 64);
      l.block = kIQ4Codes + 2048;
      return l;
    }
    case Q2_K: {
      for (int u = 0; u < 4; ++u) add(4 * u, 4, 64 * u);
      add(80, 2, kQ2D);
      add(82, 2, kQ2Dmin);
      for (int n = 0; n < 2; ++n)
        for (int l4 = 0; l4 < 8; ++l4) add(16 + 32 * n + 4 * l4, 4, kQ2Codes + (8 * n + l4) * 64);
      l.block = kQ2Block;
      return l;
    }
    case Q4_0:  // 32 weights a block: its qs in 4 runs, bytes 4r .. 4r + 3 (elements 4r .., 16 + 4r ..) of each row
      for (int r = 0; r < 4; ++r) add(2 + 4 * r, 4, 64 * r);
      l.block = kQ40Block;
      l.head = 0;
      return l;
    case Q3_K: {
      for (int u = 0; u < 3; ++u) add(96 + 4 * u, 4, 64 * u);
      for (int l4 = 0; l4 < 8; ++l4) add(4 * l4, 4, kQ3High + 64 * l4);
      for (int n = 0; n < 2; ++n)
        for (int l4 = 0; l4 < 8; ++l4) add(32 + 32 * n + 4 * l4, 4, kQ3Codes + (8 * n + l4) * 64);
      l.block = kQ3Block;
      l.head = 108;
      return l;
    }
  }
  layout(type);
  throw std::invalid_argument("row panels: GGML type " + std::to_string(type) + " has no panel layout");
}

// bytes before a panel's first block (Q3_K, Q6_K, Q4_0: the d of every block)
inline int64_t panel_head(int64_t type, int64_t nb) { return type == Q3_K || type == Q6_K || type == Q4_0 ? 32 * nb : 0; }

inline const PanelLayout& panel_layout(int64_t type) {
  static const PanelLayout q2 = make_layout(Q2_K), q3 = make_layout(Q3_K), q4 = make_layout(Q4_K), q5 = make_layout(Q5_K),
                           q6 = make_layout(Q6_K), iq4 = make_layout(IQ4_XS), q40 = make_layout(Q4_0);
  return type == Q2_K ? q2 : type == Q3_K ? q3 : type == Q4_K ? q4 : type == Q5_K ? q5 : type == Q6_K ? q6 : type == Q4_0 ? q40 : iq4;
}

// native_offset in a block <-> offset in a panel of nb blocks, for row r of block b
template <class F>
inline void each_piece(const PanelLayout& l, int64_t nb, int64_t b, int64_t r, F&& f) {
  const int64_t region = (l.head >= 0 ? 32 * nb : 0) + b * l.block;
  for (const Piece& p : l.pieces) f(p.native, p.len, region + p.base + r * p.len);
  if (l.head >= 0) f(l.head, 2, 32 * b + 2 * r);
}

// the file's bytes of row r (< 16) of the panel at `panel` (nb blocks a row) into out [nb * block bytes]
inline void panel_row(int64_t type, const uint8_t* panel, int64_t r, int64_t nb, uint8_t* out) {
  const PanelLayout& l = panel_layout(type);
  const int64_t bytes = layout(type).bytes;
  for (int64_t b = 0; b < nb; ++b)
    each_piece(l, nb, b, r, [&](int native, int len, int64_t at) { std::memcpy(out + b * bytes + native, panel + at, len); });
}

// 16 native rows at `rows` (one after the other) rearranged into a panel in place
inline void to_panel(int64_t type, uint8_t* rows, int64_t nb, std::vector<uint8_t>& scratch) {
  const PanelLayout& l = panel_layout(type);
  const int64_t bytes = layout(type).bytes, row = nb * bytes;
  scratch.assign(rows, rows + kPanel * row);
  for (int64_t r = 0; r < kPanel; ++r)
    for (int64_t b = 0; b < nb; ++b)
      each_piece(l, nb, b, r, [&](int native, int len, int64_t at) {
        std::memcpy(rows + at, scratch.data() + r * row + b * bytes + native, len);
      });
}

// this thread's buffer for one row of K weights in any type's blocks (grown, never shrunk: a row is a few KB)
inline uint8_t* row_scratch(int64_t K) {
  static thread_local std::vector<uint8_t> buf;
  const size_t need = static_cast<size_t>(K / 32 * 34 + K / 256 * 210);
  if (buf.size() < need) buf.resize(need);
  return buf.data();
}

// A row of a packed matrix as the file's bytes: a pointer into the matrix, or (a panel's row) into scratch.
inline const uint8_t* native_row(const Segments& seg, const uint8_t* base, int64_t s, int64_t n, int64_t K,
                                 uint8_t* scratch) {
  const int64_t first = seg.first(s), local = n - first;
  if (local >= seg.panel_rows(s)) return seg.row(base, s, n, K);
  const int64_t type = seg.type(s), nb = K / layout(type).block;
  panel_row(type, seg.row(base, s, first + local / kPanel * kPanel, K), local % kPanel, nb, scratch);
  return scratch;
}

// The bytes of a packed matrix (segment table with its panel flags) rearranged into its panels, in place.
inline void to_panels(at::Tensor bytes, at::Tensor table, int64_t K) {
  TORCH_CHECK(bytes.dtype() == at::kByte && bytes.is_contiguous(), "packed bytes must be contiguous uint8");
  const Segments seg(table, K, bytes.numel());
  uint8_t* base = bytes.data_ptr<uint8_t>();
  for (int64_t s = 0; s < seg.S; ++s) {
    const int64_t nb = K / layout(seg.type(s)).block, panels = seg.panel_rows(s) / kPanel;
    at::parallel_for(0, panels, 16, [&](int64_t lo, int64_t hi) {
      std::vector<uint8_t> scratch;
      for (int64_t p = lo; p < hi; ++p)
        to_panel(seg.type(s), const_cast<uint8_t*>(seg.row(base, s, seg.first(s) + p * kPanel, K)), nb, scratch);
    });
  }
}

}  // namespace kq
}  // namespace deltaserve
