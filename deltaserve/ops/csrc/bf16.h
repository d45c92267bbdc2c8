// Float32 activations times bfloat16 weights [N, K] (a BF16 GGUF's or a bf16 Hugging Face checkpoint's matrices, kept
// as the file holds them). Where the build has AVX512_BF16 the activations are rounded to bfloat16 (to nearest,
// ties to even), as llama.cpp and transformers do beside bf16 weights, and vdpbf16ps multiplies pairs of them
// (products exact in float32, sums in float32); the caller may ask for float32 activations instead (exact weights
// times unrounded activations, slower). Those, and every build without AVX512_BF16, widen the weights to float32 in
// registers (a bfloat16 is a float32's upper half: a 16-bit shift) and multiply with FMAs: AVX-512, AVX2, or
// portable C++. The build's macros choose the instructions, as in the other headers.
//
// The weights are never rearranged where they are held, so the same matrix serves embedding lookups, sharding and
// the tied output head as it lies.
//   decode (M <= kGemvRows): threads split the weight rows; each row is read from memory once, as one prefetched
//     stream, and multiplied by every activation row while it is in L1, each output a dot product along K kept in
//     one vector accumulator (lanes = consecutive k) and summed across lanes at the end;
//   prefill, rounded activations: panel_gemm.h's driver with PairFormat below (W's blocks rearranged into pairs in
//     L2 per call, 6 x 64 register tiles, no sums across lanes), or where AMX runs (amx.h) with bf16_amx.h's
//     AmxFormat (the same pairs, 32 x 32 blocks of sums in tile registers);
//   prefill, float32 activations: f16gemm.h's GEMM, its panels widened from bfloat16 (a shift) instead of float16.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "amx.h"
#include "bf16_amx.h"
#include "f16gemm.h"
#include "gemv.h"
#include "panel_gemm.h"
#include "shares.h"
#include "xrows.h"

namespace deltaserve {
namespace bf16 {

constexpr int64_t kGemvRows = 16;   // activation rows up to which the decode driver runs

inline float widen(uint16_t b) { return f16::widen1<true>(b); }

// float32 -> bfloat16 bits, to nearest, ties to even, as vcvtne2ps2bf16 rounds: NaN kept a quiet NaN, inputs below
// 2^-126 taken as (signed) zero
inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  if ((u & 0x7f800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The products' instructions: Acc a vector of float32 partial sums; a step multiplies kStep consecutive k of one
// activation row (X) by one weight row; XT is how the activations are held (bfloat16 bits for vdpbf16ps, else
// float32). Dot rounds the activations (AVX512_BF16 builds only); Widen keeps them float32 (every build).
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kDpbf16 = true;
struct Dot {
  using XT = uint16_t;
  static constexpr int64_t kStep = 32;
  using Acc = __m512;
  using W = __m512i;
  using X = __m512i;
  static Acc zero() { return _mm512_setzero_ps(); }
  static W load_w(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static X load_x(const XT* p) { return _mm512_loadu_si512(p); }
  static Acc madd(Acc a, X x, W w) { return _mm512_dpbf16_ps(a, (__m512bh)x, (__m512bh)w); }
  static float sum(Acc a) { return _mm512_reduce_add_ps(a); }
  static float scalar_x(XT v) { return widen(v); }
};
#else
constexpr bool kDpbf16 = false;
#endif

#if defined(__AVX512F__)
constexpr const char* kWiden = "AVX-512 (bfloat16 widened to float32, FMA)";
struct Widen {
  using XT = float;
  static constexpr int64_t kStep = 16;
  using Acc = __m512;
  using W = __m512;
  using X = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static W load_w(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static X load_x(const XT* p) { return _mm512_loadu_ps(p); }
  static Acc madd(Acc a, X x, W w) { return _mm512_fmadd_ps(x, w, a); }
  static float sum(Acc a) { return _mm512_reduce_add_ps(a); }
  static float scalar_x(XT v) { return v; }
};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kWiden = "AVX2 (bfloat16 widened to float32, FMA)";
struct Widen {
  using XT = float;
  static constexpr int64_t kStep = 8;
  using Acc = __m256;
  using W = __m256;
  using X = __m256;
  static Acc zero() { return _mm256_setzero_ps(); }
  static W load_w(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static X load_x(const XT* p) { return _mm256_loadu_ps(p); }
  static Acc madd(Acc a, X x, W w) { return _mm256_fmadd_ps(x, w, a); }
  static float sum(Acc a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
  static float scalar_x(XT v) { return v; }
};
#else
constexpr const char* kWiden = "portable (bfloat16 widened to float32)";
struct Widen {
  using XT = float;
  static constexpr int64_t kStep = 1;
  using Acc = float;
  using W = float;
  using X = float;
  static Acc zero() { return 0.f; }
  static W load_w(const uint16_t* p) { return widen(*p); }
  static X load_x(const XT* p) { return *p; }
  static Acc madd(Acc a, X x, W w) { return a + x * w; }
  static float sum(Acc a) { return a; }
  static float scalar_x(XT v) { return v; }
};
#endif

// what this build runs: with rounded activations first where it can
inline std::string isa() {
  const std::string prefill = amx::enabled() ? "prefill on AMX tiles (tdpbf16ps), " : "";
  return kDpbf16 ? std::string("AVX512_BF16 (") + prefill + "vdpbf16ps on activations rounded to bfloat16; float32 activations: " +
                       kWiden + ")"
                 : std::string(kWiden);
}

// decode: one weight row times RM activation rows, two accumulators each (a step's latency hidden), the row read
// as one stream from memory (prefetched kPrefetch ahead, as gemv.h's)
template <class I, int RM>
inline void row_tile(const typename I::XT* x, int64_t ldx, const uint16_t* w, int64_t K, float* y, int64_t ldy) {
  typename I::Acc a0[RM], a1[RM];
  for (int m = 0; m < RM; ++m) a0[m] = a1[m] = I::zero();
  int64_t k = 0;
  for (; k + 2 * I::kStep <= K; k += 2 * I::kStep) {
    const char* ahead = reinterpret_cast<const char*>(w + k) + kF16Prefetch;
    for (int64_t b = 0; b < 2 * I::kStep * 2; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
    const typename I::W w0 = I::load_w(w + k), w1 = I::load_w(w + k + I::kStep);
    for (int m = 0; m < RM; ++m) {
      a0[m] = I::madd(a0[m], I::load_x(x + m * ldx + k), w0);
      a1[m] = I::madd(a1[m], I::load_x(x + m * ldx + k + I::kStep), w1);
    }
  }
  for (; k + I::kStep <= K; k += I::kStep) {
    const typename I::W w0 = I::load_w(w + k);
    for (int m = 0; m < RM; ++m) a0[m] = I::madd(a0[m], I::load_x(x + m * ldx + k), w0);
  }
  for (int m = 0; m < RM; ++m) {
    float s = I::sum(a0[m]) + I::sum(a1[m]);
    for (int64_t j = k; j < K; ++j) s += I::scalar_x(x[m * ldx + j]) * widen(w[j]);
    y[m * ldy] = s;
  }
}

// decode: weight rows n0 .. n1, each read once and multiplied by all M activation rows, 4 at a time
template <class I>
inline void rows(const typename I::XT* x, int64_t M, const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1,
                 float* y) {
  using Fn = void (*)(const typename I::XT*, int64_t, const uint16_t*, int64_t, float*, int64_t);
  static constexpr Fn by_rows[4] = {row_tile<I, 1>, row_tile<I, 2>, row_tile<I, 3>, row_tile<I, 4>};
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; m += 4) by_rows[std::min<int64_t>(4, M - m) - 1](x + m * K, K, w + n * K, K, y + m * N + n, N);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// x [n] rounded to bfloat16 into `held` (torch's allocator: 64-byte aligned, so no activation load splits a cache line)
inline const uint16_t* rounded(const float* x, int64_t n, at::Tensor& held) {
  held = at::empty({n}, at::TensorOptions().dtype(at::kBFloat16));
  uint16_t* out = reinterpret_cast<uint16_t*>(held.data_ptr<at::BFloat16>());
  at::parallel_for(0, n, 1 << 14, [&](int64_t lo, int64_t hi) {
    int64_t i = lo;
    for (; i + 32 <= hi; i += 32) {  // vcvtne2ps2bf16: as round_bf16
      const __m512bh r = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
      _mm512_storeu_si512(out + i, (__m512i)r);
    }
    for (; i < hi; ++i) out[i] = round_bf16(x[i]);
  });
  return out;
}

// The prefill GEMM of rounded activations, as panel_gemm.h's format: vdpbf16ps multiplies a pair of consecutive k, so
// x is rounded and laid out in row tiles of pairs [tile][Kp / 2][kMR][2] and W's blocks in panels of pairs
// [column tile][kc / 2][kNR][2] (Kp, kc rounded up to even, the missing value 0): one load gives kNR / 4 columns'
// pairs at one k pair, one 32-bit broadcast a row's pair, and every output's sum stays in one lane (no sums across
// lanes: the 4 x 4 tiles above spent a tenth of their time on those at K = 1024). 6 rows x 4 zmm of columns, as
// f16gemm.h's tiles.
struct PairFormat {
  using X = uint16_t;
  using P = uint16_t;
  static constexpr int kNV = 4;
  static constexpr int64_t kMR = 6, kNR = 16 * kNV, kKC = 512, kNC = 256;  // a panel: 256 KB
  static int64_t even(int64_t k) { return (k + 1) & ~int64_t{1}; }
  static int64_t x_at(int64_t t, int64_t K, int64_t k0) { return t * kMR * even(K) + k0 * kMR; }
  static int64_t panel_at(int64_t j, int64_t kc) { return j * even(kc); }
  static int64_t panel_size() { return kKC * kNC; }
  static constexpr bool kColumnsOuter = false;
  static int64_t x_size(int64_t M, int64_t K) { return (M + kMR - 1) / kMR * kMR * even(K); }
  using Scope = NoTiles;

  // x [M, K] rounded into xp (x_at's layout; a last tile's missing rows are never read)
  static void pack_x(const float* x, int64_t M, int64_t K, int64_t ldx, uint16_t* xp) {
    const int64_t Kp = even(K);
    at::parallel_for(0, (M + kMR - 1) / kMR, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t)
        for (int64_t i = 0; i < std::min<int64_t>(kMR, M - t * kMR); ++i) {
          const float* xr = x + (t * kMR + i) * ldx;
          uint16_t* out = xp + t * kMR * Kp + 2 * i;
          int64_t k = 0;
          for (; k + 32 <= K; k += 32) {  // 16 pairs a step
            alignas(64) uint32_t pairs[16];
            _mm512_store_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k)));
            for (int j = 0; j < 16; ++j) std::memcpy(out + (k / 2 + j) * 2 * kMR, pairs + j, 4);
          }
          for (; k < Kp; ++k) out[(k / 2) * 2 * kMR + (k & 1)] = k < K ? round_bf16(xr[k]) : 0;
        }
    });
  }

  static void pack_w(const uint16_t* w, int64_t K, int64_t n0, int64_t nc, int64_t k0, int64_t kc, uint16_t* bp) {
    pack_pairs<kNV>(w, K, n0, nc, k0, kc, even(kc), kNV * ((nc + kNR - 1) / kNR), bp);
  }

  template <int MR>
  static void tile_of(const uint16_t* xp, const uint16_t* bp, int64_t kc, float* y, int64_t ldy, int64_t cols, bool add) {
    __m512 c[MR][kNV];
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < kNV; ++v) c[i][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < even(kc) / 2; ++p) {
      __m512i b[kNV];
      for (int v = 0; v < kNV; ++v) b[v] = _mm512_loadu_si512(bp + (p * kNR + 16 * v) * 2);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, xp + (p * kMR + i) * 2, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < kNV; ++v) c[i][v] = _mm512_dpbf16_ps(c[i][v], a, (__m512bh)b[v]);
      }
    }
    store_tile<MR, kNV>(c, y, ldy, cols, add);
  }

  static void tile(int64_t rows, const uint16_t* xp, const uint16_t* bp, int64_t kc, float* y, int64_t ldy,
                   int64_t cols, bool add) {
    using Fn = void (*)(const uint16_t*, const uint16_t*, int64_t, float*, int64_t, int64_t, bool);
    static constexpr Fn by_rows[kMR] = {tile_of<1>, tile_of<2>, tile_of<3>, tile_of<4>, tile_of<5>, tile_of<6>};
    by_rows[rows - 1](xp, bp, kc, y, ldy, cols, add);
  }
};
#endif

// y [M, N] = x [M, K] (as I holds it) @ w [N, K]^T for decode (M <= kGemvRows)
template <class I>
inline void product(const typename I::XT* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t N, float* yp) {
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    ShareClock clock(hi - lo);
    rows<I>(xp, M, wp, K, N, lo, hi, yp);
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// prefill of rounded activations (x's rows ldx floats apart) through the panel format F (PairFormat, or AmxFormat
// where the tiles run)
template <class F>
inline void rounded_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
  // torch's allocator: 64-byte aligned, so no load of the packed x splits a cache line; pack_x writes all F reads
  const at::Tensor held = at::empty({F::x_size(M, K)}, at::TensorOptions().dtype(at::kBFloat16));
  uint16_t* xp = reinterpret_cast<uint16_t*>(held.data_ptr<at::BFloat16>());
  F::pack_x(x, M, K, ldx, xp);
  panel_gemm<F>(xp, w, y, M, N, K);
}
#endif

// y [M, N] = x [M, K] (float32, rows any distance apart) @ w [N, K]^T (bfloat16), float32 out; w and y contiguous.
// round: x rounded to bfloat16 and vdpbf16ps, where the build has AVX512_BF16 (elsewhere float32 activations
// regardless)
inline void linear_bf16(at::Tensor x, at::Tensor w, at::Tensor y, bool round) {
  check_rows(x, "linear_bf16");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "linear_bf16: w must be bfloat16 [N, K], contiguous, K as x's");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.numel() == x.size(0) * w.size(0),
              "linear_bf16: y must be float32 [M, N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (M == 0 || N == 0) return;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  (void)round;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (round && M > kGemvRows) {
#if defined(DELTASERVE_AMX)
    if (amx::enabled()) return rounded_gemm<AmxFormat>(x.data_ptr<float>(), row_stride(x), M, K, wp, N, y.data_ptr<float>());
#endif
    return rounded_gemm<PairFormat>(x.data_ptr<float>(), row_stride(x), M, K, wp, N, y.data_ptr<float>());
  }
#endif
  // float32 activations at prefill: f16gemm.h's panels of widened weights (6 x 64 register tiles; the 4 x 4 dot
  // tiles they replace summed across lanes: 206-217 -> 281-310 GFLOP/s on an AVX-512 Xeon, 134-146 -> 177-186 in
  // its AVX2 build)
  if (M > kGemvRows) return f16::gemm<true>(x.data_ptr<float>(), row_stride(x), wp, y.data_ptr<float>(), M, N, K);
  x = x.contiguous();  // decode: a few rows, each read as one run
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (round) {
    at::Tensor held;
    return product<Dot>(rounded(x.data_ptr<float>(), M * K, held), M, K, wp, N, y.data_ptr<float>());
  }
#endif
  product<Widen>(x.data_ptr<float>(), M, K, wp, N, y.data_ptr<float>());
}

}  // namespace bf16
}  // namespace deltaserve
