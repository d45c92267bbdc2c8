// A decode step through a stack of dense Qwen layers (Gated DeltaNet or gated attention, then a SwiGLU MLP) in one
// C++ call: the same kernels as the modules' forward (rms_norm, the GEMVs of each weight's form, gdn_core,
// attention_step, silu_mul), without the ~1,300 small torch ops and their Python a step costs through the modules
// (3-4 ms a token on a 24-layer model, measured on a 2-core EPYC: a fifth of a 0.8B model's decode). The plan holds
// the layers' weights, built once from the modules (models/qwen/model.py); a step passes the caches. The same plan
// runs a speculative verify pass (a few tokens per sequence, keeping per-token states for rollback), and MTPPlan
// below the model's MTP layer.
#pragma once
#include <pybind11/stl.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "attention.h"
#include "bf16.h"
#include "gdn.h"
#include "gemv.h"
#include "int8gemm.h"
#include "int8q8.h"
#include "layers.h"
#include "packed.h"

namespace deltaserve {

// buf as float32 [rows, width], allocated only where it is not that size already: a decode step's plan keeps its
// outputs from step to step, since each torch op between the kernels costs microseconds there (the dispatcher's code
// and data evicted by the weights streaming through the caches)
inline at::Tensor& kept_rows(at::Tensor& buf, int64_t rows, int64_t width) {
  if (!buf.defined() || buf.size(0) != rows) buf = at::empty({rows, width}, at::TensorOptions().dtype(at::kFloat));
  return buf;
}

// y [M, N] = x [M, K] @ W^T for a weight in one of the forms linear() reads
struct LinearRef {
  enum Kind : int64_t { kInt8Packed = 0, kQ8 = 1, kF16 = 2, kF32 = 3, kPacked = 4, kBF16 = 5, kBF16Float = 6 };
  int64_t kind;
  at::Tensor w, aux, x_index;  // aux: the segment table (packed) or the scales (Q8_0); x_index: gather x first
  int64_t N, K;

  LinearRef(int64_t kind, at::Tensor w, at::Tensor aux, at::Tensor x_index, int64_t N, int64_t K)
      : kind(kind), w(w), aux(aux), x_index(x_index), N(N), K(K) {
    TORCH_CHECK(kind >= 0 && kind <= 6, "LinearRef: unknown kind ", kind);
  }

  at::Tensor operator()(at::Tensor x) const {
    at::Tensor y;
    return into(x, y);
  }

  // the product in `out`, kept where it is float32 [M, N] already (kept_rows)
  at::Tensor into(at::Tensor x, at::Tensor& out) const {
    if (x_index.numel()) x = x.index_select(1, x_index);
    if (kind != kF32) x = x.contiguous();  // (torch's GEMM takes rows apart, as F.linear passes them)
    at::Tensor& y = kept_rows(out, x.size(0), N);
    switch (kind) {
      case kInt8Packed: kq::linear_int8(x, w, aux, y); break;
      case kQ8: q8::linear_q8_int8(x, w, aux, y); break;
      case kF16: linear_f16(x, w, y); break;
      case kF32: at::mm_out(y, x, w.t()); break;
      case kPacked: kq::linear_packed(x, w, aux, y); break;
      case kBF16: bf16::linear_bf16(x, w, y, true); break;
      case kBF16Float: bf16::linear_bf16(x, w, y, false); break;
    }
    return y;
  }
};

// A layer's feed-forward: a SwiGLU MLP, or softmax top-k routed SwiGLU experts plus, where the layer has one, a
// shared expert scaled by sigmoid(x w_gate) (models/layers.py SparseMoE: the same kernels, and the same sums in the
// same order: experts ascending, each row's share scaled by its weight and then added).
struct FeedForward {
  std::vector<LinearRef> gate_up, down;  // the MLP's, or one per expert: [2I, E] (gate rows first), [E, I]
  std::optional<LinearRef> router;       // MoE: [experts, E]
  int64_t top_k;
  bool normalize;                                          // MoE: weights renormalised to sum 1
  std::optional<LinearRef> shared_gate, shared_up, shared_down;  // MoE: the shared expert's [1, E], [2I, E], [E, I]

  FeedForward(std::vector<LinearRef> gate_up, std::vector<LinearRef> down, std::optional<LinearRef> router,
              int64_t top_k, bool normalize, std::optional<LinearRef> shared_gate, std::optional<LinearRef> shared_up,
              std::optional<LinearRef> shared_down)
      : gate_up(std::move(gate_up)), down(std::move(down)), router(std::move(router)), top_k(top_k),
        normalize(normalize), shared_gate(std::move(shared_gate)), shared_up(std::move(shared_up)),
        shared_down(std::move(shared_down)) {
    const size_t n = this->gate_up.size();
    TORCH_CHECK(n >= 1 && this->down.size() == n && (this->router ? top_k >= 1 && top_k <= static_cast<int64_t>(n)
                                                                    : n == 1),
                "FeedForward: one gate_up and down per expert (one for an MLP), 1 <= top_k <= experts");
    TORCH_CHECK(!this->shared_gate == !this->shared_up && !this->shared_up == !this->shared_down,
                "FeedForward: the shared expert needs its gate, gate_up and down");
  }

  // x [M, E] float32 -> [M, E]; an MLP's intermediates and output in `kept` (LinearRef::into)
  at::Tensor operator()(const at::Tensor& x, at::Tensor* kept = nullptr) const {
    if (!router) return swiglu(gate_up[0], down[0], x, true, kept);
    const int64_t M = x.size(0), k = top_k;
    auto [weights, ids] = (*router)(x).softmax(-1).topk(k, -1);
    if (normalize) weights = weights / weights.sum(-1, true);
    weights = weights.contiguous(), ids = ids.contiguous();
    std::vector<std::vector<int64_t>> picks(gate_up.size());  // per expert: its assignments m k + j, m ascending
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t a = 0; a < M * k; ++a) {
      TORCH_CHECK(id[a] >= 0 && id[a] < static_cast<int64_t>(picks.size()), "FeedForward: expert ", id[a]);
      picks[id[a]].push_back(a);
    }
    at::Tensor out = at::zeros_like(x);
    const at::Tensor flat = weights.view({-1});
    const auto i64 = at::TensorOptions().dtype(at::kLong);
    for (size_t e = 0; e < picks.size(); ++e) {
      if (picks[e].empty()) continue;
      const int64_t n = static_cast<int64_t>(picks[e].size());
      if (M == 1) {
        out.add_(swiglu(gate_up[e], down[e], x, false).mul_(flat[picks[e][0]]));
        continue;
      }
      const at::Tensor assigned = at::from_blob(picks[e].data(), {n}, i64);
      const at::Tensor rows = assigned.div(k, "floor");
      const at::Tensor y = swiglu(gate_up[e], down[e], x.index_select(0, rows), false);
      out.index_add_(0, rows, y.mul_(flat.index_select(0, assigned).unsqueeze(1)));
    }
    if (shared_gate) out.add_(swiglu(*shared_up, *shared_down, x, true).mul_((*shared_gate)(x).sigmoid_()));
    return out;
  }

  // down(silu(gate) * up) of x [M, E]. in_place (as an MLP module runs): the product over the gate half of gate_up's
  // output, which the down projection then reads rows 2I apart (a float32 GEMM's sums depend on that stride)
  static at::Tensor swiglu(const LinearRef& gate_up, const LinearRef& down, const at::Tensor& x, bool in_place,
                              at::Tensor* kept = nullptr) {
    at::Tensor local[2];
    at::Tensor* buf = kept ? kept : local;
    const at::Tensor g = gate_up.into(x, buf[0]);
    const int64_t I = g.size(1) / 2;
    at::Tensor act = in_place ? g.narrow(1, 0, I) : at::empty({x.size(0), I}, at::TensorOptions().dtype(at::kFloat));
    silu_mul(g, act);
    return down.into(act, buf[1]);
  }
};

struct LayerPlan {
  bool attention;
  at::Tensor input_norm, post_norm;
  double eps;
  LinearRef in, out;
  FeedForward ffn;
  at::Tensor conv_weight, A, dt_bias, norm, q_norm, k_norm;  // GDN: the first four; attention: the last two
  double inner_eps;                                            // GDN output norm / attention q, k norms
  int64_t heads;                                               // GDN key heads / attention query heads
};

class DecodePlan {
 public:
  void add_gdn(at::Tensor input_norm, at::Tensor post_norm, double eps, const LinearRef& in, const LinearRef& out,
               const FeedForward& ffn, at::Tensor conv_weight, at::Tensor A,
               at::Tensor dt_bias, at::Tensor norm, double norm_eps, int64_t key_heads) {
    layers_.push_back({false, input_norm, post_norm, eps, in, out, ffn, conv_weight, A, dt_bias, norm,
                       at::Tensor(), at::Tensor(), norm_eps, key_heads});
  }

  void add_attention(at::Tensor input_norm, at::Tensor post_norm, double eps, const LinearRef& qkv,
                     const LinearRef& o, const FeedForward& ffn, at::Tensor q_norm,
                     at::Tensor k_norm, double qk_eps, int64_t heads) {
    layers_.push_back({true, input_norm, post_norm, eps, qkv, o, ffn, at::Tensor(), at::Tensor(),
                       at::Tensor(), at::Tensor(), q_norm, k_norm, qk_eps, heads});
  }

  // h [N, E] float32 (one token per sequence), advanced through every layer in place and returned; sequence n in
  // cache row slots[n] at position start[n]; cos, sin [N, rot]; caches per layer (undefined where the layer has none)
  at::Tensor step(at::Tensor h, at::Tensor slots, at::Tensor start, at::Tensor cos, at::Tensor sin,
                     const std::vector<at::Tensor>& conv, const std::vector<at::Tensor>& ssm,
                     const std::vector<at::Tensor>& k_cache, const std::vector<at::Tensor>& v_cache) {
    return run(h, 1, slots, start, cos, sin, conv, ssm, k_cache, v_cache, 0, nullptr, nullptr);
  }

  // A verify pass: h [N * T, E], T tokens per sequence (token t of sequence n in row n T + t, at position
  // start[n] + t), cos, sin [N * T, rot]. Also keeps what rollback reads, per layer (None on attention layers):
  // the conv tape [N, W-1+T, C] and the delta-rule states after each of the last `depth` tokens [N, depth, HV, K, V].
  std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> verify(
      at::Tensor h, int64_t T, at::Tensor slots, at::Tensor start, at::Tensor cos, at::Tensor sin,
      const std::vector<at::Tensor>& conv, const std::vector<at::Tensor>& ssm,
      const std::vector<at::Tensor>& k_cache, const std::vector<at::Tensor>& v_cache, int64_t depth) {
    TORCH_CHECK(T >= 1 && depth >= 1, "DecodePlan.verify: T and depth must be >= 1");
    std::vector<at::Tensor> tapes(layers_.size()), snaps(layers_.size());
    h = run(h, T, slots, start, cos, sin, conv, ssm, k_cache, v_cache, depth, &tapes, &snaps);
    return {h, tapes, snaps};
  }

  // Only the keys and values of h [N * T, E] (T tokens per sequence from start[n]; cos, sin [N * T, rot]) into the
  // caches of the plan's first layer, an attention layer: the MTP layer following a trunk pass, where nothing of
  // its output is used.
  void write_kv(at::Tensor h, int64_t T, at::Tensor slots, at::Tensor start, at::Tensor cos,
                at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache) {
    TORCH_CHECK(!layers_.empty() && layers_[0].attention, "DecodePlan.write_kv: the first layer must be attention");
    TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous() && T >= 1 && h.size(0) % T == 0,
                "DecodePlan.write_kv: h must be float32 [N * T, E]");
    const LayerPlan& l = layers_[0];
    at::Tensor x = at::empty_like(h);
    rms_norm(h, l.input_norm, l.eps, x, at::empty({0}, at::TensorOptions().dtype(at::kFloat)), 0);
    const at::Tensor proj = l.in(x);
    const int64_t hd = l.q_norm.numel(), nkv = k_cache.size(2);
    norm_rope_rows(proj, l.q_norm, l.k_norm, l.inner_eps, cos, sin, 0, nkv, 2 * l.heads * hd);  // the keys only
    store_kv(l, proj, h.size(0) / T, T, k_cache, v_cache, slots, start);
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<LayerPlan> layers_;
  // each layer's projections' outputs, kept from call to call (LinearRef::into): one call at a time per plan
  struct Kept {
    at::Tensor in, mixer, out, ffn[2];  // mixer: the attention's or Gated DeltaNet's output, out's input
  };
  std::vector<Kept> kept_;

  at::Tensor run(at::Tensor h, int64_t T, at::Tensor slots, at::Tensor start, at::Tensor cos,
                    at::Tensor sin, const std::vector<at::Tensor>& conv, const std::vector<at::Tensor>& ssm,
                    const std::vector<at::Tensor>& k_cache, const std::vector<at::Tensor>& v_cache, int64_t depth,
                    std::vector<at::Tensor>* tapes, std::vector<at::Tensor>* snaps) {
    const size_t L = layers_.size();
    TORCH_CHECK(conv.size() == L && ssm.size() == L && k_cache.size() == L && v_cache.size() == L,
                "DecodePlan.step: one cache entry per layer");
    TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous() && h.size(0) % T == 0,
                "DecodePlan.step: h must be float32 [N * T, E]");
    const int64_t M = h.size(0), N = M / T;
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    const at::Tensor none = at::empty({0}, f32);
    at::Tensor x = at::empty_like(h);
    kept_.resize(L);
    for (size_t i = 0; i < L; ++i) {
      const LayerPlan& l = layers_[i];
      Kept& bufs = kept_[i];
      rms_norm(h, l.input_norm, l.eps, x, none, 0);
      const at::Tensor proj = l.in.into(x, bufs.in);
      at::Tensor mixed;
      if (l.attention && T <= kStepTokens) {
        mixed = l.out.into(attention_steps(l, proj, N, T, cos, sin, k_cache[i], v_cache[i], slots, start, bufs.mixer),
                           bufs.out);
      } else if (l.attention) {
        mixed = l.out.into(attention_tokens(l, proj, N, T, cos, sin, k_cache[i], v_cache[i], slots, start), bufs.out);
      } else {
        at::Tensor tape, kept;
        if (tapes) {
          const int64_t C = l.conv_weight.size(0), HV = ssm[i].size(1);
          tape = (*tapes)[i] = at::empty({N, conv[i].size(1) + T, C}, f32);
          kept = (*snaps)[i] = at::empty({N, depth, HV, ssm[i].size(2), ssm[i].size(3)}, f32);
        }
        gdn_core_kept(proj.view({N, T, proj.size(1)}), l.conv_weight, conv[i], slots, l.A, l.dt_bias, ssm[i], l.norm,
                      l.inner_eps, l.heads, tape, kept, kept_rows(bufs.mixer, M, l.out.K));
        mixed = l.out.into(bufs.mixer, bufs.out);
      }
      add_rows(h, mixed);
      rms_norm(h, l.post_norm, l.eps, x, none, 0);
      add_rows(h, l.ffn(x, bufs.ffn));
    }
    return h;
  }

  // h += y, both float32 [M, E] contiguous (without the dispatcher and TensorIterator of h.add_: see LinearRef::into)
  static void add_rows(at::Tensor& h, const at::Tensor& y) {
    TORCH_CHECK(y.is_contiguous() && y.numel() == h.numel(), "DecodePlan: a layer's output must match h");
    float* hp = h.data_ptr<float>();
    const float* yp = y.data_ptr<float>();
    for (int64_t i = 0, n = h.numel(); i < n; ++i) hp[i] += yp[i];
  }

  // The keys and values of proj [N T, D] (keys normed and rotated) into cache rows slots[n] from start[n].
  static void store_kv(const LayerPlan& l, const at::Tensor& proj, int64_t N, int64_t T, at::Tensor k_cache,
                       at::Tensor v_cache, at::Tensor slots, at::Tensor start) {
    const int64_t hd = l.q_norm.numel(), nh = l.heads, nkv = k_cache.size(2);
    TORCH_CHECK(proj.size(1) == (2 * nh + 2 * nkv) * hd, "DecodePlan: attention projection width");
    const at::Tensor rows = proj.view({N, T, proj.size(1)});
    const at::Tensor k = rows.narrow(2, 2 * nh * hd, nkv * hd).unflatten(2, {nkv, hd});
    const at::Tensor v = rows.narrow(2, (2 * nh + nkv) * hd, nkv * hd).unflatten(2, {nkv, hd});
    const int64_t *sp = slots.data_ptr<int64_t>(), *pp = start.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n) {
      TORCH_CHECK(sp[n] >= 0 && sp[n] < k_cache.size(0) && pp[n] >= 0 && pp[n] + T <= k_cache.size(1),
                  "DecodePlan: slot ", sp[n], " from position ", pp[n], " outside the cache");
      k_cache[sp[n]].narrow(0, pp[n], T).copy_(k[n]);
      v_cache[sp[n]].narrow(0, pp[n], T).copy_(v[n]);
    }
  }

  // Gated attention of T <= kStepTokens tokens of each of N sequences, token by token as a decode step attends (the
  // one-call kernel), so that a verify pass gives a decode step's bits (models/layers.py STEP_TOKENS does the same).
  // proj [N T, D] -> [N T, nh hd], the output projection's input.
  static at::Tensor attention_steps(const LayerPlan& l, at::Tensor proj, int64_t N, int64_t T, at::Tensor cos,
                                       at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                                       at::Tensor slots, at::Tensor start, at::Tensor& kept) {
    const int64_t hd = l.q_norm.numel();
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    if (T == 1) {  // into the output the plan keeps for this layer
      attention_step(proj, l.q_norm, l.k_norm, l.inner_eps, cos, sin, k_cache, v_cache, slots, start, scale,
                     kept_rows(kept, N, l.heads * hd));
      return kept;
    }
    at::Tensor o = at::empty({N, T, l.heads * hd}, f32), ot = at::empty({N, l.heads * hd}, f32);
    const at::Tensor rows = proj.view({N, T, proj.size(1)});
    const at::Tensor c = cos.view({N, T, cos.size(1)}), s = sin.view({N, T, sin.size(1)});
    for (int64_t t = 0; t < T; ++t) {
      attention_step(rows.select(1, t), l.q_norm, l.k_norm, l.inner_eps, c.select(1, t).contiguous(),
                     s.select(1, t).contiguous(), k_cache, v_cache, slots, start + t, scale, ot);
      o.select(1, t).copy_(ot);
    }
    return o.view({N * T, l.heads * hd});
  }

  // Gated attention over T tokens of each of N sequences, as the modules' prefill path computes it: q / k norms
  // and rope in place on proj [N T, D], the keys and values written into the cache rows, attention over the rows
  // (attention_cached), times sigmoid(gate). -> [N T, nh hd], the output projection's input.
  static at::Tensor attention_tokens(const LayerPlan& l, at::Tensor proj, int64_t N, int64_t T, at::Tensor cos,
                                        at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                                        at::Tensor slots, at::Tensor start) {
    const int64_t hd = l.q_norm.numel(), nh = l.heads, nkv = k_cache.size(2);
    TORCH_CHECK(proj.size(1) == (2 * nh + 2 * nkv) * hd, "DecodePlan.verify: attention projection width");
    norm_rope_rows(proj, l.q_norm, l.k_norm, l.inner_eps, cos, sin, nh, nkv, 2 * nh * hd);
    store_kv(l, proj, N, T, k_cache, v_cache, slots, start);
    const at::Tensor rows = proj.view({N, T, proj.size(1)});
    at::Tensor o = at::empty({N, T, nh, hd}, at::TensorOptions().dtype(at::kFloat));
    attention_cached(rows.narrow(2, 0, nh * hd).unflatten(2, {nh, hd}), k_cache, v_cache, slots, start,
                     1.0 / std::sqrt(static_cast<double>(hd)), o);
    o = o.view({N * T, nh * hd});
    o.mul_(at::sigmoid(proj.narrow(1, nh * hd, nh * hd)));
    return o;
  }
};

// The MTP layer (models/mtp.py) of a dense Qwen model in one call per use: chained greedy drafts of k tokens,
// and the keys and values a trunk pass leaves in the layer's cache. Through the modules each draft step cost ~50
// small torch ops and their Python (0.3 ms on a 7.5M-parameter model, where its arithmetic takes a fifth of that),
// so drafting cost more than the tokens it saved.
//     g_p = norm(layer(fc([enorm(embed(x_p)) | hnorm(h_{p-1})])))        logits_p = head(g_p)
class MTPPlan {
 public:
  // embed [V, E] float32, float16 or bfloat16 (the trunk's table); layer: a DecodePlan of the one attention decoder layer
  MTPPlan(at::Tensor embed, at::Tensor enorm, at::Tensor hnorm, double eps, const LinearRef& fc,
          const DecodePlan& layer, at::Tensor norm, const LinearRef& head)
      : embed_(embed), enorm_(enorm), hnorm_(hnorm), norm_(norm), eps_(eps), fc_(fc), layer_(layer), head_(head) {
    TORCH_CHECK(embed.dim() == 2 && (embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kHalf ||
                                     embed.scalar_type() == at::kBFloat16),
                "MTPPlan: the embedding must be float32, float16 or bfloat16 [V, E]");
    TORCH_CHECK(layer.size() == 1, "MTPPlan: one decoder layer");
  }

  // After a trunk pass over ids [N * T] (T tokens per sequence from start[n]) whose normed hidden states before
  // each token are before [N * T, E]: the layer's keys and values at those positions. cos, sin [N * T, rot].
  void follow(at::Tensor ids, at::Tensor before, int64_t T, at::Tensor slots, at::Tensor start,
              at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache) {
    layer_.write_kv(input(ids, before), T, slots, start, cos, sin, k_cache, v_cache);
  }

  // Greedy chained drafts: sequence n drafts ks[n] tokens after ids[n] (its pending token, at position start[n]),
  // from hidden [N, E], the trunk's normed state after its last cached token; draft s of it sits at start[n] + s,
  // cos, sin [N, max k, rot], and writes the layer's cache there. -> [N, max k] int64, -1 past a sequence's ks[n].
  at::Tensor draft(at::Tensor ids, at::Tensor hidden, at::Tensor slots, at::Tensor start,
                      at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                      const std::vector<int64_t>& ks) {
    const int64_t N = ids.size(0), steps = cos.size(1);
    TORCH_CHECK(static_cast<int64_t>(ks.size()) == N && hidden.dim() == 2 && hidden.size(0) == N &&
                    cos.dim() == 3 && cos.size(0) == N && sin.sizes() == cos.sizes(),
                "MTPPlan.draft: one k, hidden row and cos / sin row per sequence");
    for (int64_t k : ks) TORCH_CHECK(k >= 0 && k <= steps, "MTPPlan.draft: k ", k, " outside 0..", steps);
    TORCH_CHECK(slots.scalar_type() == at::kLong && start.scalar_type() == at::kLong && slots.is_contiguous() &&
                    start.is_contiguous() && slots.size(0) == N && start.size(0) == N,
                "MTPPlan.draft: slots and start must be contiguous int64 [N]");
    for (int64_t n = 0; n < N; ++n) {  // attention_step writes the cache rows unchecked
      const int64_t slot = slots.data_ptr<int64_t>()[n], at = start.data_ptr<int64_t>()[n];
      TORCH_CHECK(slot >= 0 && slot < k_cache.size(0) && at >= 0 && at + ks[n] <= k_cache.size(1),
                  "MTPPlan.draft: slot ", slot, " from position ", at, " cannot take ", ks[n], " drafts");
    }
    const auto i64 = at::TensorOptions().dtype(at::kLong);
    at::Tensor drafts = at::full({N, steps}, -1, i64);
    const at::Tensor none = at::empty({0}, at::TensorOptions().dtype(at::kFloat));
    at::Tensor tok = ids.clone(), h = hidden.contiguous(), rows = at::arange(N, i64);
    for (int64_t s = 0; s < steps; ++s) {
      std::vector<int64_t> live;  // the sequences that still draft, as rows of tok / h
      for (int64_t r = 0; r < rows.size(0); ++r)
        if (ks[rows.data_ptr<int64_t>()[r]] > s) live.push_back(r);
      if (live.empty()) break;
      if (static_cast<int64_t>(live.size()) < rows.size(0)) {
        const at::Tensor keep = at::from_blob(live.data(), {static_cast<int64_t>(live.size())}, i64).clone();
        tok = tok.index_select(0, keep), h = h.index_select(0, keep), rows = rows.index_select(0, keep);
      }
      const bool all = rows.size(0) == N;  // (the common case: every sequence drafts as many)
      const auto pick = [&](const at::Tensor& t) { return all ? t : t.index_select(0, rows); };
      at::Tensor g = layer_.step(input(tok, h), pick(slots), pick(start) + s, pick(cos).select(1, s).contiguous(),
                                    pick(sin).select(1, s).contiguous(), {none}, {none}, {k_cache}, {v_cache});
      rms_norm(g, norm_, eps_, g, none, 0);
      tok = argmax_rows(head_(g));
      h = g;
      drafts.index_put_({rows, s}, tok);
    }
    return drafts;
  }

 private:
  at::Tensor embed_, enorm_, hnorm_, norm_;
  double eps_;
  LinearRef fc_;
  DecodePlan layer_;
  LinearRef head_;

  // fc([enorm(embed(ids)) | hnorm(hidden)]): ids [M], hidden [M, E] -> [M, E]
  at::Tensor input(const at::Tensor& ids, const at::Tensor& hidden) {
    const int64_t M = ids.size(0), E = embed_.size(1);
    TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.size(0) == M && hidden.size(1) == E,
                "MTPPlan: hidden must be float32 [M, E]");
    at::Tensor both = at::empty({M, 2 * E}, at::TensorOptions().dtype(at::kFloat));
    const at::Tensor none = at::empty({0}, at::TensorOptions().dtype(at::kFloat));
    at::Tensor e = both.narrow(1, 0, E), hn = both.narrow(1, E, E);
    const at::Tensor rows = embed_.index_select(0, ids).to(at::kFloat), h = hidden.contiguous();
    // rms_norm writes whole rows; the halves of `both` are rows 2E apart, so each half goes through a buffer
    at::Tensor buf = at::empty({M, E}, at::TensorOptions().dtype(at::kFloat));
    rms_norm(rows.contiguous(), enorm_, eps_, buf, none, 0);
    e.copy_(buf);
    rms_norm(h, hnorm_, eps_, buf, none, 0);
    hn.copy_(buf);
    return fc_(both);
  }
};

inline void bind_plan(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<LinearRef>(m, "LinearRef")
      .def(py::init<int64_t, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t>())
      .def("__call__", &LinearRef::operator());
  py::class_<FeedForward>(m, "FeedForward")
      .def(py::init<std::vector<LinearRef>, std::vector<LinearRef>, std::optional<LinearRef>, int64_t, bool,
                    std::optional<LinearRef>, std::optional<LinearRef>, std::optional<LinearRef>>())
      .def("__call__", &FeedForward::operator());
  py::class_<DecodePlan>(m, "DecodePlan")
      .def(py::init<>())
      .def("add_gdn", &DecodePlan::add_gdn)
      .def("add_attention", &DecodePlan::add_attention)
      .def("step", &DecodePlan::step)
      .def("verify", &DecodePlan::verify)
      .def("write_kv", &DecodePlan::write_kv)
      .def("__len__", &DecodePlan::size);
  py::class_<MTPPlan>(m, "MTPPlan")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, double, const LinearRef&, const DecodePlan&,
                    at::Tensor, const LinearRef&>())
      .def("follow", &MTPPlan::follow)
      .def("draft", &MTPPlan::draft);
}

}  // namespace deltaserve
