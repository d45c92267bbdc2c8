// Fused gated delta rule for CPUs: one pass over the tokens with the state block kept in L1.
//
// The delta rule is separable over the value columns of the state: column j of S evolves from
// k, q, g, beta and v[j] alone. So every (sequence, value head, block of VB columns) is an
// independent task whose K x VB state block stays in L1 for the whole sequence.
//
// Per token, one sweep over the K rows of the block does three things at once:
//   S[i] = e[i] * S[i] + k[i] * u          (decay + delta update of this token)
//   o   += q[i] * S[i]                      (read-out of this token)
//   kv  += e'[i] * k'[i] * S[i]             (S'^T k' of the NEXT token, needed for its u)
// so the state is read and written once per token.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

struct Args {
  const float *q, *k, *v, *g, *beta;
  float *state, *out, *snaps;
  const int64_t *cu;        // [N + 1] token offsets
  const int64_t *state_idx;  // [N] state row of each sequence, or null for row n
  int64_t N, H, HV, K, V, n_snaps;
  bool per_channel, l2norm;
  float scale;
};

// Loads the scaled decay e[i] and (optionally normalised) key of token t for value head hv.
inline void load_token(const Args& a, int64_t t, int64_t hv, float* e, float* kk, float* ek) {
  const int64_t h = hv / (a.HV / a.H), K = a.K;
  const float* kt = a.k + (t * a.H + h) * K;
  float inv = 1.f;
  if (a.l2norm) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < K; ++i) ss += kt[i] * kt[i];
    inv = 1.f / std::sqrt(ss + 1e-6f);
  }
  if (a.per_channel) {
    const float* gt = a.g + (t * a.HV + hv) * K;
#pragma omp simd
    for (int64_t i = 0; i < K; ++i) e[i] = std::exp(gt[i]);
  } else {
    const float eh = std::exp(a.g[t * a.HV + hv]);
    for (int64_t i = 0; i < K; ++i) e[i] = eh;
  }
#pragma omp simd
  for (int64_t i = 0; i < K; ++i) {
    kk[i] = kt[i] * inv;
    ek[i] = e[i] * kk[i];
  }
}

inline void load_query(const Args& a, int64_t t, int64_t hv, float* qq) {
  const int64_t h = hv / (a.HV / a.H), K = a.K;
  const float* qt = a.q + (t * a.H + h) * K;
  float inv = a.scale;
  if (a.l2norm) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < K; ++i) ss += qt[i] * qt[i];
    inv = a.scale / std::sqrt(ss + 1e-6f);
  }
#pragma omp simd
  for (int64_t i = 0; i < K; ++i) qq[i] = qt[i] * inv;
}

constexpr int64_t kMaxVB = 64;

// VB > 0: block width known at compile time, so the row loops vectorise with their accumulators in
// registers; VB == 0: any width up to kMaxVB, known at run time.
template <int VB>
void run_task(const Args& a, int64_t n, int64_t hv, int64_t c0, int64_t vb_dyn) {
  const int64_t K = a.K, V = a.V, vb = VB > 0 ? VB : vb_dyn;
  const int64_t start = a.cu[n], end = a.cu[n + 1], len = end - start;
  thread_local std::vector<float> buf;  // reused across calls: no allocation in the decode loop
  if (buf.size() < static_cast<size_t>(7 * K)) buf.resize(7 * K);
  // The K x vb state block is updated where it lies (row stride V): a copy would cost two more passes,
  // and the block stays in L1/L2 all the same.
  const int64_t row = a.state_idx ? a.state_idx[n] : n;
  float* __restrict__ S = a.state + ((row * a.HV + hv) * K) * V + c0;
  float* e = buf.data();               // this token's decay, key, and decay * key
  float* kk = e + K;
  float* ek = kk + K;
  float* e2 = ek + K;                  // the same for the next token
  float* k2 = e2 + K;
  float* ek2 = k2 + K;
  float* __restrict__ qq = ek2 + K;    // this token's scaled query
  alignas(64) float u[kMaxVB], o[kMaxVB], kv[kMaxVB];

  auto write_snap = [&](int64_t back) {
    float* dst = a.snaps + (((n * a.n_snaps + back) * a.HV + hv) * K) * V + c0;
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < vb; ++j) dst[i * V + j] = S[i * V + j];
  };
  for (int64_t back = len; back < a.n_snaps; ++back) write_snap(back);  // steps before the sequence
  if (len == 0) return;

  load_token(a, start, hv, e, kk, ek);
  for (int64_t j = 0; j < vb; ++j) kv[j] = 0.f;
  for (int64_t i = 0; i < K; ++i) {
    const float w = ek[i];
    const float* Si = S + i * V;
#pragma omp simd
    for (int64_t j = 0; j < vb; ++j) kv[j] += w * Si[j];
  }

  for (int64_t t = start; t < end; ++t) {
    const bool has_next = t + 1 < end;
    if (has_next) load_token(a, t + 1, hv, e2, k2, ek2);
    load_query(a, t, hv, qq);
    const float b = a.beta[t * a.HV + hv];
    const float* vt = a.v + (t * a.HV + hv) * V + c0;
#pragma omp simd
    for (int64_t j = 0; j < vb; ++j) {
      u[j] = b * (vt[j] - kv[j]);
      o[j] = 0.f;
      kv[j] = 0.f;
    }
    for (int64_t i = 0; i < K; ++i) {
      const float ei = e[i], ki = kk[i], qi = qq[i], wi = has_next ? ek2[i] : 0.f;
      float* __restrict__ Si = S + i * V;
#pragma omp simd
      for (int64_t j = 0; j < vb; ++j) {
        const float s = Si[j] * ei + ki * u[j];
        Si[j] = s;
        o[j] += qi * s;
        kv[j] += wi * s;
      }
    }
    float* ot = a.out + (t * a.HV + hv) * V + c0;
    for (int64_t j = 0; j < vb; ++j) ot[j] = o[j];
    const int64_t back = end - 1 - t;
    if (back < a.n_snaps) write_snap(back);
    if (has_next) {
      std::swap(e, e2);
      std::swap(kk, k2);
      std::swap(ek, ek2);
    }
  }
}

// q, k [T, H, K]; v [T, HV, V]; g [T, HV] or [T, HV, K]; beta [T, HV]; state [N, HV, K, V] (in/out);
// cu_seqlens [N + 1] int64; state_idx [N] int64 (rows of state) or empty; out [T, HV, V];
// snaps [N, n_snaps, HV, K, V] or empty. All float tensors float32 and contiguous.
void gdr_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                 torch::Tensor state, torch::Tensor cu_seqlens, torch::Tensor state_idx, torch::Tensor out,
                 torch::Tensor snaps, double scale, bool l2norm) {
  Args a;
  a.q = q.data_ptr<float>();
  a.k = k.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.g = g.data_ptr<float>();
  a.beta = beta.data_ptr<float>();
  a.state = state.data_ptr<float>();
  a.out = out.data_ptr<float>();
  a.n_snaps = snaps.numel() ? snaps.size(1) : 0;
  a.snaps = a.n_snaps ? snaps.data_ptr<float>() : nullptr;
  a.cu = cu_seqlens.data_ptr<int64_t>();
  a.state_idx = state_idx.numel() ? state_idx.data_ptr<int64_t>() : nullptr;
  a.N = cu_seqlens.size(0) - 1;
  a.HV = state.size(1);
  a.K = state.size(2);
  a.V = state.size(3);
  a.H = q.size(1);
  a.per_channel = g.dim() == 3;
  a.l2norm = l2norm;
  a.scale = static_cast<float>(scale);

  // Column blocks of 64 (32 or 16 when V is a multiple of those only); other widths take the generic path.
  const int64_t vb = a.V % 64 == 0 ? 64 : a.V % 32 == 0 ? 32 : a.V % 16 == 0 ? 16 : kMaxVB;
  const int64_t blocks = (a.V + vb - 1) / vb, tasks = a.N * a.HV * blocks;
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t n = task / (a.HV * blocks), hv = (task / blocks) % a.HV;
      const int64_t c0 = (task % blocks) * vb, width = std::min(vb, a.V - c0);
      if (width == 64) run_task<64>(a, n, hv, c0, width);
      else if (width == 32) run_task<32>(a, n, hv, c0, width);
      else if (width == 16) run_task<16>(a, n, hv, c0, width);
      else run_task<0>(a, n, hv, c0, width);
    }
  });
}

// Short causal depthwise conv with its state. x [T, C]; weight_t [W, C] (tap-major, so the channel loop is
// contiguous); bias [C] or empty; state [S, W-1, C] (in/out, the last W-1 inputs, oldest first);
// cu_seqlens [N + 1]; state_idx [N] or empty; out [T, C]. Threads over (sequence, block of channels).
void conv_forward(torch::Tensor x, torch::Tensor weight_t, torch::Tensor bias, torch::Tensor state,
                  torch::Tensor cu_seqlens, torch::Tensor state_idx, torch::Tensor out, bool silu) {
  const int64_t C = x.size(1), W = weight_t.size(0), N = cu_seqlens.size(0) - 1;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight_t.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t* idx = state_idx.numel() ? state_idx.data_ptr<int64_t>() : nullptr;
  constexpr int64_t CB = 256;
  const int64_t blocks = (C + CB - 1) / CB;
  at::parallel_for(0, N * blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> hist((W - 1) * CB);
    alignas(64) float y[CB];
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t n = task / blocks, c0 = (task % blocks) * CB, cb = std::min(CB, C - c0);
      float* st = sp + (idx ? idx[n] : n) * (W - 1) * C + c0;
      for (int64_t w = 0; w < W - 1; ++w)
        for (int64_t c = 0; c < cb; ++c) hist[w * CB + c] = st[w * C + c];
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        const float* xt = xp + t * C + c0;
        const float* wl = wp + (W - 1) * C + c0;
#pragma omp simd
        for (int64_t c = 0; c < cb; ++c) y[c] = (bp ? bp[c0 + c] : 0.f) + wl[c] * xt[c];
        for (int64_t w = 0; w < W - 1; ++w) {
          const float* ww = wp + w * C + c0;
          const float* hw = hist.data() + w * CB;
#pragma omp simd
          for (int64_t c = 0; c < cb; ++c) y[c] += ww[c] * hw[c];
        }
        for (int64_t w = 0; w + 1 < W - 1; ++w)  // slide the window by one input
          std::copy(hist.begin() + (w + 1) * CB, hist.begin() + (w + 1) * CB + cb, hist.begin() + w * CB);
        if (W > 1) std::copy(xt, xt + cb, hist.begin() + (W - 2) * CB);
        float* ot = op + t * C + c0;
#pragma omp simd
        for (int64_t c = 0; c < cb; ++c) ot[c] = silu ? y[c] / (1.f + std::exp(-y[c])) : y[c];
      }
      for (int64_t w = 0; w < W - 1; ++w)
        for (int64_t c = 0; c < cb; ++c) st[w * C + c] = hist[w * CB + c];
    }
  });
}

// y [M, N] = x [M, K] (float32) @ w [N, K]^T (float16), accumulated in float32. For decode (M = a few
// sequences) the weights stream from memory once, converted to float32 in registers: the activations are
// never rounded to float16, so the result equals a float32 matmul with the float16 weights.
void linear_f16(torch::Tensor x, torch::Tensor w, torch::Tensor y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  constexpr int64_t MB = 8;  // activation rows per pass over a weight row
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const uint16_t* wr = wp + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = std::min(MB, M - m0);
        float sums[MB] = {0.f};
        int64_t k = 0;
#if defined(__AVX512F__)
        __m512 acc[MB];
        for (int64_t m = 0; m < mb; ++m) acc[m] = _mm512_setzero_ps();
        for (; k + 16 <= K; k += 16) {
          const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k)));
          for (int64_t m = 0; m < mb; ++m)
            acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + (m0 + m) * K + k), acc[m]);
        }
        for (int64_t m = 0; m < mb; ++m) sums[m] = _mm512_reduce_add_ps(acc[m]);
#endif
        for (; k < K; ++k) {
          const float wk = static_cast<float>(c10::Half(wr[k], c10::Half::from_bits()));
          for (int64_t m = 0; m < mb; ++m) sums[m] += wk * xp[(m0 + m) * K + k];
        }
        for (int64_t m = 0; m < mb; ++m) yp[(m0 + m) * N + n] = sums[m];
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gdr_forward", &gdr_forward, "fused gated delta rule (CPU, float32)");
  m.def("conv_forward", &conv_forward, "short causal depthwise conv with state (CPU, float32)");
  m.def("linear_f16", &linear_f16, "float32 activations times float16 weights, float32 accumulation (CPU)");
}
