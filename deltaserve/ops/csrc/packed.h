// The kernels on packed GGML blocks (see kquants.h). linear_packed, the decode GEMV: y [M, N] = x [M, K] (float32)
// @ W^T, W read from its blocks once per group of up to 8 activation rows and widened in registers, never in
// memory. The activations stay float32 (llama.cpp rounds them to 8 bits for its integer dot products): the result
// is a float32 matmul with the dequantised weights, up to summation order. packed_rows: rows dequantised to
// float32, exactly (prefill GEMMs a block of rows at a time, embedding lookups).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <vector>

#include "gemv.h"
#include "kquants.h"
#include "kquants_avx512.h"
#include "panels.h"

namespace deltaserve {
namespace kq {

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// sums[m] = x[m] . row for MB activation rows, x interleaved by interleave(): every x value a weight vector
// meets is at a constant offset from one pointer (with a pointer per row, 8 rows ran out of registers). With few
// rows, A accumulators per row keep enough independent FMA chains in flight (one chain waits 4 cycles per FMA).
template <class V, int MB>
inline void dot_rows(const uint8_t* row, int64_t K, const float* x, float* sums) {
  constexpr int A = MB >= 4 ? 1 : 4 / MB;
  __m512 acc[MB][A];
  for (int m = 0; m < MB; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < K / V::kBlock; ++blk) {
    const uint8_t* bp = row + blk * V::kBytes;
    if (V::kBytes >= 64 || (blk * V::kBytes) % 64 < V::kBytes)  // about one prefetch per 64-byte line
      for (int o = 0; o < V::kBytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(bp) + kGemvPrefetch + o, _MM_HINT_T0);
    const float* xb = x + blk * V::kBlock * MB;
    block_values<V>(bp, [&](int e, __m512 w) {
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m)
        acc[m][(e / 16) % A] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xb + (e / 16 * MB + m) * 16), acc[m][(e / 16) % A]);
    });
  }
  for (int m = 0; m < MB; ++m) {
    for (int a = 1; a < A; ++a) acc[m][0] = _mm512_add_ps(acc[m][0], acc[m][a]);
    sums[m] = _mm512_reduce_add_ps(acc[m][0]);
  }
}

// x . row for one activation row: each sub-block's codes are dotted with x first and scaled once (and the offsets
// once a block, against xsum: x summed per 32), so no table of values is built. Not for kWideOffsets (offsets per
// 16 weights), which dot_rows<V, 1> reads.
template <class V>
inline float dot_row1(const uint8_t* row, int64_t K, const float* x, const float* xsum) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  __m256 off = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < K / V::kBlock; ++blk) {
    const uint8_t* bp = row + blk * V::kBytes;
    for (int o = 0; o < V::kBytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(bp) + kGemvPrefetch + o, _MM_HINT_T0);
    const float* xb = x + blk * V::kBlock;
    __m512 part[V::kGroups];
    V::codes(bp, [&](int e, __m512 c, int g) {
      const __m512 xv = _mm512_loadu_ps(xb + e);
      part[g] = e % V::kGroup == 0 ? _mm512_mul_ps(c, xv) : _mm512_fmadd_ps(c, xv, part[g]);
    });
    const __m512 st = V::steps(bp);
    const Lanes s(st);
#pragma GCC unroll 16
    for (int g = 0; g < V::kGroups; ++g) acc[g % 4] = _mm512_fmadd_ps(part[g], s[g], acc[g % 4]);
    if constexpr (V::kOffsets) {  // a block of 32 has its one offset in lane 8
      const __m256 xs = V::kBlock == 256 ? _mm256_loadu_ps(xsum + blk * 8) : _mm256_setr_ps(xsum[blk], 0, 0, 0, 0, 0, 0, 0);
      off = _mm256_fmadd_ps(_mm512_extractf32x8_ps(st, 1), xs, off);
    }
  }
  const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
  const __m128 o = _mm_add_ps(_mm256_castps256_ps128(off), _mm256_extractf128_ps(off, 1));
  return _mm512_reduce_add_ps(total) - _mm_cvtss_f32(_mm_hadd_ps(_mm_hadd_ps(o, o), _mm_hadd_ps(o, o)));
}

// y[0 .. K) = a row of blocks, exactly (the visitors' values are decode_block's)
template <class V>
inline void decode_row_v(const uint8_t* row, int64_t K, float* y) {
  for (int64_t blk = 0; blk < K / V::kBlock; ++blk)
    block_values<V>(row + blk * V::kBytes, [&](int e, __m512 w) { _mm512_storeu_ps(y + blk * V::kBlock + e, w); });
}

#pragma GCC pop_options

// f(V{}) with V the visitor of GGML type `type`
template <class F>
inline void with_visitor(int64_t type, F&& f) {
  switch (type) {
    case Q4_0: return f(VQ4_0{});
    case Q4_1: return f(VQ4_1{});
    case Q5_0: return f(VQ5_0{});
    case Q5_1: return f(VQ5_1{});
    case Q8_0: return f(VQ8_0{});
    case IQ4_NL: return f(VIQ4_NL{});
    case MXFP4: return f(VMXFP4{});
    case Q2_K: return f(VQ2_K{});
    case Q3_K: return f(VQ3_K{});
    case Q4_K: return f(VQ4_K{});
    case Q5_K: return f(VQ5_K{});
    case Q6_K: return f(VQ6_K{});
    case IQ4_XS: return f(VIQ4_XS{});
  }
  layout(type);  // throws, naming the type
}

// sums[m] = x[m] . row for mb <= 8 activation rows (interleaved), the row's blocks of `type` read once; xsum:
// x summed per 32 when mb is 1.
inline void dot_packed(int64_t type, int64_t mb, const uint8_t* row, int64_t K, const float* x, const float* xsum,
                       float* sums) {
  with_visitor(type, [&](auto v) {
    using V = decltype(v);
    switch (mb) {
      case 1:
        if constexpr (V::kWideOffsets) dot_rows<V, 1>(row, K, x, sums);
        else sums[0] = dot_row1<V>(row, K, x, xsum);
        return;
      case 2: return dot_rows<V, 2>(row, K, x, sums);
      case 3: return dot_rows<V, 3>(row, K, x, sums);
      case 4: return dot_rows<V, 4>(row, K, x, sums);
      case 5: return dot_rows<V, 5>(row, K, x, sums);
      case 6: return dot_rows<V, 6>(row, K, x, sums);
      case 7: return dot_rows<V, 7>(row, K, x, sums);
      default: return dot_rows<V, 8>(row, K, x, sums);
    }
  });
}

inline void decode_row(int64_t type, const uint8_t* row, int64_t K, float* y) {
  with_visitor(type, [&](auto v) { decode_row_v<decltype(v)>(row, K, y); });
}
#else
// Without AVX-512: each block decoded exactly into a small buffer, then dotted with the rows (the compiler
// vectorises both loops for what this machine has, AVX2 or less).
inline void dot_packed(int64_t type, int64_t mb, const uint8_t* row, int64_t K, const float* x, const float* xsum,
                       float* sums) {
  const Layout l = layout(type);
  alignas(64) float w[256];
  for (int64_t m = 0; m < mb; ++m) sums[m] = 0.f;
  for (int64_t blk = 0; blk < K / l.block; ++blk) {
    _mm_prefetch(reinterpret_cast<const char*>(row + blk * l.bytes) + kGemvPrefetch, _MM_HINT_T0);
    decode_block(type, row + blk * l.bytes, w);
    const float* xb = x + blk * l.block * mb;
    for (int64_t m = 0; m < mb; ++m) {
      float s = 0.f;
      for (int64_t e = 0; e < l.block; ++e) s += w[e] * xb[(e / 16 * mb + m) * 16 + e % 16];
      sums[m] += s;
    }
  }
}

inline void decode_row(int64_t type, const uint8_t* row, int64_t K, float* y) {
  const Layout l = layout(type);
  for (int64_t blk = 0; blk < K / l.block; ++blk) decode_block(type, row + blk * l.bytes, y + blk * l.block);
}
#endif

// x [M, K] rearranged for dot_packed: per group of 8 rows (fewer in the last), [K / 16][rows][16] (K is a multiple
// of 16: whole blocks).
inline std::vector<float> interleave(const float* x, int64_t M, int64_t K) {
  std::vector<float> out(M * K);
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t mb = std::min<int64_t>(8, M - m0);
    for (int64_t m = 0; m < mb; ++m)
      for (int64_t k = 0; k < K; ++k) out[m0 * K + (k / 16 * mb + m) * 16 + k % 16] = x[(m0 + m) * K + k];
  }
  return out;
}

// y [M, N] = x [M, K] @ W^T for a packed W (bytes + segment table, see kquants.h); x, y float32 contiguous.
void linear_packed(at::Tensor x, at::Tensor bytes, at::Tensor table, at::Tensor y) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x must be float32 [M, K] contiguous");
  TORCH_CHECK(bytes.dtype() == at::kByte && bytes.is_contiguous(), "packed bytes must be contiguous uint8");
  const int64_t M = x.size(0), K = x.size(1);
  const Segments seg(table, K, bytes.numel());
  const int64_t N = seg.rows;
  TORCH_CHECK(y.dtype() == at::kFloat && y.is_contiguous() && y.size(0) == M && y.size(1) == N, "y must be float32 [M, N]");
  const uint8_t* base = bytes.data_ptr<uint8_t>();
  const std::vector<float> xi = interleave(x.data_ptr<float>(), M, K);
  const float* xp = xi.data();
  // a last group of one row takes dot_row1, which needs that row summed per 32
  std::vector<float> xsum(M % 8 == 1 ? K / 32 : 0);
  for (size_t i = 0; i < xsum.size(); ++i)
    for (int k = 0; k < 32; ++k) xsum[i] += xp[(M - 1) * K + 32 * i + k];
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    int64_t s = seg.find(lo);
    uint8_t* scratch = row_scratch(K);
    for (int64_t n = lo; n < hi; ++n) {
      while (n >= seg.end(s)) ++s;
      const uint8_t* row = native_row(seg, base, s, n, K, scratch);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mb = std::min<int64_t>(8, M - m0);
        float sums[8];
        dot_packed(seg.type(s), mb, row, K, xp + m0 * K, xsum.data(), sums);
        for (int64_t m = 0; m < mb; ++m) yp[(m0 + m) * N + n] = sums[m];
      }
    }
  });
}

// out [R, K] float32 = rows `ids` (int64 [R]) of the packed matrix (uint8 bytes, segment table), exactly.
void packed_rows(at::Tensor bytes, at::Tensor table, int64_t K, at::Tensor ids, at::Tensor out) {
  TORCH_CHECK(bytes.dtype() == at::kByte && bytes.is_contiguous(), "packed bytes must be contiguous uint8");
  TORCH_CHECK(out.dtype() == at::kFloat && out.is_contiguous() && out.size(-1) == K, "out must be [R, K] float32");
  TORCH_CHECK(ids.dtype() == at::kLong && ids.is_contiguous() && out.numel() == ids.numel() * K, "ids must be int64 [R]");
  const Segments seg(table, K, bytes.numel());
  const uint8_t* base = bytes.data_ptr<uint8_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < ids.numel(); ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < seg.rows, "row ", ip[r], " out of range [0, ", seg.rows, ")");
  at::parallel_for(0, ids.numel(), 4, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t s = seg.find(ip[r]);
      decode_row(seg.type(s), native_row(seg, base, s, ip[r], K, row_scratch(K)), K, op + r * K);
    }
  });
}

}  // namespace kq
}  // namespace deltaserve
