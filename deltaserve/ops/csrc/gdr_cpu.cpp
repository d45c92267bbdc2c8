// Fused gated delta rule for CPUs: one pass over the tokens with the state block kept in L1.
//
// The delta rule is separable over the value columns of the state: column j of S evolves from
// k, q, g, beta and v[j] alone. So every (sequence, value head, block of VB columns) is an
// independent task whose K x VB state block stays in L1 for the whole sequence; run_task shows how
// each token is one sweep over that block.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// Tokens go through the kernel in windows of kWindow. For each window the per-token inputs are packed
// head-major (normalised, scaled, exponentiated once per query/key head instead of once per task), so
// every task reads them as sequential streams: in the caller's [T, H, K] layout a head's rows lie H * K
// floats apart, no hardware prefetcher follows that, and each token would wait on memory. A window's
// packed inputs (a few MB) stay in cache and the buffers are reused, so no fresh pages are touched.
constexpr int64_t kWindow = 256;
constexpr int64_t kMaxVB = 64;
constexpr int64_t kCopyMinTokens = 4;
constexpr int64_t kPrefetch = 8;  // tokens ahead for the strided v and o rows
// Below this, a row's deferred decay is applied to the stored row: it keeps k[i] / c[i] and the stored
// values far from float32 overflow (3e38) whatever the gates.
constexpr float kTinyScale = 1e-20f;

struct Args {
  const float *q, *k, *g, *beta_in, *v;  // as given: [T, H, K], [T, H, K], [T, HV(, K)], [T, HV], [T, HV, V]
  int64_t qs, ks, vs;                     // token strides of q, k, v (their rows may be slices of wider ones)
  float *state, *out, *snaps;
  const int64_t *cu;         // [N + 1] token offsets
  const int64_t *state_idx;  // [N] state row of each sequence, or null for row n
  int64_t N, T, H, HV, K, V, n_snaps;
  bool per_channel, l2norm;
  float scale;
  // the packed window of tokens [w0, w1): token t at row t - w0 of W
  int64_t W;
  float *qn, *kn;  // [H, W, K] scaled (and normalised) queries, (normalised) keys
  float *e;        // [HV, W] or [HV, W, K] decay exp(g)
  float *beta;     // [HV, W]
};

inline float inv_norm(const float* x, int64_t K) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < K; ++i) ss += x[i] * x[i];
  return 1.f / std::sqrt(ss + 1e-6f);
}

// Packs item x of the window starting at token w0: the query and key rows of token w0 + x / H, head x % H.
inline void pack_qk(const Args& a, int64_t w0, int64_t x) {
  const int64_t K = a.K, r = x / a.H, h = x % a.H, t = w0 + r;
  const float *qt = a.q + t * a.qs + h * K, *kt = a.k + t * a.ks + h * K;
  const float sq = a.l2norm ? a.scale * inv_norm(qt, K) : a.scale, sk = a.l2norm ? inv_norm(kt, K) : 1.f;
  float *qo = a.qn + (h * a.W + r) * K, *ko = a.kn + (h * a.W + r) * K;
#pragma omp simd
  for (int64_t i = 0; i < K; ++i) {
    qo[i] = qt[i] * sq;
    ko[i] = kt[i] * sk;
  }
}

// Packs the decay and beta of token w0 + x / HV, value head x % HV.
inline void pack_gate(const Args& a, int64_t w0, int64_t x) {
  const int64_t K = a.K, r = x / a.HV, hv = x % a.HV, t = w0 + r;
  a.beta[hv * a.W + r] = a.beta_in[t * a.HV + hv];
  if (a.per_channel) {
    const float* gt = a.g + (t * a.HV + hv) * K;
    float* et = a.e + (hv * a.W + r) * K;
#pragma omp simd
    for (int64_t i = 0; i < K; ++i) et[i] = std::exp(gt[i]);
  } else {
    a.e[hv * a.W + r] = std::exp(a.g[t * a.HV + hv]);
  }
}

// One task: the K x vb state block at columns c0.. of value head hv of sequence n, over the sequence's
// tokens in the current window. VB > 0: block width known at compile time, so the row loops vectorise
// with their accumulators in registers; VB == 0: any width up to kMaxVB, known at run time. PC:
// per-channel decay (one per row) rather than one per head.
//
// Per token, one sweep over the K rows of the block does three things at once, so the state is read
// and written once per token:
//   S[i] = e[i] * S[i] + k[i] * u          (decay + delta update of this token)
//   o   += q[i] * S[i]                      (read-out of this token)
//   kv  += e'[i] * k'[i] * S[i]             (S'^T k' of the NEXT token, needed for its u)
// The decay is deferred: row i of the true state is c[i] * S[i] (S the stored row, c[i] including this
// token's decay), so the sweep is three FMAs per element instead of a multiply more:
//   S[i] += (k[i] / c[i]) * u,   o += (q[i] c[i]) * S[i],   kv += (e'[i] k'[i] c[i]) * S[i].
// The last token of a task applies the decay to the stored rows (c = 1 after it), so the state it
// writes back is the true one.
template <int VB, bool PC>
void run_task(const Args& a, int64_t w0, int64_t w1, int64_t n, int64_t hv, int64_t c0, int64_t vb_dyn) {
  const int64_t K = a.K, V = a.V, vb = VB > 0 ? VB : vb_dyn;
  const int64_t end = a.cu[n + 1], t0 = std::max(a.cu[n], w0), t1 = std::min(end, w1);
  if (t0 >= t1) return;
  const int64_t es = PC ? K : 1;  // the decay of token t: e[(t - w0) * es], per row i: + i
  const float* const qn = a.qn + (hv / (a.HV / a.H) * a.W - w0) * K;  // token t at qn + t * K
  const float* const kn = a.kn + (hv / (a.HV / a.H) * a.W - w0) * K;
  const float* const e = a.e + (hv * a.W - w0) * es;
  const float* const bt = a.beta + hv * a.W - w0;
  thread_local std::vector<float> buf;  // reused across calls: no allocation in the decode loop
  if (buf.size() < static_cast<size_t>(4 * K)) buf.resize(4 * K);
  float* __restrict__ c = buf.data();  // deferred decay of each stored row (unless PC, c[0] holds it for all)
  float* __restrict__ cu = c + K;      // per-row coefficients of the sweep: update, read-out, next key
  float* __restrict__ cq = cu + K;
  float* __restrict__ cw = cq + K;
  alignas(64) float u[kMaxVB], o[kMaxVB], kv[kMaxVB];
  std::fill(c, c + K, 1.f);

  // Over many tokens the K x vb block is worked on in a contiguous copy: in place, its rows are V floats
  // apart, which maps them onto a fraction of L1's sets and the block falls out to L2 (2x slower). One
  // decode step is cheaper in place than with the two extra passes of a copy.
  const int64_t row = a.state_idx ? a.state_idx[n] : n;
  float* const home = a.state + ((row * a.HV + hv) * K) * V + c0;
  thread_local std::vector<float> local;  // 16 floats of slack to start it on a cache line
  const bool copy = t1 - t0 >= kCopyMinTokens;
  if (copy && local.size() < static_cast<size_t>(K * vb + 16)) local.resize(K * vb + 16);
  const int64_t ld = copy ? vb : V;  // row stride of S
  float* __restrict__ S = copy ? local.data() + (16 - reinterpret_cast<uintptr_t>(local.data()) / 4 % 16) % 16 : home;
  if (copy)
    for (int64_t i = 0; i < K; ++i)
#pragma omp simd
      for (int64_t j = 0; j < vb; ++j) S[i * ld + j] = home[i * V + j];

  for (int64_t j = 0; j < vb; ++j) kv[j] = 0.f;
  for (int64_t i = 0; i < K; ++i) {
    const float w = e[t0 * es + (PC ? i : 0)] * kn[t0 * K + i];
    const float* Si = S + i * ld;
#pragma omp simd
    for (int64_t j = 0; j < vb; ++j) kv[j] += w * Si[j];
  }

  for (int64_t t = t0; t < t1; ++t) {
    if (t + kPrefetch < t1) {
      const char* vp = reinterpret_cast<const char*>(a.v + (t + kPrefetch) * a.vs + hv * V + c0);
      char* op = reinterpret_cast<char*>(a.out + ((t + kPrefetch) * a.HV + hv) * V + c0);
      for (int64_t x = 0; x < vb * 4; x += 64) {
        _mm_prefetch(vp + x, _MM_HINT_T0);
        _mm_prefetch(op + x, _MM_HINT_ET0);
      }
    }
    const float b = bt[t];
    const float* vt = a.v + t * a.vs + hv * V + c0;
#pragma omp simd
    for (int64_t j = 0; j < vb; ++j) {
      u[j] = b * (vt[j] - kv[j]);
      o[j] = 0.f;
      kv[j] = 0.f;
    }
    const float *kt = kn + t * K, *qt = qn + t * K, *et = e + t * es;
    if (t + 1 == t1) {  // the decay applied to the stored rows: S[i] = c[i] e[i] S[i] + k[i] u
      for (int64_t i = 0; i < K; ++i) {
        const float mi = c[PC ? i : 0] * et[PC ? i : 0], ki = kt[i], qi = qt[i];
        float* __restrict__ Si = S + i * ld;
#pragma omp simd
        for (int64_t j = 0; j < vb; ++j) {
          const float s = Si[j] * mi + ki * u[j];
          Si[j] = s;
          o[j] += qi * s;
        }
      }
      std::fill(c, c + K, 1.f);
    } else {
      const float *kt2 = kt + K, *et2 = et + es;
      if (PC) {
        bool tiny = false;
#pragma omp simd reduction(|| : tiny)
        for (int64_t i = 0; i < K; ++i) {
          c[i] *= et[i];
          tiny = tiny || c[i] < kTinyScale;
        }
        if (tiny)
          for (int64_t i = 0; i < K; ++i)
            if (c[i] < kTinyScale) {
              for (int64_t j = 0; j < vb; ++j) S[i * ld + j] *= c[i];
              c[i] = 1.f;
            }
#pragma omp simd
        for (int64_t i = 0; i < K; ++i) {
          cu[i] = kt[i] / c[i];
          cq[i] = qt[i] * c[i];
          cw[i] = et2[i] * kt2[i] * c[i];
        }
      } else {  // one decay for all rows: c[0] stands for every c[i]
        c[0] *= et[0];
        if (c[0] < kTinyScale) {
          for (int64_t i = 0; i < K; ++i)
            for (int64_t j = 0; j < vb; ++j) S[i * ld + j] *= c[0];
          c[0] = 1.f;
        }
        const float ch = c[0], rc = 1.f / ch, wc = et2[0] * ch;
#pragma omp simd
        for (int64_t i = 0; i < K; ++i) {
          cu[i] = kt[i] * rc;
          cq[i] = qt[i] * ch;
          cw[i] = kt2[i] * wc;
        }
      }
      for (int64_t i = 0; i < K; ++i) {
        const float ui = cu[i], qi = cq[i], wi = cw[i];
        float* __restrict__ Si = S + i * ld;
#pragma omp simd
        for (int64_t j = 0; j < vb; ++j) {
          const float s = Si[j] + ui * u[j];
          Si[j] = s;
          o[j] += qi * s;
          kv[j] += wi * s;
        }
      }
    }
    float* ot = a.out + (t * a.HV + hv) * V + c0;
    for (int64_t j = 0; j < vb; ++j) ot[j] = o[j];
    const int64_t back = end - 1 - t;
    if (back < a.n_snaps) {
      float* dst = a.snaps + (((n * a.n_snaps + back) * a.HV + hv) * K) * V + c0;
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < vb; ++j) dst[i * V + j] = c[PC ? i : 0] * S[i * ld + j];
    }
  }
  if (copy)
    for (int64_t i = 0; i < K; ++i)
#pragma omp simd
      for (int64_t j = 0; j < vb; ++j) home[i * V + j] = S[i * ld + j];
}

template <bool PC>
void run_block(const Args& a, int64_t w0, int64_t w1, int64_t n, int64_t hv, int64_t c0, int64_t width) {
  if (width == 64) run_task<64, PC>(a, w0, w1, n, hv, c0, width);
  else if (width == 32) run_task<32, PC>(a, w0, w1, n, hv, c0, width);
  else if (width == 16) run_task<16, PC>(a, w0, w1, n, hv, c0, width);
  else run_task<0, PC>(a, w0, w1, n, hv, c0, width);
}

// q, k [..., T, H, K]; v [..., T, HV, V]; g [..., HV] or [..., HV, K]; beta [..., HV]; out like v: the
// leading dims are the tokens of all sequences (B * T, packed). state [N, HV, K, V] (in/out); cu_seqlens
// [N + 1] int64; state_idx [N] int64 (rows of state) or empty; snaps [N, n_snaps, HV, K, V] or empty.
// All float tensors float32 and contiguous, except that the tokens of q, k and v may lie any stride
// apart (slices of a projection's output), with a whole batch one stride per token.
void gdr_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                 torch::Tensor state, torch::Tensor cu_seqlens, torch::Tensor state_idx, torch::Tensor out,
                 torch::Tensor snaps, double scale, bool l2norm) {
  Args a;
  a.q = q.data_ptr<float>();
  a.k = k.data_ptr<float>();
  a.g = g.data_ptr<float>();
  a.beta_in = beta.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.qs = q.stride(-3);
  a.ks = k.stride(-3);
  a.vs = v.stride(-3);
  a.state = state.data_ptr<float>();
  a.out = out.data_ptr<float>();
  a.n_snaps = snaps.numel() ? snaps.size(1) : 0;
  a.snaps = a.n_snaps ? snaps.data_ptr<float>() : nullptr;
  a.cu = cu_seqlens.data_ptr<int64_t>();
  a.state_idx = state_idx.numel() ? state_idx.data_ptr<int64_t>() : nullptr;
  a.N = cu_seqlens.size(0) - 1;
  a.H = q.size(-2);
  a.HV = state.size(1);
  a.K = state.size(2);
  a.V = state.size(3);
  a.T = a.H * a.K ? q.numel() / (a.H * a.K) : 0;
  a.per_channel = g.dim() == out.dim();  // g [..., HV, K] like out [..., HV, V], not [..., HV]
  a.l2norm = l2norm;
  a.scale = static_cast<float>(scale);
  const int64_t K = a.K, V = a.V;
  a.W = std::min(a.T, kWindow);
  // the packed window, in a per-thread scratch buffer that is reused (a decode step allocates nothing)
  thread_local std::vector<float> packed;
  const int64_t nq = a.H * a.W * K, ne = a.HV * a.W * (a.per_channel ? K : 1);
  if (packed.size() < static_cast<size_t>(2 * nq + ne + a.HV * a.W)) packed.resize(2 * nq + ne + a.HV * a.W);
  a.qn = packed.data();
  a.kn = a.qn + nq;
  a.e = a.kn + nq;
  a.beta = a.e + ne;

  // Snapshots from before a sequence's first token (it has fewer tokens than snapshots): its initial state.
  for (int64_t n = 0; n < a.N && a.n_snaps; ++n) {
    const int64_t len = a.cu[n + 1] - a.cu[n], row = a.state_idx ? a.state_idx[n] : n;
    for (int64_t back = len; back < a.n_snaps; ++back)
      std::copy(a.state + row * a.HV * K * V, a.state + (row + 1) * a.HV * K * V,
                a.snaps + (n * a.n_snaps + back) * a.HV * K * V);
  }

  // Column blocks of 64 (32 or 16 when V is a multiple of those only); other widths take the generic path.
  const int64_t vb = V % 64 == 0 ? 64 : V % 32 == 0 ? 32 : V % 16 == 0 ? 16 : kMaxVB;
  const int64_t blocks = (V + vb - 1) / vb;
  // One parallel region for all windows: per window, pack (threads over rows), then the tasks (threads
  // over sequence, value head, column block); the barriers of the omp for loops order the phases.
#pragma omp parallel num_threads(at::get_num_threads())
  for (int64_t w0 = 0; w0 < a.T; w0 += kWindow) {
    const int64_t w1 = std::min(a.T, w0 + kWindow);
#pragma omp for schedule(static) nowait
    for (int64_t x = 0; x < (w1 - w0) * a.H; ++x) pack_qk(a, w0, x);
#pragma omp for schedule(static)
    for (int64_t x = 0; x < (w1 - w0) * a.HV; ++x) pack_gate(a, w0, x);
    // the sequences with tokens in this window: n_lo .. n_hi - 1
    const int64_t n_lo = std::upper_bound(a.cu, a.cu + a.N + 1, w0) - a.cu - 1;
    const int64_t n_hi = std::lower_bound(a.cu, a.cu + a.N + 1, w1) - a.cu;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < (n_hi - n_lo) * a.HV * blocks; ++task) {
      const int64_t n = n_lo + task / (a.HV * blocks), hv = (task / blocks) % a.HV;
      const int64_t c0 = (task % blocks) * vb, width = std::min(vb, V - c0);
      if (a.per_channel) run_block<true>(a, w0, w1, n, hv, c0, width);
      else run_block<false>(a, w0, w1, n, hv, c0, width);
    }
  }
}

// The conv for exactly one token of each of N sequences, kernel width 4: a few microseconds of work, less than waking
// a second thread or laying the weight out tap-major would cost.
void conv_step4(const float* xp, int64_t xs, const float* wp, const float* bp, float* sp, const int64_t* cu,
                const int64_t* idx, float* op, int64_t N, int64_t C, bool silu) {
  constexpr int64_t CB = 64;
  alignas(64) float y[CB];
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = cu[n];
    float* __restrict__ st = sp + (idx ? idx[n] : n) * 3 * C;
    for (int64_t c0 = 0; c0 < C; c0 += CB) {
      const int64_t cb = std::min(CB, C - c0);
      const float* __restrict__ w = wp + 4 * c0;
      float *__restrict__ s0 = st + c0, *__restrict__ s1 = s0 + C, *__restrict__ s2 = s1 + C;
      const float* __restrict__ xt = xp + t * xs + c0;
#pragma omp simd
      for (int64_t c = 0; c < cb; ++c) {
        y[c] = w[4 * c] * s0[c] + w[4 * c + 1] * s1[c] + w[4 * c + 2] * s2[c] + w[4 * c + 3] * xt[c];
        s0[c] = s1[c];
        s1[c] = s2[c];
        s2[c] = xt[c];
      }
      if (bp)
        for (int64_t c = 0; c < cb; ++c) y[c] += bp[c0 + c];
      float* __restrict__ ot = op + t * C + c0;
      if (silu) {
#pragma omp simd
        for (int64_t c = 0; c < cb; ++c) ot[c] = y[c] / (1.f + std::exp(-y[c]));
      } else {
        for (int64_t c = 0; c < cb; ++c) ot[c] = y[c];
      }
    }
  }
}

// Short causal depthwise conv with its state. x [T, C] (rows any stride apart); weight [C, W]; bias [C] or empty; state [S, W-1, C]
// (in/out, the last W-1 inputs, oldest first); cu_seqlens [N + 1]; state_idx [N] or empty; out [T, C].
// Threads over (sequence, block of channels); each task first lays its block of the weight out tap-major,
// so the channel loops are contiguous (a transposed copy in torch cost more than a decode step's conv).
void conv_forward(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, torch::Tensor state,
                  torch::Tensor cu_seqlens, torch::Tensor state_idx, torch::Tensor out, bool silu) {
  const int64_t C = x.size(1), W = weight.size(1), N = cu_seqlens.size(0) - 1;
  const float* xp = x.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const float* wsrc = weight.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t* idx = state_idx.numel() ? state_idx.data_ptr<int64_t>() : nullptr;
  bool one_each = W == 4;
  for (int64_t n = 0; n < N && one_each; ++n) one_each = cu[n + 1] - cu[n] == 1;
  if (one_each) {  // one token per sequence (decode): no blocks, no threads
    conv_step4(xp, xs, wsrc, bp, sp, cu, idx, op, N, C, silu);
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
        float* ot = op + t * C + c0;
#pragma omp simd
        for (int64_t c = 0; c < cb; ++c) ot[c] = silu ? y[c] / (1.f + std::exp(-y[c])) : y[c];
      }
      for (int64_t w = 0; w < W - 1; ++w)
        for (int64_t c = 0; c < cb; ++c) st[w * C + c] = hist[w * CB + c];
    }
  });
}

// out = x / sqrt(mean(x^2) + eps) * w over rows of D = w.numel(); x, out float32 contiguous [..., D]. One call
// instead of the six small ops of the torch expression (a decode step runs ~80 norms). With a gate (float32
// [tokens, rows per token, D], D contiguous, tokens any stride apart: a slice of a projection) the rows are
// also multiplied by act(gate): act 1 silu, 2 sigmoid (the output gates of GDN and KDA layers).
void rms_norm(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor out, torch::Tensor gate, int64_t act) {
  const int64_t D = w.numel(), M = D ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* gp = gate.numel() ? gate.data_ptr<float>() : nullptr;
  const int64_t per_token = gp ? gate.size(1) : 1, gs = gp ? gate.stride(0) : 0, gr = gp ? gate.stride(1) : 0;
  at::parallel_for(0, M, 64, [&](int64_t lo, int64_t hi) {
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
  });
}

// out [M, I] = silu(x[:, :I]) * x[:, I:] (SwiGLU); x [M, 2I] float32, rows any stride apart.
void silu_mul(torch::Tensor x, torch::Tensor out) {
  const int64_t M = out.size(0), I = out.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(I, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      const float *g = xp + m * xs, *u = g + I;
      float* o = op + m * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
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

// One decode step of gated full attention (Qwen3.5 / Qwen3-Next) for M sequences of one new token each:
// per head RMSNorm of q and k, partial rope, the new key / value written into the cache, attention over the
// cache row up to and including the new token, and the output gate sigmoid(g). One call instead of ~40 small
// ops. proj [M, ...] (rows any stride apart): [q (nh*hd) | g (nh*hd) | k (nkv*hd) | v (nkv*hd)]; cos, sin
// [M, rot]; caches [S, L, nkv, hd]; slots, pos [M] int64 (cache row, position of the new token); out [M, nh*hd].
// Threads over (sequence, kv head): each reads its keys and values once for the group of query heads.
void attention_step(torch::Tensor proj, torch::Tensor q_norm, torch::Tensor k_norm, double eps, torch::Tensor cos,
                    torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                    torch::Tensor pos, double scale, torch::Tensor out) {
  const int64_t M = out.size(0), hd = q_norm.numel(), nh = out.size(1) / hd, nkv = k_cache.size(2);
  const int64_t L = k_cache.size(1), rot = cos.size(1), group = nh / nkv, ps = proj.stride(0);
  const float* pp = proj.data_ptr<float>();
  const float *qw = q_norm.data_ptr<float>(), *kw = k_norm.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t *slot = slots.data_ptr<int64_t>(), *at = pos.data_ptr<int64_t>();
  at::parallel_for(0, M * nkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> q(group * hd), scores;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t m = task / nkv, j = task % nkv, n = at[m];
      const float* row = pp + m * ps;
      const float *c = cp + m * rot, *s = sp + m * rot;
      float* krow = kc + ((slot[m] * L + n) * nkv + j) * hd;  // the new key and value go into the cache
      float* vrow = vc + ((slot[m] * L + n) * nkv + j) * hd;
      std::copy(row + (2 * nh + j) * hd, row + (2 * nh + j + 1) * hd, krow);
      std::copy(row + (2 * nh + nkv + j) * hd, row + (2 * nh + nkv + j + 1) * hd, vrow);
      norm_rope(krow, kw, static_cast<float>(eps), c, s, hd, rot);
      for (int64_t h = 0; h < group; ++h) {
        std::copy(row + (j * group + h) * hd, row + (j * group + h + 1) * hd, q.data() + h * hd);
        norm_rope(q.data() + h * hd, qw, static_cast<float>(eps), c, s, hd, rot);
      }
      const float* keys = kc + (slot[m] * L * nkv + j) * hd;  // key t at keys + t * nkv * hd
      const float* vals = vc + (slot[m] * L * nkv + j) * hd;
      scores.assign(group * (n + 1), 0.f);
      for (int64_t t = 0; t <= n; ++t) {
        const float* kt = keys + t * nkv * hd;
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = q.data() + h * hd;
          float d = 0.f;
#pragma omp simd reduction(+ : d)
          for (int64_t i = 0; i < hd; ++i) d += qh[i] * kt[i];
          scores[h * (n + 1) + t] = d * static_cast<float>(scale);
        }
      }
      for (int64_t h = 0; h < group; ++h) {  // softmax over the visible keys
        float* sc = scores.data() + h * (n + 1);
        const float mx = *std::max_element(sc, sc + n + 1);
        float sum = 0.f;
        for (int64_t t = 0; t <= n; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
        for (int64_t t = 0; t <= n; ++t) sc[t] /= sum;
      }
      float* o = op + m * nh * hd + j * group * hd;
      std::fill(o, o + group * hd, 0.f);
      for (int64_t t = 0; t <= n; ++t) {
        const float* vt = vals + t * nkv * hd;
        for (int64_t h = 0; h < group; ++h) {
          const float p = scores[h * (n + 1) + t];
          float* oh = o + h * hd;
#pragma omp simd
          for (int64_t i = 0; i < hd; ++i) oh[i] += p * vt[i];
        }
      }
      for (int64_t h = 0; h < group; ++h) {  // output gate
        const float* g = row + (nh + j * group + h) * hd;
        float* oh = o + h * hd;
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) oh[i] *= 1.f / (1.f + std::exp(-g[i]));
      }
    }
  });
}

// The GEMVs below prefetch the weight stream this many bytes ahead: the hardware prefetchers alone
// reach 15-19 GB/s here, with this 24-26 GB/s (streaming 0.8B weights, 2 threads).
constexpr int64_t kGemvPrefetch = 4096;

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
        __m512 acc[MB], acc2[MB];
        for (int64_t m = 0; m < mb; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
        for (; k + 32 <= K; k += 32) {
          _mm_prefetch(reinterpret_cast<const char*>(wr + k) + kGemvPrefetch, _MM_HINT_T0);
          const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k)));
          const __m512 wv2 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k + 16)));
          for (int64_t m = 0; m < mb; ++m) {
            acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + (m0 + m) * K + k), acc[m]);
            acc2[m] = _mm512_fmadd_ps(wv2, _mm512_loadu_ps(xp + (m0 + m) * K + k + 16), acc2[m]);
          }
        }
        for (; k + 16 <= K; k += 16) {
          const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k)));
          for (int64_t m = 0; m < mb; ++m)
            acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + (m0 + m) * K + k), acc[m]);
        }
        for (int64_t m = 0; m < mb; ++m) sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m]));
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

// y [M, N] = x [M, K] (float32) @ W^T, W [N, K] in Q8_0 form: W[n, k] = d[n, k / 32] * q[n, k] with q int8
// and d float16 (one scale per 32 weights of a row, llama.cpp's Q8_0 block). For decode: the weights
// stream from memory at 1.0625 bytes each and are widened in registers; the activations stay float32, so
// the result equals a float32 matmul with the dequantised weights (up to summation order).
void linear_q8(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor y) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), B = K / 32;
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t MB = 8;  // activation rows per pass over a weight row
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const int8_t* qr = qp + n * K;
      const at::Half* dr = dp + n * B;
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = std::min(MB, M - m0);
        float sums[MB] = {0.f};
#if defined(__AVX512F__)
        __m512 acc[MB], acc2[MB];
        for (int64_t m = 0; m < mb; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
        for (int64_t b = 0; b < B; ++b) {
          const int64_t k = b * 32;
          _mm_prefetch(reinterpret_cast<const char*>(qr + k) + kGemvPrefetch, _MM_HINT_T0);
          const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k))));
          const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k + 16))));
          const __m512 db = _mm512_set1_ps(static_cast<float>(dr[b]));
          for (int64_t m = 0; m < mb; ++m) {
            const float* xr = xp + (m0 + m) * K + k;
            const __m512 p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xr)));
            if (b & 1) acc2[m] = _mm512_fmadd_ps(p, db, acc2[m]);
            else acc[m] = _mm512_fmadd_ps(p, db, acc[m]);
          }
        }
        for (int64_t m = 0; m < mb; ++m) sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m]));
#else
        for (int64_t b = 0; b < B; ++b) {
          const float db = static_cast<float>(dr[b]);
          for (int64_t m = 0; m < mb; ++m) {
            float p = 0.f;
            for (int64_t j = 0; j < 32; ++j) p += static_cast<float>(qr[b * 32 + j]) * xp[(m0 + m) * K + b * 32 + j];
            sums[m] += db * p;
          }
        }
#endif
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
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, optionally times silu / sigmoid of a gate (CPU, float32)");
  m.def("attention_step", &attention_step, "one decode step of gated attention over a KV cache (CPU, float32)");
  m.def("silu_mul", &silu_mul, "silu(x[:, :I]) * x[:, I:] (CPU, float32)");
  m.def("linear_q8", &linear_q8, "float32 activations times Q8_0 weights (int8, float16 scale per 32), float32 accumulation (CPU)");
}
