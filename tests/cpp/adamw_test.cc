// The fused AdamW of the core against a float64 closed form of
// torch.optim.AdamW's update, over sizes that exercise the vector body and
// its scalar tail, and its argument checks.
#include "mapp/optim/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "mapp/common/check.h"

namespace mapp::optim {
namespace {

TEST(AdamW, MatchesFloat64ClosedFormOverSteps) {
  const AdamWHyper h{1e-2, 0.9, 0.95, 1e-8, 0.1};
  for (std::size_t n : {1UL, 7UL, 8UL, 33UL, 1000UL}) {
    std::mt19937 gen(static_cast<unsigned>(n));
    std::normal_distribution<double> normal;
    std::vector<float> p(n), m(n, 0.0F), v(n, 0.0F);
    std::vector<double> p64(n), m64(n, 0.0), v64(n, 0.0);
    for (std::size_t i = 0; i < n; ++i) p64[i] = p[i] = static_cast<float>(normal(gen));
    for (std::int64_t step = 1; step <= 5; ++step) {
      std::vector<float> g(n);
      for (auto& x : g) x = static_cast<float>(normal(gen));
      adamw_step(p.data(), g.data(), m.data(), v.data(), n, adamw_scalars(h, step));
      const double bc1 = 1.0 - std::pow(h.beta1, step), bc2 = 1.0 - std::pow(h.beta2, step);
      for (std::size_t i = 0; i < n; ++i) {
        p64[i] *= 1.0 - h.lr * h.weight_decay;
        m64[i] = h.beta1 * m64[i] + (1.0 - h.beta1) * g[i];
        v64[i] = h.beta2 * v64[i] + (1.0 - h.beta2) * g[i] * g[i];
        p64[i] -= h.lr / bc1 * m64[i] / (std::sqrt(v64[i]) / std::sqrt(bc2) + h.eps);
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(p[i], p64[i], 2e-6) << "n " << n << " element " << i;
      ASSERT_NEAR(m[i], m64[i], 2e-6);
      ASSERT_NEAR(v[i], v64[i], 2e-6);
    }
  }
}

TEST(AdamW, BadArgumentsAreClearErrors) {
  EXPECT_THROW(adamw_scalars({}, 0), ValueError);
  EXPECT_THROW(adamw_scalars({1e-3, 1.0, 0.999, 1e-8, 0.0}, 1), ValueError);
  EXPECT_THROW(adamw_scalars({-1.0, 0.9, 0.999, 1e-8, 0.0}, 1), ValueError);
}

}  // namespace
}  // namespace mapp::optim
