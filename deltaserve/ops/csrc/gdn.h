// A Gated DeltaNet layer's middle at inference in one call: the short conv over the input projection's q | k | v
// (in place, SiLU), the gates beta = sigmoid(b), g = A softplus(a + dt_bias), the gated delta rule on the cached
// state (q, k L2-normalised, scale K^-1/2) and RMSNorm(o) w silu(z): in a decode step these were ~30 small torch
// ops and their Python per layer (a few hundred microseconds a token over a model), each now a C++ call on views.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <vector>

#include "conv.h"
#include "delta_rule.h"
#include "layers.h"

namespace deltaserve {

// proj [N, T, D] float32 contiguous: per token q (H K) | k (H K) | v (HV V) | z (HV V) | b (HV) | a (HV), value heads
// grouped; conv_weight [C, W] (C = 2 H K + HV V); conv_state [S, W-1, C] and ssm_state [S, HV, K, V] float32
// contiguous caches, sequence n in row slots[n] (distinct); A, dt_bias [HV]; norm_weight [V].
// Returns o [N, T, HV V] (the out projection's input; into `out` where that is float32 contiguous with as many
// elements, a decode plan's buffer kept from step to step); proj's q | k | v columns hold the conv's output after.
// For rollback (a verify pass), where defined: tape [N, W-1+T, C] gets the conv state before the pass, then the
// conv's inputs (the conv state after token t is rows t+1 .. t+W-1), and snaps [N, depth, HV, K, V] the delta-rule
// states after each of the last `depth` tokens, newest first.
// The parts run on the projection's rows through raw pointers: a decode step's views of q, k, v, z and its
// gates as tensors had cost ~15 dispatcher calls a layer, each several microseconds between GEMVs (plan.h).
at::Tensor gdn_core_kept(at::Tensor proj, at::Tensor conv_weight, at::Tensor conv_state, at::Tensor slots,
                            at::Tensor A, at::Tensor dt_bias, at::Tensor ssm_state, at::Tensor norm_weight,
                            double eps, int64_t H, at::Tensor tape, at::Tensor snaps,
                            at::Tensor out = at::Tensor()) {
  auto f32 = [](const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(); };
  TORCH_CHECK(f32(proj) && proj.dim() == 3 && f32(conv_weight) && f32(conv_state) && f32(ssm_state) && f32(A) &&
                  f32(dt_bias) && f32(norm_weight) && ssm_state.dim() == 4 && conv_state.dim() == 3,
              "gdn_core: float32 contiguous CPU tensors of the documented ranks");
  const int64_t N = proj.size(0), T = proj.size(1), D = proj.size(2);
  const int64_t HV = ssm_state.size(1), K = ssm_state.size(2), V = ssm_state.size(3), C = 2 * H * K + HV * V;
  TORCH_CHECK(H > 0 && HV % H == 0 && D == C + HV * V + 2 * HV && conv_weight.size(0) == C && conv_state.size(2) == C &&
                  conv_state.size(1) == conv_weight.size(1) - 1 && A.numel() == HV && dt_bias.numel() == HV &&
                  norm_weight.numel() == V && conv_state.size(0) == ssm_state.size(0),
              "gdn_core: shapes do not match (proj ", proj.sizes(), ", ssm_state ", ssm_state.sizes(), ")");
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == N &&
                  slots.is_contiguous(), "gdn_core: slots must be int64 [N]");
  const int64_t* rows = slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(rows[n] >= 0 && rows[n] < ssm_state.size(0), "gdn_core: slot ", rows[n], " out of range");
    for (int64_t m = 0; m < n; ++m) TORCH_CHECK(rows[m] != rows[n], "gdn_core: slot ", rows[n], " twice");
  }
  std::vector<int64_t> cu(N + 1);
  for (int64_t n = 0; n <= N; ++n) cu[n] = n * T;

  float* pp = proj.data_ptr<float>();
  const bool keep = tape.defined() && tape.numel();  // (undefined or empty: no rollback wanted)
  if (keep) {  // before the conv overwrites its input
    const int64_t W1 = conv_state.size(1);
    TORCH_CHECK(tape.scalar_type() == at::kFloat && tape.dim() == 3 && tape.size(0) == N && tape.size(1) == W1 + T &&
                    tape.size(2) == C, "gdn_core: tape must be float32 [N, W-1+T, C]");
    for (int64_t n = 0; n < N; ++n) tape[n].narrow(0, 0, W1).copy_(conv_state[rows[n]]);
    tape.narrow(1, W1, T).copy_(proj.narrow(2, 0, C));
  }
  TORCH_CHECK(!keep || (snaps.defined() && snaps.scalar_type() == at::kFloat && snaps.is_contiguous() && snaps.dim() == 5 &&
                                   snaps.size(0) == N && snaps.size(2) == HV && snaps.size(3) == K && snaps.size(4) == V),
              "gdn_core: snaps must be float32 contiguous [N, depth, HV, K, V]");
  conv_rows(pp, D, conv_weight.data_ptr<float>(), conv_weight.size(1), nullptr, conv_state.data_ptr<float>(), cu.data(),
            N, rows, pp, D, C, true);

  // The gates, a token's row at a time: each row's values then do not depend on how many rows come together (the
  // ATen ops vectorised over all of them, so a verify pass's first tokens rounded otherwise than a decode step's).
  thread_local std::vector<float> gates;  // beta [N T, HV] | g [N T, HV]
  gates.resize(2 * N * T * HV);
  float *bp = gates.data(), *gp = bp + N * T * HV;
  const float *Ap = A.data_ptr<float>(), *dp = dt_bias.data_ptr<float>();
  for (int64_t r = 0; r < N * T; ++r)
    for (int64_t h = 0; h < HV; ++h) {
      const float b = pp[r * D + C + HV * V + h], x = pp[r * D + C + HV * V + HV + h] + dp[h];
      bp[r * HV + h] = 1.f / (1.f + std::exp(-b));
      gp[r * HV + h] = Ap[h] * (x > 20.f ? x : std::log1p(std::exp(x)));  // softplus, as torch's (threshold 20)
    }

  const bool given = out.defined() && f32(out) && out.numel() == N * T * HV * V;
  at::Tensor o = given ? out : at::empty({N, T, HV * V}, at::TensorOptions().dtype(at::kFloat));
  Args a;
  a.q = pp, a.k = pp + H * K, a.v = pp + 2 * H * K, a.qs = a.ks = a.vs = D;  // each token's row of proj
  a.g = gp, a.beta_in = bp;
  a.state = ssm_state.data_ptr<float>(), a.out = o.data_ptr<float>();
  a.cu = cu.data(), a.state_idx = rows, a.N = N, a.T = N * T;
  a.n_snaps = keep ? snaps.size(1) : 0, a.snaps = keep ? snaps.data_ptr<float>() : nullptr;
  a.H = H, a.HV = HV, a.K = K, a.V = V;
  a.per_channel = false, a.l2norm = true, a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(K)));
  gdr_apply(a);

  // RMSNorm(o) w silu(z), z the token's row of proj at C: [HV, V] per token
  rms_norm_raw(a.out, norm_weight.data_ptr<float>(), a.out, pp + C, N * T * HV, V, eps, HV, D, V, 1);
  return o;
}

at::Tensor gdn_core(at::Tensor proj, at::Tensor conv_weight, at::Tensor conv_state, at::Tensor slots,
                       at::Tensor A, at::Tensor dt_bias, at::Tensor ssm_state, at::Tensor norm_weight,
                       double eps, int64_t H) {
  return gdn_core_kept(proj, conv_weight, conv_state, slots, A, dt_bias, ssm_state, norm_weight, eps, H,
                       at::Tensor(), at::Tensor());
}

}  // namespace deltaserve
