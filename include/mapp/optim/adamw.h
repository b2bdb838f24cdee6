// AdamW's update in one pass over memory (the C++ core of
// megatronapp.optimizer.FusedAdamW and torch.ops.mapp.fused_adamw_).
//
// The arithmetic is torch.optim.AdamW's (decoupled weight decay, no amsgrad),
// in float32 with the step's scalars computed in double as torch computes
// them in Python:
//
//   p  = p * (1 - lr * weight_decay)
//   m  = m + (1 - beta1) * (g - m)
//   v  = v * beta2 + (1 - beta2) * g * g
//   p  = p - (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
//
// torch runs that as six tensor operations, each a pass over memory; here
// each element is read and written once (AVX2 where the CPU has it).
#pragma once

#include <cstddef>
#include <cstdint>

namespace mapp::optim {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

// The float32 scalars of one step (`step` counts from 1).
struct AdamWScalars {
  float decay;         // 1 - lr * weight_decay
  float one_minus_b1;  // 1 - beta1
  float b2;            // beta2
  float one_minus_b2;  // 1 - beta2
  float step_size;     // lr / (1 - beta1^step)
  float bc2_sqrt;      // sqrt(1 - beta2^step)
  float eps;
};

// Throws ValueError for a step < 1 or hyper-parameters outside their ranges
// (as torch.optim.AdamW's constructor checks them).
AdamWScalars adamw_scalars(const AdamWHyper& h, std::int64_t step);

// One step over `n` elements in place.
void adamw_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                std::size_t n, const AdamWScalars& s);

}  // namespace mapp::optim
