// The MTP layer (models/mtp.py) of a dense Qwen model in one C++ call per use: chained greedy drafts of k tokens,
// and the keys and values a trunk pass leaves in the layer's cache. Through the modules each draft step cost ~50
// small torch ops and their Python (0.3 ms on a 7.5M-parameter model, where its arithmetic takes a fifth of that),
// so drafting cost more than the tokens it saved.
//
//     g_p = norm(layer(fc([enorm(embed(x_p)) | hnorm(h_{p-1})])))        logits_p = head(g_p)
#pragma once
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <vector>

#include "layers.h"
#include "plan.h"

namespace deltaserve {

class MTPPlan {
 public:
  // embed [V, E] float32 or float16 (the trunk's table); layer: a DecodePlan of the one attention decoder layer
  MTPPlan(torch::Tensor embed, torch::Tensor enorm, torch::Tensor hnorm, double eps, const LinearRef& fc,
          const DecodePlan& layer, torch::Tensor norm, const LinearRef& head)
      : embed_(embed), enorm_(enorm), hnorm_(hnorm), norm_(norm), eps_(eps), fc_(fc), layer_(layer), head_(head) {
    TORCH_CHECK(embed.dim() == 2 && (embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kHalf),
                "MTPPlan: the embedding must be float32 or float16 [V, E]");
    TORCH_CHECK(layer.size() == 1, "MTPPlan: one decoder layer");
  }

  // After a trunk pass over ids [N * T] (T tokens per sequence from start[n]) whose normed hidden states before
  // each token are before [N * T, E]: the layer's keys and values at those positions. cos, sin [N * T, rot].
  void follow(torch::Tensor ids, torch::Tensor before, int64_t T, torch::Tensor slots, torch::Tensor start,
              torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache) {
    layer_.write_kv(input(ids, before), T, slots, start, cos, sin, k_cache, v_cache);
  }

  // Greedy chained drafts: sequence n drafts ks[n] tokens after ids[n] (its pending token, at position start[n]),
  // from hidden [N, E], the trunk's normed state after its last cached token; draft s of it sits at start[n] + s,
  // cos, sin [N, max k, rot], and writes the layer's cache there. -> [N, max k] int64, -1 past a sequence's ks[n].
  torch::Tensor draft(torch::Tensor ids, torch::Tensor hidden, torch::Tensor slots, torch::Tensor start,
                      torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                      const std::vector<int64_t>& ks) {
    const int64_t N = ids.size(0), steps = cos.size(1);
    TORCH_CHECK(static_cast<int64_t>(ks.size()) == N && hidden.dim() == 2 && hidden.size(0) == N &&
                    cos.dim() == 3 && cos.size(0) == N && sin.sizes() == cos.sizes(),
                "MTPPlan.draft: one k, hidden row and cos / sin row per sequence");
    for (int64_t k : ks) TORCH_CHECK(k >= 0 && k <= steps, "MTPPlan.draft: k ", k, " outside 0..", steps);
    const auto i64 = at::TensorOptions().dtype(at::kLong);
    torch::Tensor drafts = at::full({N, steps}, -1, i64);
    const torch::Tensor none = at::empty({0}, at::TensorOptions().dtype(at::kFloat));
    torch::Tensor tok = ids.clone(), h = hidden.contiguous(), rows = at::arange(N, i64);
    for (int64_t s = 0; s < steps; ++s) {
      std::vector<int64_t> live;  // the sequences that still draft, as rows of tok / h
      for (int64_t r = 0; r < rows.size(0); ++r)
        if (ks[rows.data_ptr<int64_t>()[r]] > s) live.push_back(r);
      if (live.empty()) break;
      if (static_cast<int64_t>(live.size()) < rows.size(0)) {
        const torch::Tensor keep = torch::from_blob(live.data(), {static_cast<int64_t>(live.size())}, i64).clone();
        tok = tok.index_select(0, keep), h = h.index_select(0, keep), rows = rows.index_select(0, keep);
      }
      const torch::Tensor at_s = start.index_select(0, rows) + s;
      torch::Tensor g = layer_.step(input(tok, h), slots.index_select(0, rows), at_s,
                                    cos.index_select(0, rows).select(1, s).contiguous(),
                                    sin.index_select(0, rows).select(1, s).contiguous(), {none}, {none}, {k_cache},
                                    {v_cache});
      rms_norm(g, norm_, eps_, g, none, 0);
      tok = head_(g).argmax(-1);
      h = g;
      drafts.index_put_({rows, s}, tok);
    }
    return drafts;
  }

 private:
  torch::Tensor embed_, enorm_, hnorm_, norm_;
  double eps_;
  LinearRef fc_;
  DecodePlan layer_;
  LinearRef head_;

  // fc([enorm(embed(ids)) | hnorm(hidden)]): ids [M], hidden [M, E] -> [M, E]
  torch::Tensor input(const torch::Tensor& ids, const torch::Tensor& hidden) {
    const int64_t M = ids.size(0), E = embed_.size(1);
    TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.size(0) == M && hidden.size(1) == E,
                "MTPPlan: hidden must be float32 [M, E]");
    torch::Tensor both = at::empty({M, 2 * E}, at::TensorOptions().dtype(at::kFloat));
    const torch::Tensor none = at::empty({0}, at::TensorOptions().dtype(at::kFloat));
    torch::Tensor e = both.narrow(1, 0, E), hn = both.narrow(1, E, E);
    const torch::Tensor rows = embed_.index_select(0, ids).to(at::kFloat), h = hidden.contiguous();
    // rms_norm writes whole rows; the halves of `both` are rows 2E apart, so each half goes through a buffer
    torch::Tensor buf = at::empty({M, E}, at::TensorOptions().dtype(at::kFloat));
    rms_norm(rows.contiguous(), enorm_, eps_, buf, none, 0);
    e.copy_(buf);
    rms_norm(h, hnorm_, eps_, buf, none, 0);
    hn.copy_(buf);
    return fc_(both);
  }
};

inline void bind_mtp_plan(pybind11::module_& m) {
  pybind11::class_<MTPPlan>(m, "MTPPlan")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, double, const LinearRef&, const DecodePlan&,
                          torch::Tensor, const LinearRef&>())
      .def("follow", &MTPPlan::follow)
      .def("draft", &MTPPlan::draft);
}

}  // namespace deltaserve
