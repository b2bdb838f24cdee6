// CUDA AdamW over many tensors per launch (the reference is
// src/optim/adamw.cc: same arithmetic, same scalars). Raw pointers and a
// stream; no torch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mapp/optim/adamw.h"

namespace mapp::kernels {

// One step over `count` float32 tensors: param[i], grad[i], exp_avg[i],
// exp_avg_sq[i] hold numel[i] device elements each. Launches
// ceil(count / 32) kernels on `stream`; returns the first launch error
// (cudaSuccess when every kernel was queued).
cudaError_t adamw_step(float* const* param, const float* const* grad, float* const* exp_avg,
                       float* const* exp_avg_sq, const std::int64_t* numel, int count,
                       const optim::AdamWScalars& s, cudaStream_t stream);

}  // namespace mapp::kernels
