// The activations x [M, K] as the linear kernels read them: float32 rows, each contiguous, any distance apart (the
// MLP's down projection reads swiglu's product written over the gate half of gate_up: a contiguous copy would be
// 7 MB a call at 512 tokens of a 0.8B model).
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>

namespace deltaserve {

inline void check_rows(const at::Tensor& x, const char* kernel) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.size(0) <= 1 || x.stride(0) >= x.size(1)),
              kernel, ": x must be float32 [M, K] with contiguous rows");
}

// floats from one row of x to the next
inline int64_t row_stride(const at::Tensor& x) { return x.size(0) > 1 ? x.stride(0) : x.size(1); }

}  // namespace deltaserve
