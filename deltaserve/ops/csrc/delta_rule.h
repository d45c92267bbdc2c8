// Fused gated delta rule for CPUs: one pass over the tokens with the state block kept in L1.
//
// The delta rule is separable over the value columns of the state: column j of S evolves from
// k, q, g, beta and v[j] alone. So every (sequence, value head, block of VB columns) is an
// independent task whose K x VB state block stays in L1 for the whole sequence; run_task shows how
// each token is one sweep over that block.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace deltaserve {

// Tokens go through the kernel in windows of kWindow. For each window the per-token inputs are packed
// head-major (normalised, scaled, exponentiated once per query/key head instead of once per task), so
// every task reads them as sequential streams: in the caller's [T, H, K] layout a head's rows lie H * K
// floats apart, no hardware prefetcher follows that, and each token would wait on memory. A window's
// packed inputs (a few MB) stay in cache and the buffers are reused, so no fresh pages are touched.
constexpr int64_t kWindow = 256;
constexpr int64_t kMaxVB = 64;
constexpr int64_t kCopyMinTokens = 4;
// A sequence with at most this many tokens in a window (a speculative verify pass, a short chunk) goes through them
// one at a time, each exactly as a decode step computes it: a verify pass then gives a decode step's bits, so greedy
// speculative decoding keeps plain decoding's tokens even where two logits nearly tie (the deferred decay below
// rounds otherwise). Each token costs a sweep more than in the deferred sweep: nothing at these lengths.
constexpr int64_t kStepTokens = 8;
constexpr int64_t kPrefetch = 8;  // tokens ahead for the strided v rows
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

// A token's vb outputs o (64-byte aligned) into its row of out. Over many tokens (stream) they bypass the cache: the
// rows lie HV V floats apart, so a task's rows fall into the few L1 sets of one offset, where they pushed the state
// block out, and each was first read from memory to be overwritten (T = 2048, 16 heads of 128 x 128: 21 -> 17 ms).
// A decode step's rows stay cached for the norm that reads them next.
inline void store_out(float* __restrict__ out, const float* __restrict__ o, int64_t vb, bool stream) {
#if defined(__AVX512F__)
  if (stream && vb % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0) {
    for (int64_t j = 0; j < vb; j += 16) _mm512_stream_ps(out + j, _mm512_load_ps(o + j));
    return;
  }
#elif defined(__AVX__)
  if (stream && vb % 8 == 0 && reinterpret_cast<uintptr_t>(out) % 32 == 0) {
    for (int64_t j = 0; j < vb; j += 8) _mm256_stream_ps(out + j, _mm256_load_ps(o + j));
    return;
  }
#endif
  for (int64_t j = 0; j < vb; ++j) out[j] = o[j];
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
//
// 512 bits wide where the CPU has AVX-512: GCC vectorises loops 256 wide for those targets unless told (the delta
// rule at T = 2048, 16 heads of 128 x 128: 21 -> 17 ms). The sweep's sums run over rows, one per column, so the
// width keeps their bits; the per-channel path's division (a reciprocal and a Newton step under -ffast-math) moves
// by an ulp.
template <int VB, bool PC>
__attribute__((target("prefer-vector-width=512")))
void run_task(const Args& a, int64_t w0, int64_t t0, int64_t t1, int64_t n, int64_t hv, int64_t c0, int64_t vb_dyn) {
  // tokens t0 .. t1 - 1 of sequence n, in the packed window that starts at token w0
  const int64_t K = a.K, V = a.V, vb = VB > 0 ? VB : vb_dyn;
  const int64_t end = a.cu[n + 1];
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

  // two sets of sums (even and odd rows): one chain of dependent FMAs per element would wait on latency
  alignas(64) float kv2[kMaxVB];
  for (int64_t j = 0; j < vb; ++j) kv[j] = kv2[j] = 0.f;
  int64_t i0 = 0;
  for (; i0 + 1 < K; i0 += 2) {
    const float w = e[t0 * es + (PC ? i0 : 0)] * kn[t0 * K + i0];
    const float w2 = e[t0 * es + (PC ? i0 + 1 : 0)] * kn[t0 * K + i0 + 1];
    const float *Si = S + i0 * ld, *Si2 = Si + ld;
#pragma omp simd
    for (int64_t j = 0; j < vb; ++j) {
      kv[j] += w * Si[j];
      kv2[j] += w2 * Si2[j];
    }
  }
  for (; i0 < K; ++i0) {
    const float w = e[t0 * es + (PC ? i0 : 0)] * kn[t0 * K + i0];
#pragma omp simd
    for (int64_t j = 0; j < vb; ++j) kv[j] += w * S[i0 * ld + j];
  }
#pragma omp simd
  for (int64_t j = 0; j < vb; ++j) kv[j] += kv2[j];

  for (int64_t t = t0; t < t1; ++t) {
    if (t + kPrefetch < t1) {
      const char* vp = reinterpret_cast<const char*>(a.v + (t + kPrefetch) * a.vs + hv * V + c0);
      for (int64_t x = 0; x < vb * 4; x += 64) _mm_prefetch(vp + x, _MM_HINT_T0);
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
      // Bottom row up: the rows the previous sweep read last are the ones still in L1 (in place, a
      // block's rows map onto a fraction of L1's sets and its first rows are evicted by its last).
      for (int64_t i = K - 1; i >= 0; --i) {
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
    store_out(a.out + (t * a.HV + hv) * V + c0, o, vb, copy);
    const int64_t back = end - 1 - t;
    if (back < a.n_snaps) {
      float* dst = a.snaps + (((n * a.n_snaps + back) * a.HV + hv) * K) * V + c0;
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < vb; ++j) dst[i * V + j] = c[PC ? i : 0] * S[i * ld + j];
    }
  }
  if (copy) {
    _mm_sfence();  // the streamed outputs ordered before whatever reads them after this task (another thread)
    for (int64_t i = 0; i < K; ++i)
#pragma omp simd
      for (int64_t j = 0; j < vb; ++j) home[i * V + j] = S[i * ld + j];
  }
}

template <bool PC>
void run_span(const Args& a, int64_t w0, int64_t t0, int64_t t1, int64_t n, int64_t hv, int64_t c0, int64_t width) {
  if (width == 64) run_task<64, PC>(a, w0, t0, t1, n, hv, c0, width);
  else if (width == 32) run_task<32, PC>(a, w0, t0, t1, n, hv, c0, width);
  else if (width == 16) run_task<16, PC>(a, w0, t0, t1, n, hv, c0, width);
  else run_task<0, PC>(a, w0, t0, t1, n, hv, c0, width);
}

// Sequence n's tokens in the window [w0, w1): a few one at a time (see kStepTokens), more in one sweep.
template <bool PC>
void run_block(const Args& a, int64_t w0, int64_t w1, int64_t n, int64_t hv, int64_t c0, int64_t width) {
  const int64_t t0 = std::max(a.cu[n], w0), t1 = std::min(a.cu[n + 1], w1);
  if (t1 - t0 <= kStepTokens)
    for (int64_t t = t0; t < t1; ++t) run_span<PC>(a, w0, t, t + 1, n, hv, c0, width);
  else
    run_span<PC>(a, w0, t0, t1, n, hv, c0, width);
}

// x [B, T, heads, D] as the kernel reads it: float32 [..., tokens, heads, D], each token's heads x D
// contiguous and the tokens one stride apart (stride(-3)). Slices of a projection's output pass as they
// are; anything else becomes a float32 copy.
inline at::Tensor token_rows(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(3);
  if (x.scalar_type() == at::kFloat && x.stride(3) == 1 && x.stride(2) == D &&
      (B == 1 || (T > 1 && x.stride(0) == T * x.stride(1))))
    return x;
  at::Tensor y = x.reshape({-1, x.size(2), D});  // a view wherever one stride per token exists
  if (y.scalar_type() != at::kFloat || y.stride(2) != 1 || y.stride(1) != D) y = y.to(at::kFloat).contiguous();
  return y;
}

// Runs a: its inputs, strides, sizes, state, out and snaps filled in (gdr_run from tensors; gdn.h from a
// projection's rows); the window and its scratch are set here.
inline void gdr_apply(Args a) {
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

// q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] or [B, T, HV, K]; beta [B, T, HV], any float dtype and
// layout (converted here where the kernel cannot read them as they are); B * T tokens of all sequences in
// order ([1, T] when packed), sequence n at tokens cu[n] .. cu[n + 1]. state [S, HV, K, V] float32
// contiguous, advanced in place: sequence n owns row state_idx[n] (row n when null). Writes out float32
// contiguous [B, T, HV, V] and snaps [N, n_snaps, HV, K, V] (newest first; undefined or empty: none).
void gdr_run(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
             at::Tensor state, const int64_t* cu, int64_t N, const int64_t* state_idx, at::Tensor out,
             at::Tensor snaps, double scale, bool l2norm) {
  q = token_rows(q);
  k = token_rows(k);
  v = token_rows(v);
  g = g.to(at::kFloat).contiguous();
  beta = beta.to(at::kFloat).contiguous();
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
  a.cu = cu;
  a.state_idx = state_idx;
  a.N = N;
  a.n_snaps = snaps.defined() && snaps.numel() ? snaps.size(1) : 0;
  a.snaps = a.n_snaps ? snaps.data_ptr<float>() : nullptr;
  a.H = q.size(-2);
  a.HV = state.size(1);
  a.K = state.size(2);
  a.V = state.size(3);
  a.T = a.H * a.K ? q.numel() / (a.H * a.K) : 0;
  a.per_channel = g.numel() > a.T * a.HV;  // g [..., HV, K], not [..., HV]
  a.l2norm = l2norm;
  a.scale = static_cast<float>(scale);
  gdr_apply(a);
}

// The general entry (ops/fused.py, which allocates out and snaps): cu_seqlens [N + 1] int64, state_idx [N]
// int64 or None.
void gdr_forward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                 at::Tensor state, at::Tensor cu_seqlens, c10::optional<at::Tensor> state_idx,
                 at::Tensor out, at::Tensor snaps, double scale, bool l2norm) {
  if (state_idx) state_idx = state_idx->contiguous();
  gdr_run(q, k, v, g, beta, state, cu_seqlens.data_ptr<int64_t>(), cu_seqlens.size(0) - 1,
          state_idx ? state_idx->data_ptr<int64_t>() : nullptr, out, snaps, scale, l2norm);
}

// The common call of gated_delta_rule checked and run here, where the checks take nanoseconds (in Python they
// cost ~5 us, an eighth of a decode step): float32 CPU tensors, no autograd, q, k [B, T, H, K], v [B, T, HV,
// V] with HV a multiple of H, g [B, T, HV] or [B, T, HV, K], beta [B, T, HV], B sequences of T tokens, state
// float32 contiguous [B, HV, K, V], or [S, HV, K, V] of which sequence n owns row state_idx[n] (int64 [B],
// distinct rows in range), advanced in place. Returns out [B, T, HV, V], or None for any other call: the
// caller then takes the general path, which runs it or names what is wrong.
c10::optional<at::Tensor> gdr_inplace(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g,
                                         at::Tensor beta, at::Tensor state, c10::optional<at::Tensor> state_idx,
                                         c10::optional<double> scale, bool l2norm) {
  const bool grad = at::GradMode::is_enabled();
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta, &state})
    if (!t->defined() || !t->device().is_cpu() || t->scalar_type() != at::kFloat || (grad && t->requires_grad()))
      return c10::nullopt;
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.dim() != 4 || state.dim() != 4 || !state.is_contiguous())
    return c10::nullopt;
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), HV = v.size(2), V = v.size(3);
  if (v.size(0) != B || v.size(1) != T || H == 0 || HV % H || beta.sizes() != at::IntArrayRef({B, T, HV}) ||
      (g.sizes() != at::IntArrayRef({B, T, HV}) && g.sizes() != at::IntArrayRef({B, T, HV, K})) ||
      state.size(1) != HV || state.size(2) != K || state.size(3) != V)
    return c10::nullopt;
  const int64_t* rows = nullptr;
  if (state_idx) {
    const at::Tensor& idx = *state_idx;
    if (!idx.device().is_cpu() || idx.scalar_type() != at::kLong || idx.dim() != 1 || idx.size(0) != B ||
        !idx.is_contiguous())
      return c10::nullopt;
    rows = idx.data_ptr<int64_t>();
    for (int64_t n = 0; n < B; ++n) {
      if (rows[n] < 0 || rows[n] >= state.size(0)) return c10::nullopt;
      for (int64_t m = 0; m < n; ++m)
        if (rows[m] == rows[n]) return c10::nullopt;
    }
  } else if (state.size(0) != B) {
    return c10::nullopt;
  }
  std::vector<int64_t> cu(B + 1);
  for (int64_t n = 0; n <= B; ++n) cu[n] = n * T;
  // at::empty: at::empty's autograd layer costs ~5 us
  at::Tensor out = at::empty(v.sizes(), at::TensorOptions().dtype(at::kFloat));
  gdr_run(q, k, v, g, beta, state, cu.data(), B, rows, out, at::Tensor(),
          scale ? *scale : 1.0 / std::sqrt(static_cast<double>(K)), l2norm);
  return out;
}

}  // namespace deltaserve
