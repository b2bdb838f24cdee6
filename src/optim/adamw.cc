// AdamW in one pass (include/mapp/optim/adamw.h).
#include "mapp/optim/adamw.h"

#include <cmath>

#include "mapp/common/check.h"

namespace mapp::optim {

AdamWScalars adamw_scalars(const AdamWHyper& h, std::int64_t step) {
  MAPP_CHECK(step >= 1, "AdamW: step must be >= 1, got ", step);
  MAPP_CHECK(h.lr >= 0.0, "AdamW: invalid learning rate ", h.lr);
  MAPP_CHECK(h.eps >= 0.0, "AdamW: invalid epsilon ", h.eps);
  MAPP_CHECK(h.beta1 >= 0.0 && h.beta1 < 1.0, "AdamW: invalid beta1 ", h.beta1,
             " (expected 0 <= beta1 < 1)");
  MAPP_CHECK(h.beta2 >= 0.0 && h.beta2 < 1.0, "AdamW: invalid beta2 ", h.beta2,
             " (expected 0 <= beta2 < 1)");
  MAPP_CHECK(h.weight_decay >= 0.0, "AdamW: invalid weight decay ", h.weight_decay);
  const auto t = static_cast<double>(step);
  AdamWScalars s{};
  s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.one_minus_b1 = static_cast<float>(1.0 - h.beta1);
  s.b2 = static_cast<float>(h.beta2);
  s.one_minus_b2 = static_cast<float>(1.0 - h.beta2);
  s.step_size = static_cast<float>(h.lr / (1.0 - std::pow(h.beta1, t)));
  s.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, t)));
  s.eps = static_cast<float>(h.eps);
  return s;
}

__attribute__((target_clones("avx2", "default"))) void adamw_step(
    float* __restrict param, const float* __restrict grad, float* __restrict exp_avg,
    float* __restrict exp_avg_sq, std::size_t n, const AdamWScalars& s) {
  const float decay = s.decay, w1 = s.one_minus_b1, b2 = s.b2, w2 = s.one_minus_b2;
  const float step_size = s.step_size, bc2 = s.bc2_sqrt, eps = s.eps;
#pragma omp simd
  for (std::size_t i = 0; i < n; ++i) {
    const float g = grad[i];
    const float m = exp_avg[i] + w1 * (g - exp_avg[i]);
    const float v = exp_avg_sq[i] * b2 + w2 * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = param[i] * decay - step_size * m / (std::sqrt(v) / bc2 + eps);
  }
}

}  // namespace mapp::optim
