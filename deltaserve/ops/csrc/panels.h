// Row panels: K-quant and IQ4_XS rows (Q4_K, Q5_K, Q6_K, IQ4_XS) held 16 to a panel, the file's bytes only moved, so that one vector
// instruction multiplies 4 codes of each of 16 rows by the same 4 activations broadcast (vpdpbusd, one int32 lane
// per row) and each row's scales and float factors apply per lane: no per-row reduction, scale shuffle or
// horizontal sum, about a third of the row-at-a-time kernel's instructions. A panel takes the bytes of its 16 rows.
//
// Within a panel, per block b of the rows (nb a row), every native 4-byte (2, 1) piece of a block lands in a run
// of 16, one per row: piece (native offset o, length len) of row r at region(b) + base + r * len, where region(b)
// is b times the panel block's bytes (Q4_K 2304, Q5_K 2816; Q6_K 3328 without d, whose 16 copies per block lie
// after all nb blocks' other bytes: every block's codes stay 64-byte aligned).
//
//   Q4_K block: qs runs (j, l4) [32 x 64 B] | scale words u = 0..2 [3 x 64 B] | d [32 B] | dmin [32 B]
//   Q5_K block: qs runs [2048] | qh runs l4 [8 x 64 B] | scale words [192] | d | dmin
//   Q6_K block: 4 sections (n, half of l4): 4 x (ql run, ql + 32 run, qh run) [768 B] | 4 scales [64 B];  d after
//   IQ4_XS block: qs runs (ib, l4) [32 x 64 B] | d [32 B] | scales_h [32 B] | scales_l [64 B]
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
  int64_t block;  // panel bytes per block before the trailing d's (Q6_K: 3328), or all of them
  int16_t tail;   // Q6_K: the native offset of d, kept after all blocks (-1: none)
};

inline PanelLayout make_layout(int64_t type) {
  PanelLayout l{{}, 0, -1};
  auto add = [&](int native, int len, int base) { l.pieces.push_back({static_cast<int16_t>(native), static_cast<int16_t>(len), static_cast<int16_t>(base)}); };
  const int qs = type == Q5_K ? 48 : 16;
  switch (type) {
    case Q4_K:
    case Q5_K: {
      for (int j = 0; j < 4; ++j)
        for (int l4 = 0; l4 < 8; ++l4) add(qs + 32 * j + 4 * l4, 4, (j * 8 + l4) * 64);
      int at = 2048;
      if (type == Q5_K)
        for (int l4 = 0; l4 < 8; ++l4, at += 64) add(16 + 4 * l4, 4, at);
      for (int u = 0; u < 3; ++u, at += 64) add(4 + 4 * u, 4, at);
      add(0, 2, at);
      add(2, 2, at + 32);
      l.block = at + 64;
      return l;
    }
    case Q6_K: {  // in the order the kernel reads them: per section (n, half) 4 triples (ql, ql + 32, qh), 4 scales
      for (int n = 0; n < 2; ++n)
        for (int l4 = 0; l4 < 8; ++l4) {
          const int at = (2 * n + l4 / 4) * 832 + (l4 % 4) * 192;
          add(64 * n + 4 * l4, 4, at);
          add(64 * n + 32 + 4 * l4, 4, at + 64);
          add(128 + 32 * n + 4 * l4, 4, at + 128);
        }
      for (int g = 0; g < 16; ++g) add(192 + g, 1, (2 * (g / 8) + g % 2) * 832 + 768 + 16 * ((g % 8) / 2));
      l.block = 3328;
      l.tail = 208;
      return l;
    }
    case IQ4_XS: {
      for (int ib = 0; ib < 8; ++ib)
        for (int l4 = 0; l4 < 4; ++l4) add(8 + 16 * ib + 4 * l4, 4, (ib * 4 + l4) * 64);
      add(0, 2, 2048);
      add(2, 2, 2080);
      add(4, 4, 2112);
      l.block = 2176;
      return l;
    }
  }
  layout(type);
  throw std::invalid_argument("row panels: GGML type " + std::to_string(type) + " has no panel layout");
}

inline bool panel_type(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS; }

inline const PanelLayout& panel_layout(int64_t type) {
  static const PanelLayout q4 = make_layout(Q4_K), q5 = make_layout(Q5_K), q6 = make_layout(Q6_K), iq4 = make_layout(IQ4_XS);
  return type == Q4_K ? q4 : type == Q5_K ? q5 : type == Q6_K ? q6 : iq4;
}

// native_offset in a block <-> offset in a panel of nb blocks, for row r of block b
template <class F>
inline void each_piece(const PanelLayout& l, int64_t nb, int64_t b, int64_t r, F&& f) {
  for (const Piece& p : l.pieces) f(p.native, p.len, b * l.block + p.base + r * p.len);
  if (l.tail >= 0) f(l.tail, 2, nb * l.block + 32 * b + 2 * r);
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
inline void to_panels(torch::Tensor bytes, torch::Tensor table, int64_t K) {
  TORCH_CHECK(bytes.dtype() == torch::kUInt8 && bytes.is_contiguous(), "packed bytes must be contiguous uint8");
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
