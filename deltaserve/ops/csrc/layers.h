// The small layers of a decode step in one call each: RMSNorm (with an output gate), SwiGLU, and a step of
// gated attention over the KV cache.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attn_step.h"

namespace deltaserve {

// The index of the largest value of each row of x [M, N] float32 contiguous (N >= 1): the first of equal ones (0.0
// and -0.0 equal), the first NaN where a row has one, as torch.argmax chooses. Greedy decoding's choice over a row of
// logits, where the ATen op cost 10 us on 4,096 values. The values are compared as integers that order as the floats
// do, which -ffast-math cannot reorder away (in float, its max reduction lost a row of -inf): a vectorised maximum,
// then the first index holding it.
inline int32_t float_order(uint32_t bits) {
  const int32_t k = static_cast<int32_t>(bits == 0x80000000u ? 0u : bits);
  return k ^ ((k >> 31) & 0x7fffffff);  // negative floats: larger magnitudes lower
}

inline at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) >= 1 && x.is_contiguous(),
              "argmax_rows: x must be float32 [M, N >= 1] contiguous");
  const int64_t M = x.size(0), N = x.size(1);
  at::Tensor out = at::empty({M}, at::TensorOptions().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(x.data_ptr<float>()) + m * N;
    int32_t best = INT32_MIN;
    uint32_t nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t j = 0; j < N; ++j) {
      best = std::max(best, float_order(bits[j]));
      nan |= (bits[j] & 0x7fffffffu) > 0x7f800000u;
    }
    int64_t at = 0;
    if (nan)
      while ((bits[at] & 0x7fffffffu) <= 0x7f800000u) ++at;
    else
      while (float_order(bits[at]) != best) ++at;
    op[m] = at;
  }
  return out;
}

// The row loops below that at::parallel_for runs are functions of their own, never inlined: parallel_for calls its
// body inline (few rows, one thread) or on the threads, GCC compiled the two call sites apart and reassociated the
// sums differently in each (-ffast-math), so a row's bits depended on how many rows came with it (a verify pass's
// 80 gated rows against a decode step's 16). One compiled copy keeps every row the same bits.
[[gnu::noinline]] inline void rms_norm_rows(const float* xp, const float* wp, float* op, const float* gp, int64_t D,
                                          double eps, int64_t per_token, int64_t gs, int64_t gr, int64_t act,
                                          int64_t lo, int64_t hi) {
  for (int64_t m = lo; m < hi; ++m) {
    const float* xr = xp + m * D;
    float* orow = op + m * D;
    // 16 partial sums in a fixed order: the result must not depend on where the row lies in memory
    // (a vectoriser aligning its loads would otherwise change the rounding between calls)
    float part[16] = {0.f};
    int64_t i = 0;
    for (; i + 16 <= D; i += 16)
      for (int j = 0; j < 16; ++j) part[j] += xr[i + j] * xr[i + j];
    for (; i < D; ++i) part[i % 16] += xr[i] * xr[i];
    float ss = 0.f;
    for (int j = 0; j < 16; ++j) ss += part[j];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) orow[i] = xr[i] * r * wp[i];
    if (!gp) continue;
    const float* g = gp + (m / per_token) * gs + (m % per_token) * gr;
    if (act == 1) {
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) orow[i] *= g[i] / (1.f + std::exp(-g[i]));
    } else {
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) orow[i] *= 1.f / (1.f + std::exp(-g[i]));
    }
  }
}

// out = x / sqrt(mean(x^2) + eps) * w over rows of D = w.numel(); x, out float32 contiguous [..., D] (out may be
// x: a row is summed before it is written). One call
// instead of the six small ops of the torch expression (a decode step runs ~80 norms). With a gate (float32
// [tokens, rows per token, D], D contiguous, tokens any stride apart: a slice of a projection) the rows are
// also multiplied by act(gate): act 1 silu, 2 sigmoid (the output gates of GDN and KDA layers).
// rms_norm on raw pointers: M rows of D; gate (or null) per_token rows a token, gs apart by token, gr by row
inline void rms_norm_raw(const float* xp, const float* wp, float* op, const float* gp, int64_t M, int64_t D, double eps,
                         int64_t per_token, int64_t gs, int64_t gr, int64_t act) {
  at::parallel_for(0, M, 64, [&](int64_t lo, int64_t hi) {
    rms_norm_rows(xp, wp, op, gp, D, eps, per_token, gs, gr, act, lo, hi);
  });
}

void rms_norm(at::Tensor x, at::Tensor w, double eps, at::Tensor out, at::Tensor gate, int64_t act) {
  const int64_t D = w.numel(), M = D ? x.numel() / D : 0;
  const float* gp = gate.numel() ? gate.data_ptr<float>() : nullptr;
  rms_norm_raw(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), gp, M, D, eps, gp ? gate.size(1) : 1,
               gp ? gate.stride(0) : 0, gp ? gate.stride(1) : 0, act);
}

// out [M, I] = silu(x[:, :I]) * x[:, I:] (SwiGLU); x [M, 2I] and out float32, rows any stride apart (out may
// be x[:, :I] itself: each element is read before it is written).
[[gnu::noinline]] inline void silu_mul_rows(const float* xp, int64_t xs, float* op, int64_t os, int64_t I, int64_t lo,
                                            int64_t hi) {
  for (int64_t m = lo; m < hi; ++m) {
    const float *g = xp + m * xs, *u = g + I;
    float* o = op + m * os;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

void silu_mul(at::Tensor x, at::Tensor out) {
  const int64_t M = out.size(0), I = out.size(1), xs = x.stride(0), os = out.stride(0);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(I, 1)), [&](int64_t lo, int64_t hi) {
    silu_mul_rows(xp, xs, op, os, I, lo, hi);
  });
}

// x / rms(x) * w, then NeoX rope on the first `rot` channels (pairs i, i + rot/2), in place on one head row.
inline void norm_rope(float* x, const float* w, float eps, const float* cos, const float* sin, int64_t D,
                      int64_t rot) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) x[i] *= r * w[i];
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// Prefill of gated attention: per row of proj [M, ...] (rows any stride apart), RMSNorm and rope of the nh
// query heads at column 0 and the nkv key heads at column k0 (hd = q_norm.numel() each), in place; cos, sin
// [M, rot]. One call instead of the ~12 ops (and their [M, heads, hd] temporaries) of the torch expression.
void norm_rope_rows(at::Tensor proj, at::Tensor q_norm, at::Tensor k_norm, double eps, at::Tensor cos,
                    at::Tensor sin, int64_t nh, int64_t nkv, int64_t k0) {
  const int64_t M = proj.size(0), hd = q_norm.numel(), rot = cos.size(1), ps = proj.stride(0);
  float* pp = proj.data_ptr<float>();
  const float *qw = q_norm.data_ptr<float>(), *kw = k_norm.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      float* row = pp + m * ps;
      for (int64_t h = 0; h < nh; ++h)
        norm_rope(row + h * hd, qw, static_cast<float>(eps), cp + m * rot, sp + m * rot, hd, rot);
      for (int64_t j = 0; j < nkv; ++j)
        norm_rope(row + k0 + j * hd, kw, static_cast<float>(eps), cp + m * rot, sp + m * rot, hd, rot);
    }
  });
}

inline void store_row(const float* x, float* dst, int64_t n) { std::copy(x, x + n, dst); }

inline void store_row(const float* x, at::Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = static_cast<at::Half>(x[i]);
}

// One decode step of gated full attention (Qwen3.5 / Qwen3-Next) for M sequences of one new token each:
// per head RMSNorm of q and k, partial rope, the new key / value written into the cache, attention over the
// cache row up to and including the new token, and the output gate sigmoid(g). One call instead of ~40 small
// ops. proj [M, ...] (rows any stride apart): [q (nh*hd) | g (nh*hd) | k (nkv*hd) | v (nkv*hd)]; cos, sin
// [M, rot]; caches [S, L, nkv, hd] float32 or float16 (CacheT); slots, pos [M] int64 (cache row, position of
// the new token); out [M, nh*hd]. Threads over (sequence, kv head): each reads its keys and values once for
// the group of query heads. The new token's key and value are read back from the cache like the others, so
// a float16 cache rounds them as the prefill path (which attends over the cache) does.
template <typename CacheT>
void attention_step_impl(at::Tensor proj, at::Tensor q_norm, at::Tensor k_norm, double eps,
                         at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor slots, at::Tensor pos, double scale, at::Tensor out) {
  const int64_t M = out.size(0), hd = q_norm.numel(), nh = out.size(1) / hd, nkv = k_cache.size(2);
  const int64_t L = k_cache.size(1), rot = cos.size(1), group = nh / nkv, ps = proj.stride(0);
  const float* pp = proj.data_ptr<float>();
  const float *qw = q_norm.data_ptr<float>(), *kw = k_norm.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  CacheT *kc = k_cache.data_ptr<CacheT>(), *vc = v_cache.data_ptr<CacheT>();
  float* op = out.data_ptr<float>();
  const int64_t *slot = slots.data_ptr<int64_t>(), *at = pos.data_ptr<int64_t>();
  at::parallel_for(0, M * nkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> q(group * hd), buf(hd), scores;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t m = task / nkv, j = task % nkv, n = at[m];
      const float* row = pp + m * ps;
      const float *c = cp + m * rot, *s = sp + m * rot;
      // the new key (normalised, rotated) and value go into the cache
      std::copy(row + (2 * nh + j) * hd, row + (2 * nh + j + 1) * hd, buf.data());
      norm_rope(buf.data(), kw, static_cast<float>(eps), c, s, hd, rot);
      store_row(buf.data(), kc + ((slot[m] * L + n) * nkv + j) * hd, hd);
      store_row(row + (2 * nh + nkv + j) * hd, vc + ((slot[m] * L + n) * nkv + j) * hd, hd);
      for (int64_t h = 0; h < group; ++h) {
        std::copy(row + (j * group + h) * hd, row + (j * group + h + 1) * hd, q.data() + h * hd);
        norm_rope(q.data() + h * hd, qw, static_cast<float>(eps), c, s, hd, rot);
      }
      const CacheT* keys = kc + (slot[m] * L * nkv + j) * hd;  // key t at keys + t * nkv * hd
      const CacheT* vals = vc + (slot[m] * L * nkv + j) * hd;
      const int64_t cnt = n + 1;  // the visible keys, the new one included
      scores.resize(group * cnt);
      step::scores(q.data(), group, keys, nkv * hd, cnt, hd, static_cast<float>(scale), scores.data(), cnt, buf.data());
      for (int64_t h = 0; h < group; ++h) {  // softmax over the visible keys
        float* sc = scores.data() + h * cnt;
        const float mx = *std::max_element(sc, sc + cnt);
#pragma omp simd
        for (int64_t t = 0; t < cnt; ++t) sc[t] = std::exp(sc[t] - mx);
        float sum = 0.f;
        for (int64_t t = 0; t < cnt; ++t) sum += sc[t];
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < cnt; ++t) sc[t] *= inv;
      }
      float* o = op + m * nh * hd + j * group * hd;
      step::values(scores.data(), cnt, group, vals, nkv * hd, cnt, hd, o, buf.data());
      for (int64_t h = 0; h < group; ++h) {  // output gate
        const float* g = row + (nh + j * group + h) * hd;
        float* oh = o + h * hd;
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) oh[i] *= 1.f / (1.f + std::exp(-g[i]));
      }
    }
  });
}

void attention_step(at::Tensor proj, at::Tensor q_norm, at::Tensor k_norm, double eps, at::Tensor cos,
                    at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                    at::Tensor pos, double scale, at::Tensor out) {
  if (k_cache.scalar_type() == at::kHalf)
    attention_step_impl<at::Half>(proj, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, slots, pos, scale, out);
  else
    attention_step_impl<float>(proj, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, slots, pos, scale, out);
}

}  // namespace deltaserve
