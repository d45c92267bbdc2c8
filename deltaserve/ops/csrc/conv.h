// The short causal depthwise conv that precedes the delta rule in every GDN / KDA layer, with its state.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace deltaserve {

// Sequences of at most this many tokens go through conv_step4 a token at a time, so that a speculative verify pass
// gives a decode step's bits (its sums run in another order than the blocked loop's).
constexpr int64_t kConvStepTokens = 8;

// The conv for exactly one token of each of N sequences, kernel width 4: a few microseconds of work, less
// than waking a second thread or laying the weight out tap-major would cost.
void conv_step4(const float* xp, int64_t xs, const float* wp, const float* bp, float* sp, const int64_t* cu,
                const int64_t* idx, float* op, int64_t os, int64_t N, int64_t C, bool silu) {
  constexpr int64_t CB = 64;
  alignas(64) float y[CB];
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = cu[n];
    float* __restrict__ st = sp + (idx ? idx[n] : n) * 3 * C;
    for (int64_t c0 = 0; c0 < C; c0 += CB) {
      const int64_t cb = std::min(CB, C - c0);
      const float* __restrict__ w = wp + 4 * c0;
      float *__restrict__ s0 = st + c0, *__restrict__ s1 = s0 + C, *__restrict__ s2 = s1 + C;
      const float* xt = xp + t * xs + c0;  // may be ot: each input is read before its output is written
#pragma omp simd
      for (int64_t c = 0; c < cb; ++c) {
        y[c] = w[4 * c] * s0[c] + w[4 * c + 1] * s1[c] + w[4 * c + 2] * s2[c] + w[4 * c + 3] * xt[c];
        s0[c] = s1[c];
        s1[c] = s2[c];
        s2[c] = xt[c];
      }
      if (bp)
        for (int64_t c = 0; c < cb; ++c) y[c] += bp[c0 + c];
      float* ot = op + t * os + c0;
      if (silu) {
#pragma omp simd
        for (int64_t c = 0; c < cb; ++c) ot[c] = y[c] / (1.f + std::exp(-y[c]));
      } else {
        for (int64_t c = 0; c < cb; ++c) ot[c] = y[c];
      }
    }
  }
}

// Short causal depthwise conv with its state. x [T, C] (rows any stride apart); weight [C, W]; bias [C] or
// empty; state [S, W-1, C] (in/out, the last W-1 inputs, oldest first); cu_seqlens [N + 1]; state_idx [N] or
// empty; out [T, C] (rows any stride apart; it may be x itself).
// Threads over (sequence, block of channels); each task first lays its block of the weight out tap-major,
// so the channel loops are contiguous (a transposed copy in torch cost more than a decode step's conv).
// conv_forward on raw pointers (x rows xs apart, out rows os apart, weight [C, W], bias or null, idx or null)
inline void conv_rows(const float* xp, int64_t xs, const float* wsrc, int64_t W, const float* bp, float* sp,
                      const int64_t* cu, int64_t N, const int64_t* idx, float* op, int64_t os, int64_t C, bool silu) {
  int64_t longest = 0;
  for (int64_t n = 0; n < N; ++n) longest = std::max(longest, cu[n + 1] - cu[n]);
  if (W == 4 && longest == 1) {  // one token per sequence (decode): no blocks, no threads
    conv_step4(xp, xs, wsrc, bp, sp, cu, idx, op, os, N, C, silu);
    return;
  }
  if (W == 4 && longest <= kConvStepTokens) {  // a few (a verify pass): token by token, each as a decode step
    std::vector<int64_t> at, rows;             // the sequences that have an i-th token: its row, their state rows
    for (int64_t i = 0; i < longest; ++i) {
      at.clear(), rows.clear();
      for (int64_t n = 0; n < N; ++n)
        if (cu[n] + i < cu[n + 1]) at.push_back(cu[n] + i), rows.push_back(idx ? idx[n] : n);
      conv_step4(xp, xs, wsrc, bp, sp, at.data(), rows.data(), op, os, static_cast<int64_t>(at.size()), C, silu);
    }
    return;
  }
  constexpr int64_t CB = 256;
  const int64_t blocks = (C + CB - 1) / CB;
  at::parallel_for(0, N * blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> hist((W - 1) * CB), wt(W * CB);
    alignas(64) float y[CB];
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t n = task / blocks, c0 = (task % blocks) * CB, cb = std::min(CB, C - c0);
      for (int64_t c = 0; c < cb; ++c)
        for (int64_t w = 0; w < W; ++w) wt[w * CB + c] = wsrc[(c0 + c) * W + w];
      float* st = sp + (idx ? idx[n] : n) * (W - 1) * C + c0;
      for (int64_t w = 0; w < W - 1; ++w)
        for (int64_t c = 0; c < cb; ++c) hist[w * CB + c] = st[w * C + c];
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        const float* xt = xp + t * xs + c0;
        const float* wl = wt.data() + (W - 1) * CB;
#pragma omp simd
        for (int64_t c = 0; c < cb; ++c) y[c] = (bp ? bp[c0 + c] : 0.f) + wl[c] * xt[c];
        for (int64_t w = 0; w < W - 1; ++w) {
          const float* ww = wt.data() + w * CB;
          const float* hw = hist.data() + w * CB;
#pragma omp simd
          for (int64_t c = 0; c < cb; ++c) y[c] += ww[c] * hw[c];
        }
        for (int64_t w = 0; w + 1 < W - 1; ++w)  // slide the window by one input
          std::copy(hist.begin() + (w + 1) * CB, hist.begin() + (w + 1) * CB + cb, hist.begin() + w * CB);
        if (W > 1) std::copy(xt, xt + cb, hist.begin() + (W - 2) * CB);
        float* ot = op + t * os + c0;
#pragma omp simd
        for (int64_t c = 0; c < cb; ++c) ot[c] = silu ? y[c] / (1.f + std::exp(-y[c])) : y[c];
      }
      for (int64_t w = 0; w < W - 1; ++w)
        for (int64_t c = 0; c < cb; ++c) st[w * C + c] = hist[w * CB + c];
    }
  });
}

void conv_forward(at::Tensor x, at::Tensor weight, at::Tensor bias, at::Tensor state,
                  at::Tensor cu_seqlens, at::Tensor state_idx, at::Tensor out, bool silu) {
  conv_rows(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), weight.size(1),
            bias.numel() ? bias.data_ptr<float>() : nullptr, state.data_ptr<float>(), cu_seqlens.data_ptr<int64_t>(),
            cu_seqlens.size(0) - 1, state_idx.numel() ? state_idx.data_ptr<int64_t>() : nullptr, out.data_ptr<float>(),
            out.stride(0), x.size(1), silu);
}

}  // namespace deltaserve
