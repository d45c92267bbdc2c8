// The machine's own peaks, measured in the benchmark's run (bench/kernels.py) so that each kernel's rate can be
// given as a fraction of what this CPU reaches: float32 FMAs, int8 dot products (vpdpbusd, or vpmaddubsw
// alone without VNNI), bfloat16 dot products (vdpbf16ps) and memory reads. Each thread keeps 12 independent chains (an FMA waits 4 cycles, and
// two issue per cycle: 8 chains in flight is the least that fills both pipes). Each thread times its own rounds
// and keeps its fastest, and the rates add up: on a machine shared with other jobs a thread is often preempted,
// and timing all threads together would measure the scheduler.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx.h"
#include "gemv.h"
#include "int8gemm.h"

namespace deltaserve {

constexpr int kChains = 12;

// sum over threads of ops / (that thread's fastest of `reps` calls of round(thread)), round returning its ops
template <class F>
inline double per_thread_rate(int64_t reps, F&& round) {
  const int threads = at::get_num_threads();
  std::vector<double> rate(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t r = 0; r < reps; ++r) {
        const auto start = std::chrono::steady_clock::now();
        const double ops = round(t);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (s > 0) rate[t] = std::max(rate[t], ops / s);
      }
  });
  double total = 0;
  for (double r : rate) total += r;
  return total;
}

// float32 multiply-adds per second on all threads, rounds of `iters` x kChains vector FMAs
inline double probe_fma(int64_t iters, int64_t reps) {
  return per_thread_rate(reps, [&](int64_t) {
    float sink = 0.f;
#if defined(__AVX512F__)
    __m512 acc[kChains];
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
    for (int64_t i = 0; i < iters; ++i)
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    for (int c = 1; c < kChains; ++c) acc[0] = _mm512_add_ps(acc[0], acc[c]);
    sink = _mm512_reduce_add_ps(acc[0]);
    constexpr int lanes = 16;
#elif defined(__AVX2__)
    __m256 acc[kChains];
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(c));
    for (int64_t i = 0; i < iters; ++i)
      for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    for (int c = 1; c < kChains; ++c) acc[0] = _mm256_add_ps(acc[0], acc[c]);
    sink = _mm256_cvtss_f32(acc[0]);
    constexpr int lanes = 8;
#else
    constexpr int lanes = 0;
#endif
    asm volatile("" : : "x"(sink));  // the chains' result is used: the loop stays
    return 2.0 * lanes * kChains * iters;
  });
}

// int8 products (a multiply and an add each) per second on all threads, summed into int32 as the kernels do
inline double probe_int8(int64_t iters, int64_t reps) {
  return per_thread_rate(reps, [&](int64_t) {
    int32_t sink = 0;
#if defined(__AVX512VNNI__)
    __m512i acc[kChains];
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c);
    for (int64_t i = 0; i < iters; ++i)
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
    for (int c = 1; c < kChains; ++c) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
    sink = _mm512_reduce_add_epi32(acc[0]);
    constexpr int lanes = 64;
#elif defined(__AVX2__)
    // the multiply unit's rate: each chain's products are its next operand (with two constant operands the compiler
    // hoists the product out of the loop and the adds are timed instead, 1.3x the real rate)
    __m256i acc[kChains];
    const __m256i b = _mm256_set1_epi8(-2);
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c);
    for (int64_t i = 0; i < iters; ++i)
      for (int c = 0; c < kChains; ++c) acc[c] = _mm256_maddubs_epi16(acc[c], b);
    for (int c = 1; c < kChains; ++c) acc[0] = _mm256_add_epi32(acc[0], acc[c]);
    sink = _mm256_extract_epi32(acc[0], 0);
    constexpr int lanes = 32;
#else
    constexpr int lanes = 0;
#endif
    asm volatile("" : : "r"(sink));
    return 2.0 * lanes * kChains * iters;
  });
}

// int8 products per second on all threads in the arithmetic of GGML type `type`'s prefill kernel on vpdpbusd
// (int8gemm.h panel_rows), operands in registers: 10 chains, and per chain and group of codes the scaling the format's
// blocks need, one vpdpwssd per 16 codes (narrow_sums: Q2_K, Q3_K, Q4_K) or vcvtdq2ps + vfmadd per 32 (Q5_K,
// IQ4_XS) or 16 (Q6_K). Beside probe_int8, the ceiling the format's scales leave its products on this CPU (0 without
// VNNI).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int Group, bool Narrow>
inline double probe_scaled_as(int64_t iters, int64_t reps) {
  return per_thread_rate(reps, [&](int64_t) {
    constexpr int kChainsP = static_cast<int>(kq::kPanelRows);
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2), sc = _mm512_set1_epi32(5);
    const __m512 scf = _mm512_set1_ps(5.f);
    __m512i total = _mm512_setzero_si512();
    __m512 totalf = _mm512_setzero_ps();
    for (int64_t i = 0; i < iters; ++i) {  // a block of 256 codes, its sums in registers as in panel_rows (held
      __m512i blk[kChainsP];               // across the whole loop, GCC kept them in memory)
      __m512 blkf[kChainsP];
      for (int m = 0; m < kChainsP; ++m) {
        if constexpr (Narrow) blk[m] = kq::fresh_zero();
        else blkf[m] = _mm512_setzero_ps();
      }
#pragma GCC unroll 1
      for (int g = 0; g < 256 / Group; ++g) {
        __m512i sub[kChainsP];
        for (int m = 0; m < kChainsP; ++m) sub[m] = kq::fresh_zero();  // (volatile: the chains are not hoisted)
#pragma GCC unroll 8
        for (int c = 0; c < Group / 4; ++c)
#pragma GCC unroll 16
          for (int m = 0; m < kChainsP; ++m) sub[m] = _mm512_dpbusd_epi32(sub[m], a, b);
#pragma GCC unroll 16
        for (int m = 0; m < kChainsP; ++m) {
          if constexpr (Narrow) kq::add_scaled16(blk[m], sub[m], sc);
          else blkf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sub[m]), scf, blkf[m]);
        }
      }
      for (int m = 0; m < kChainsP; ++m) {
        if constexpr (Narrow) total = _mm512_add_epi32(total, blk[m]);
        else totalf = _mm512_add_ps(totalf, blkf[m]);
      }
    }
    const float sink = static_cast<float>(_mm512_reduce_add_epi32(total)) + _mm512_reduce_add_ps(totalf);
    asm volatile("" : : "x"(sink));
    return 2.0 * 64 * kChainsP * 64 * iters;  // 64 vpdpbusd a chain per block
  });
}
#endif

inline double probe_int8_format(int64_t iters, int64_t reps, int64_t type) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  TORCH_CHECK(kq::int8_type(type) && !q8::block32(type), "probe_int8_format: GGML type ", type,
              " is not a K-quant or IQ4_XS");
  if (kq::narrow_sums(type)) return probe_scaled_as<16, true>(iters, reps);
  return kq::per32(type) ? probe_scaled_as<32, false>(iters, reps) : probe_scaled_as<16, false>(iters, reps);
#else
  return 0.0;
#endif
}

// bfloat16 products (a multiply and an add each) per second on all threads as the bf16 kernels run them: vdpbf16ps
// where the build has AVX512_BF16 (32 products a vector), else the float32 FMAs their widened weights go through
inline double probe_bf16(int64_t iters, int64_t reps) {
#if defined(__AVX512BF16__)
  return per_thread_rate(reps, [&](int64_t) {
    __m512 acc[kChains];
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.999f), _mm512_set1_ps(0.999f));
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
    for (int64_t i = 0; i < iters; ++i)
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
    for (int c = 1; c < kChains; ++c) acc[0] = _mm512_add_ps(acc[0], acc[c]);
    const float sink = _mm512_reduce_add_ps(acc[0]);
    asm volatile("" : : "x"(sink));
    return 2.0 * 32 * kChains * iters;
  });
#else
  return probe_fma(iters, reps);
#endif
}

// products per second on all threads through AMX tiles, four independent 16 x 16 sums a thread with the inputs held
// in tiles: tdpbf16ps (bfloat16, as the bf16 prefill runs them) or tdpbsud (int8, as the K-quant prefill); 0 where
// AMX is not on
template <bool Int8>
inline double probe_amx(int64_t iters, int64_t reps) {
#if defined(DELTASERVE_AMX)
  if (!amx::enabled()) return 0.0;
  return per_thread_rate(reps, [&](int64_t) {
    alignas(64) static const uint8_t zeros[1024] = {};  // the unit's rate does not depend on the values
    const amx::Scope tiles;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, zeros, 64);
    _tile_loadd(5, zeros, 64);
    _tile_loadd(6, zeros, 64);
    _tile_loadd(7, zeros, 64);
    for (int64_t i = 0; i < iters; ++i) {
      if constexpr (Int8) {
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
        _tile_dpbsud(2, 5, 6);
        _tile_dpbsud(3, 5, 7);
      } else {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    return 2.0 * 16 * 16 * (Int8 ? 64 : 32) * 4 * iters;
  });
#else
  (void)iters, (void)reps;
  return 0.0;
#endif
}

// bytes read per second on all threads, each reading its share of `buf` (uint8, contiguous, whole 256s) 1 MB a
// round, in turn (rounds of a few hundred microseconds run whole between other jobs; a share larger than the L3
// comes back from memory), prefetched into L2 as far ahead as the decode GEMVs prefetch their rows (without it a
// Xeon's demand loads read 15 GB/s a core where those kernels stream 24)
inline double probe_read(at::Tensor buf, int64_t reps) {
  TORCH_CHECK(buf.dtype() == at::kByte && buf.is_contiguous() && buf.numel() % 256 == 0, "buf must be uint8, whole 256s");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t n = buf.numel() / 256, threads = at::get_num_threads(), share = std::max<int64_t>(1, n / threads);
  constexpr int64_t kChunk = 4096;  // blocks of 256 bytes: 1 MB
  std::vector<int64_t> next(threads, 0);
  return per_thread_rate(reps, [&](int64_t t) {
    const int64_t lo = std::min(n, t * share + (next[t]++ * kChunk) % share), hi = std::min({n, lo + kChunk, (t + 1) * share});
    int64_t sink = 0;
#if defined(__AVX512F__)
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int64_t i = lo; i < hi; ++i)
      for (int c = 0; c < 4; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(p + 256 * i + kF16Prefetch + 64 * c), _MM_HINT_T1);
        acc[c] = _mm512_xor_si512(acc[c], _mm512_loadu_si512(p + 256 * i + 64 * c));
      }
    sink = _mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(acc[0], acc[1]), _mm512_xor_si512(acc[2], acc[3])));
#elif defined(__AVX2__)
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t i = lo; i < hi; ++i) {
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(p + 256 * i + kF16Prefetch + 64 * c), _MM_HINT_T1);
      for (int c = 0; c < 8; ++c)
        acc[c % 4] = _mm256_xor_si256(acc[c % 4], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256 * i + 32 * c)));
    }
    sink = _mm256_extract_epi64(_mm256_xor_si256(_mm256_xor_si256(acc[0], acc[1]), _mm256_xor_si256(acc[2], acc[3])), 0);
#else
    for (int64_t i = 256 * lo; i < 256 * hi; ++i) sink += p[i];
#endif
    asm volatile("" : : "r"(sink));
    return 256.0 * (hi - lo);
  });
}

// the sum of buf's bytes, read once on all threads, each its contiguous share, prefetched as the decode GEMVs
// prefetch their rows: a pass the bench times by the wall clock beside a pass of the decode GEMVs over as many bytes,
// measured as they are (probe_read's fastest rounds are a peak no whole pass reaches)
inline int64_t read_sum(at::Tensor buf) {
  TORCH_CHECK(buf.dtype() == at::kByte && buf.is_contiguous() && buf.numel() % 256 == 0, "buf must be uint8, whole 256s");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t n = buf.numel() / 256, threads = at::get_num_threads();
  std::vector<int64_t> part(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
      int64_t sum = 0;
#if defined(__AVX512BW__)
      __m512i acc = _mm512_setzero_si512();
      for (int64_t i = lo; i < hi; ++i)
        for (int c = 0; c < 4; ++c) {
          _mm_prefetch(reinterpret_cast<const char*>(p + 256 * i + kF16Prefetch + 64 * c), _MM_HINT_T1);
          acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_loadu_si512(p + 256 * i + 64 * c), _mm512_setzero_si512()));
        }
      sum = _mm512_reduce_add_epi64(acc);
#elif defined(__AVX2__)
      __m256i acc = _mm256_setzero_si256();
      for (int64_t i = lo; i < hi; ++i)
        for (int c = 0; c < 8; ++c) {
          if (c % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + 256 * i + kF16Prefetch + 32 * c), _MM_HINT_T1);
          acc = _mm256_add_epi64(acc, _mm256_sad_epu8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256 * i + 32 * c)),
                                                      _mm256_setzero_si256()));
        }
      alignas(32) int64_t lanes[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
      sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
      for (int64_t i = 256 * lo; i < 256 * hi; ++i) sum += p[i];
#endif
      part[t] = sum;
    }
  });
  int64_t total = 0;
  for (int64_t s : part) total += s;
  return total;
}

}  // namespace deltaserve
