// deltaserve's CPU kernels, built by ops/fused.py as one translation unit from the headers beside this file:
// delta_rule.h (the fused gated delta rule), conv.h, gdn.h (a GDN layer's middle in one call), layers.h (norms, SwiGLU, attention step), gemv.h,
// f16gemm.h (the prefill GEMM of float16 weights, and of bfloat16 ones times float32 activations),
// kquants.h (packed GGML blocks: decoders, rows to float32) and kquants_avx512.h, packed.h (decode GEMV and rows to float32 on them),
// int8dot.h, int8gemv.h, panel_gemv.h, int8panel.h, int8gemm.h, int8gemm_amx.h, int8ktile_avx2.h and panels.h (integer dot products of K-quant blocks; int8q8.h of Q8_0 ones with activations rounded to int8,
// q8acts.h that rounding, int8legacy.h and int8legacy_avx2.h the other 32-weight blocks), probe.h (peaks),
// bf16.h (float32 activations times bfloat16 weights; its AMX prefill in bf16_amx.h), amx.h (whether the tiles run),
// attention.h (tiled attention over the KV cache for long spans), bpe.h (a BPE vocabulary's tables), blocks.h (an allocator
// for mid-sized tensors), plan.h (a decode step or verify pass through dense
// layers, and the MTP layer's drafts), spec.h (a greedy speculative step with those drafts).
#include "attention.h"
#include "bf16.h"
#include "blocks.h"
#include "bpe.h"
#include "conv.h"
#include "delta_rule.h"
#include "f16gemm.h"
#include "gdn.h"
#include "gemv.h"
#include "int8gemm.h"
#include "int8q8.h"
#include "kquants.h"
#include "layers.h"
#include "packed.h"
#include "panels.h"
#include "plan.h"
#include "probe.h"
#include "spec.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gdr_forward", &deltaserve::gdr_forward, "fused gated delta rule (CPU, float32)");
  m.def("gdr_inplace", &deltaserve::gdr_inplace, "the common in-place call, checked in C++; None for any other");
  m.def("gdn_core", &deltaserve::gdn_core, "a GDN layer's conv, gates, delta rule and gated norm at inference (CPU)");
  m.def("gdn_core_kept", [](at::Tensor proj, at::Tensor conv_weight, at::Tensor conv_state, at::Tensor slots,
                            at::Tensor A, at::Tensor dt_bias, at::Tensor ssm_state, at::Tensor norm_weight,
                            double eps, int64_t H, at::Tensor tape, at::Tensor snaps) {
          return deltaserve::gdn_core_kept(proj, conv_weight, conv_state, slots, A, dt_bias, ssm_state, norm_weight, eps, H,
                                           tape, snaps);
        }, "gdn_core keeping the conv tape and delta-rule states (CPU)");
  m.def("conv_forward", &deltaserve::conv_forward, "short causal depthwise conv with state (CPU, float32)");
  m.def("linear_f16", &deltaserve::linear_f16, "float32 activations times float16 weights, decode GEMV (CPU)");
  m.def("linear_f16_shares", [](at::Tensor x, at::Tensor w, at::Tensor y) {
          return deltaserve::timed_shares([&] { deltaserve::linear_f16(x, w, y); });
        }, "linear_f16, each thread's share timed (bench)");
  m.def("linear_f16_gemm", &deltaserve::f16::linear_f16_gemm, "float32 activations times float16 weights, prefill GEMM (CPU)");
  m.def("linear_f16_gemm_shares", [](at::Tensor x, at::Tensor w, at::Tensor y) {
          return deltaserve::timed_shares([&] { deltaserve::f16::linear_f16_gemm(x, w, y); });
        }, "linear_f16_gemm with each thread's (outputs, seconds) of its fastest unit, for the benchmark");
  m.def("rms_norm", &deltaserve::rms_norm, "RMSNorm over the last dim, optionally gated (CPU, float32)");
  m.def("norm_rope_rows", &deltaserve::norm_rope_rows, "q/k RMSNorm + rope of attention rows in place (CPU, float32)");
  m.def("attention_step", &deltaserve::attention_step, "a decode step of gated attention (CPU, float32)");
  m.def("silu_mul", &deltaserve::silu_mul, "silu(x[:, :I]) * x[:, I:] (CPU, float32)");
  m.def("argmax_rows", &deltaserve::argmax_rows, "each row's first largest value's index, or first NaN's (CPU, float32)");
  m.def("linear_q8", &deltaserve::linear_q8, "float32 activations times Q8_0 weights (CPU)");
  m.def("linear_q8_int8", &deltaserve::q8::linear_q8_int8, "activations rounded per 32 to Q8_0 times Q8_0 weights (CPU)");
  m.def("q8_int8", [] { return deltaserve::q8::kQ8Int8; }, "whether this build has the Q8_0 integer kernels");
  m.def("linear_packed", &deltaserve::kq::linear_packed, "float32 activations times packed GGML blocks (CPU)");
  m.def("linear_int8", &deltaserve::kq::linear_int8, "activations rounded to int8 per 256 times K-quant blocks (CPU)");
  m.def("linear_int8_shares", [](at::Tensor x, at::Tensor bytes, at::Tensor table, at::Tensor y) {
          return deltaserve::timed_shares([&] { deltaserve::kq::linear_int8(x, bytes, table, y); });
        }, "linear_int8 with each thread's (rows, seconds) of its share, for the benchmark");
  m.def("linear_q8_int8_shares", [](at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor y) {
          return deltaserve::timed_shares([&] { deltaserve::q8::linear_q8_int8(x, w, scale, y); });
        }, "linear_q8_int8 with each thread's (rows, seconds) of its share, for the benchmark");
  m.def("int8_isa", &deltaserve::kq::int8_isa, "the instructions of the integer kernels in this build");
  m.def("int8_panels", [] { return deltaserve::kq::kDirectGemv ? deltaserve::kq::kPanel : int64_t{0}; },
        "rows per panel the integer kernels read K-quant matrices in (0: rows as the file holds them)");
  m.def("int8_types", [] {
          std::vector<int64_t> out;
          for (int64_t t : {2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23})
            if (deltaserve::kq::int8_type(t)) out.push_back(t);
          return out;
        }, "the GGML types linear_int8 takes in this build");
  m.def("int8_panel_types", [] {
          std::vector<int64_t> out;
          for (int64_t t : {2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23})
            if (deltaserve::kq::kDirectGemv && deltaserve::kq::int8_type(t) && deltaserve::kq::panel_type(t)) out.push_back(t);
          return out;
        }, "the GGML types linear_int8 reads in row panels in this build (none: rows as the file holds them)");
  m.def("to_panels", &deltaserve::kq::to_panels, "a packed matrix's K-quant rows rearranged into panels, in place");
  m.def("probe_fma", &deltaserve::probe_fma, "float32 FMAs per second, all threads (iters, reps)");
  m.def("probe_int8", &deltaserve::probe_int8, "int8 products per second, all threads (iters, reps)");
  m.def("probe_int8_format", &deltaserve::probe_int8_format,
        "int8 products per second in a K-quant's (or IQ4_XS's) prefill arithmetic, its scales included (iters, reps, "
        "GGML type); 0 without AVX-512 VNNI");
  m.def("probe_bf16", &deltaserve::probe_bf16, "bfloat16 products per second as the bf16 kernels run them (iters, reps)");
  m.def("probe_amx_bf16", &deltaserve::probe_amx<false>, "bfloat16 products per second on AMX tiles, all threads; 0 without AMX");
  m.def("probe_amx_int8", &deltaserve::probe_amx<true>, "int8 products per second on AMX tiles, all threads; 0 without AMX");
  m.def("amx_enabled", &deltaserve::amx::enabled, "whether the kernels take their AMX paths (built, granted, not turned off)");
  m.def("set_amx", &deltaserve::amx::set_enabled, "ask for the AMX paths (True) or the AVX-512 ones; returns amx_enabled()");
  m.def("probe_read", &deltaserve::probe_read, "bytes read per second, all threads (buf, reps)");
  m.def("read_sum", &deltaserve::read_sum, "the sum of a uint8 buffer's bytes, read once on all threads (a timed pass)");
  m.def("linear_bf16", &deltaserve::bf16::linear_bf16,
        "float32 activations (rounded to bfloat16 where asked and AVX512_BF16 is built) times bfloat16 weights (CPU)");
  m.def("linear_bf16_shares", [](at::Tensor x, at::Tensor w, at::Tensor y, bool round) {
          return deltaserve::timed_shares([&] { deltaserve::bf16::linear_bf16(x, w, y, round); });
        }, "linear_bf16 with each thread's (rows, seconds) of its share, for the benchmark");
  m.def("bf16_isa", &deltaserve::bf16::isa, "the instructions of the bf16 kernels in this build");
  m.def("bf16_rounds_activations", [] { return deltaserve::bf16::kDpbf16; },
        "whether linear_bf16 rounds the activations to bfloat16 when asked (AVX512_BF16 builds)");
  m.def("packed_rows", &deltaserve::kq::packed_rows, "rows of packed GGML blocks dequantised to float32 (CPU)");

  // plan.h: a decode step or verify pass through dense Qwen layers in one call, and the MTP layer's drafts
  deltaserve::bind_plan(m);
  // spec.h: drafts, verify, acceptance and rollback of a greedy speculative step in one call
  deltaserve::bind_spec(m);

  // blocks.h: torch's CPU tensors of 1-32 MB from an address range of their own
  m.def("use_block_range", &deltaserve::use_block_range, "make BlockRange torch's CPU allocator (once); False where it cannot");
  m.def("block_range_usage", &deltaserve::block_range_usage, "(bytes of the range ever used, bytes in blocks now)");

  // bpe.h: a byte-level BPE vocabulary's tables and its merges
  deltaserve::bpe::bind_bpe(m);

  // attention.h
  m.def("attention_cached", &deltaserve::attention_cached, "tiled causal attention over a KV cache (CPU, float32 q)");
}
