// One greedy speculative step of a dense Qwen model with its MTP layer drafting, in one C++ call: the MTP plan's
// chained drafts, the trunk's verify pass over [pending token, drafts], the final norm, the MTP layer's keys and
// values for those positions, the head's logits, greedy acceptance and the rollback of every recurrent state to
// what was accepted. The same kernels and order as the Python path (models/mtp.py draft, HybridModel.forward with
// snapshots, engine/speculative.py accept, HybridState.rollback), so the tokens are the same bits; on a small
// model that path spent more time in Python between its calls than in them (the embedded model: ~1 ms a step
// against ~1.3 ms of kernels), a plain decode step half as much.
#pragma once
#include <pybind11/stl.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <tuple>
#include <vector>

#include "layers.h"
#include "plan.h"

namespace deltaserve {

class GreedySpec {
 public:
  // trunk: every decoder layer; mtp: the MTP layer's plan; embed [V, E] float (the trunk's table); norm: the final
  // norm's multiplier; head: the trunk's output head (the weights verification trusts, never a draft copy)
  GreedySpec(const DecodePlan& trunk, const MTPPlan& mtp, at::Tensor embed, at::Tensor norm, double eps,
             const LinearRef& head)
      : trunk_(trunk), mtp_(mtp), embed_(embed), norm_(norm), eps_(eps), head_(head) {}

  // Sequence n (cache row slots[n], start[n] tokens cached, pending token ids[n]) drafts ks[n] >= 1 tokens, all
  // are verified (T = 1 + max k tokens a row, a shorter draft padded with its last token) and the slot keeps the
  // pending token and the drafts the trunk agrees with. cos, sin [N, T, rot] at positions start[n] + t; the
  // caches as DecodePlan.verify takes them, mtp_k / mtp_v the MTP layer's, mtp_h [slots, 1, E] its hidden state.
  // -> drafts [N, max k] (-1 past ks[n]), accepted drafts [N], the trunk's next token [N]. The caller sets
  // lengths[slots] = start + accepted + 1.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> step(
      at::Tensor ids, at::Tensor slots, at::Tensor start, at::Tensor cos, at::Tensor sin,
      const std::vector<at::Tensor>& conv, const std::vector<at::Tensor>& ssm,
      const std::vector<at::Tensor>& k_cache, const std::vector<at::Tensor>& v_cache, at::Tensor mtp_k,
      at::Tensor mtp_v, at::Tensor mtp_h, const std::vector<int64_t>& ks) {
    const int64_t N = ids.size(0), T = cos.size(1), E = embed_.size(1);
    TORCH_CHECK(T >= 2 && static_cast<int64_t>(ks.size()) == N && slots.size(0) == N && start.size(0) == N,
                "GreedySpec.step: one k (>= 1), slot and start per sequence, T >= 2");
    for (int64_t k : ks) TORCH_CHECK(k >= 1 && k < T, "GreedySpec.step: k ", k, " outside 1..", T - 1);
    TORCH_CHECK(ids.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && start.scalar_type() == at::kLong &&
                    ids.is_contiguous() && slots.is_contiguous() && start.is_contiguous(),
                "GreedySpec.step: ids, slots and start must be contiguous int64 [N]");
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n) {  // the kernels below write cache rows unchecked
      const int64_t at = start.data_ptr<int64_t>()[n], id = ids.data_ptr<int64_t>()[n];
      TORCH_CHECK(sp[n] >= 0 && sp[n] < mtp_h.size(0) && at >= 0 && at + T <= mtp_k.size(1),
                  "GreedySpec.step: slot ", sp[n], " from position ", at, " cannot take ", T, " tokens");
      TORCH_CHECK(id >= 0 && id < embed_.size(0), "GreedySpec.step: token id ", id, " outside the vocabulary");
      for (int64_t m = 0; m < n; ++m) TORCH_CHECK(sp[m] != sp[n], "GreedySpec.step: slot ", sp[n], " twice");
    }
    const at::Tensor hidden = mtp_h.index_select(0, slots).view({N, E}).to(at::kFloat).contiguous();
    const at::Tensor drafts = mtp_.draft(ids, hidden, slots, start, cos.narrow(1, 0, T - 1).contiguous(),
                                            sin.narrow(1, 0, T - 1).contiguous(), mtp_k, mtp_v, ks);

    // the rows [pending, drafts, last draft repeated]
    at::Tensor rows = at::empty({N, T}, drafts.options());
    int64_t* rp = rows.data_ptr<int64_t>();
    const int64_t *dp = drafts.data_ptr<int64_t>(), *ip = ids.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n) {
      rp[n * T] = ip[n];
      for (int64_t t = 1; t < T; ++t) rp[n * T + t] = dp[n * (T - 1) + std::min(t, ks[n]) - 1];
    }
    const at::Tensor flat = rows.view({N * T});
    const at::Tensor cs = cos.reshape({N * T, -1}).contiguous(), sn = sin.reshape({N * T, -1}).contiguous();
    auto [h, tapes, kept] = trunk_.verify(embed_.index_select(0, flat).to(at::kFloat).contiguous(), T, slots, start,
                                          cs, sn, conv, ssm, k_cache, v_cache, T);
    const at::Tensor none = at::empty({0}, at::TensorOptions().dtype(at::kFloat));
    rms_norm(h, norm_, eps_, h, none, 0);  // [N T, E] normed in place
    at::Tensor before = at::empty({N, T, E}, h.options());  // the hidden state before each token
    before.select(1, 0).copy_(hidden);
    before.narrow(1, 1, T - 1).copy_(h.view({N, T, E}).narrow(1, 0, T - 1));
    mtp_.follow(flat, before.view({N * T, E}), T, slots, start, cs, sn, mtp_k, mtp_v);
    const at::Tensor best = argmax_rows(head_(h)).view({N, T});

    at::Tensor accepted = at::empty({N}, drafts.options()), next = at::empty({N}, drafts.options());
    const int64_t* bp = best.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n) {
      int64_t a = 0;
      while (a < ks[n] && dp[n * (T - 1) + a] == bp[n * T + a]) ++a;
      accepted.data_ptr<int64_t>()[n] = a;
      next.data_ptr<int64_t>()[n] = bp[n * T + a];
      const int64_t keep = a + 1;  // tokens of the row the slot keeps
      for (size_t i = 0; i < conv.size(); ++i) {
        if (!tapes[i].defined() || keep == T) continue;  // attention layers; all kept: the pass's state stands
        conv[i][sp[n]].copy_(tapes[i][n].narrow(0, keep, conv[i].size(1)));
        ssm[i][sp[n]].copy_(kept[i][n][T - keep]);
      }
      mtp_h[sp[n]][0].copy_(h[n * T + keep - 1]);
    }
    return {drafts, accepted, next};
  }

 private:
  DecodePlan trunk_;
  MTPPlan mtp_;
  at::Tensor embed_, norm_;
  double eps_;
  LinearRef head_;
};

inline void bind_spec(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<GreedySpec>(m, "GreedySpec")
      .def(py::init<const DecodePlan&, const MTPPlan&, at::Tensor, at::Tensor, double, const LinearRef&>())
      .def("step", &GreedySpec::step);
}

}  // namespace deltaserve
