#include "mapp/tp/dropout.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "mapp/common/check.h"

namespace {

std::vector<std::uint8_t> mask(std::uint64_t seed, double p, std::int64_t n) {
  std::vector<std::uint8_t> m(static_cast<size_t>(n));
  mapp::dropout_mask(seed, mapp::dropout_threshold(p), 0, n, m.data());
  return m;
}

TEST(Dropout, KeepsOneMinusPWithinBinomialNoise) {
  const std::int64_t n = 1 << 22;
  for (double p : {0.1, 0.5, 0.9}) {
    const auto m = mask(12345, p, n);
    double kept = 0, pairs = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      kept += m[i];
      if (i + 1 < n) pairs += m[i] & m[i + 1];
    }
    const double q = 1.0 - mapp::dropout_threshold(p) / 65536.0;
    const double sigma = std::sqrt(q * (1 - q) / n);
    EXPECT_NEAR(kept / n, q, 6 * sigma) << p;
    EXPECT_NEAR(q, 1 - p, 1.0 / 65536) << p;
    // Neighbours (same and adjacent generator words) are independent.
    EXPECT_NEAR(pairs / (n - 1), q * q, 6 * std::sqrt(q * q * (1 - q * q) / n)) << p;
  }
}

TEST(Dropout, SeedsGiveIndependentMasks) {
  const std::int64_t n = 1 << 20;
  const auto a = mask(1, 0.5, n), b = mask(2, 0.5, n);
  double same = 0;
  for (std::int64_t i = 0; i < n; ++i) same += a[i] == b[i];
  EXPECT_NEAR(same / n, 0.5, 6 * std::sqrt(0.25 / n));
  EXPECT_EQ(a, mask(1, 0.5, n));  // a pure function of the seed
}

TEST(Dropout, AnySplitOfTheRangeGivesTheSameResult) {
  const std::int64_t n = 1001;
  std::vector<float> x(n), whole(n), parts(n);
  for (std::int64_t i = 0; i < n; ++i) x[i] = 0.5f + static_cast<float>(i);
  const std::uint32_t t = mapp::dropout_threshold(0.3);
  const float scale = 65536.0f / (65536.0f - t);
  mapp::dropout_apply(77, t, scale, 0, n, x.data(), whole.data());
  for (std::int64_t lo = 0, step = 1; lo < n; lo += step, step += 2) {
    const std::int64_t hi = std::min(n, lo + step);  // odd, unaligned pieces
    mapp::dropout_apply(77, t, scale, lo, hi, x.data() + lo, parts.data() + lo);
  }
  EXPECT_EQ(whole, parts);
  const auto m = mask(77, 0.3, n);
  for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(whole[i], m[i] ? x[i] * scale : 0.0f);
}

TEST(Dropout, ProbabilityZeroKeepsEverythingAndBadPIsRejected) {
  const auto m = mask(5, 0.0, 4096);
  for (auto v : m) EXPECT_EQ(v, 1);
  EXPECT_THROW(mapp::dropout_threshold(1.0), mapp::ValueError);
  EXPECT_THROW(mapp::dropout_threshold(-0.1), mapp::ValueError);
  EXPECT_EQ(mapp::dropout_threshold(0.9999999), 65535u);
}

}  // namespace
