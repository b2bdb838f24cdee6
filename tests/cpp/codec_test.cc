#include "mapp/codec/codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "mapp/common/check.h"

namespace mapp::codec {
namespace {

std::vector<float> randn(std::size_t n, unsigned seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(CodecSpec, ParsesAndRejectsWithTheValidForms) {
  EXPECT_EQ(Spec::parse("int8").block, 256);
  EXPECT_EQ(Spec::parse("int8:64").block, 64);
  EXPECT_EQ(Spec::parse("onebit:128").str(), "onebit:128");
  EXPECT_DOUBLE_EQ(Spec::parse("topk:0.05").ratio, 0.05);
  EXPECT_EQ(Spec::parse("powersgd:2").rank, 2);
  EXPECT_TRUE(Spec::parse("int8").biased());
  EXPECT_FALSE(Spec::parse("bf16").biased());
  for (const char* bad : {"int4", "topk", "topk:2", "int8:7", "powersgd:0", "bf16:3", "int8:x"}) {
    try {
      Spec::parse(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
  try {
    Spec::parse("zip");
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("int8[:block]"), std::string::npos);
  }
}

// fp16: against the compiler's own IEEE half type, including edge cases.
TEST(CodecCast, Fp16MatchesCompilerHalfAndBf16RoundsToNearestEven) {
  std::vector<float> v = randn(20000, 1, 300.f);
  for (float f : {0.f, -0.f, 1e-8f, 6e-8f, 6.1e-5f, 65504.f, 65519.f, 65520.f, 1e6f, -3.14159f,
                  5.96e-8f, 2.98e-8f, INFINITY, -INFINITY})
    v.push_back(f);
  for (float f : v) {
    const _Float16 ref = static_cast<_Float16>(f);
    std::uint16_t bits;
    std::memcpy(&bits, &ref, 2);
    ASSERT_EQ(float_to_fp16(f), bits) << f;
    ASSERT_EQ(fp16_to_float(bits), static_cast<float>(ref)) << f;
  }
  EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(NAN))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.f)), 1.f);
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: rounds to even (1).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.f + 1.f / 256)), 1.f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.f + 3.f / 256)), 1.f + 1.f / 64);
  for (float f : randn(1000, 2)) {
    EXPECT_LE(std::fabs(bf16_to_float(float_to_bf16(f)) - f), std::fabs(f) / 256 + 1e-30);
  }
}

TEST(CodecInt8, ErrorWithinHalfAStepOfEachBlock) {
  for (std::int64_t n : {1, 7, 256, 1000}) {
    const Spec s = Spec::parse("int8:64");
    std::vector<float> x = randn(n, 3, 5.f);
    std::vector<std::uint8_t> payload(encoded_bytes(s, n));
    encode(s, x.data(), n, payload.data());
    std::vector<float> y(n);
    decode(s, payload.data(), n, y.data());
    for (std::int64_t blk = 0; blk * 64 < n; ++blk) {
      double amax = 0;
      for (std::int64_t i = blk * 64; i < std::min<std::int64_t>(n, blk * 64 + 64); ++i)
        amax = std::max(amax, std::fabs(double(x[i])));
      for (std::int64_t i = blk * 64; i < std::min<std::int64_t>(n, blk * 64 + 64); ++i)
        ASSERT_LE(std::fabs(double(y[i]) - x[i]), amax / 254 * (1 + 1e-5) + 1e-12) << i;
    }
    std::vector<float> acc(n, 1.f);
    decode_add(s, payload.data(), n, acc.data());
    for (std::int64_t i = 0; i < n; ++i) ASSERT_FLOAT_EQ(acc[i], 1.f + y[i]);
  }
}

TEST(CodecOneBit, DecodesToSignTimesMeanMagnitude) {
  const Spec s = Spec::parse("onebit:16");
  std::vector<float> x = randn(50, 4);
  std::vector<std::uint8_t> p(encoded_bytes(s, 50));
  encode(s, x.data(), 50, p.data());
  std::vector<float> y(50);
  decode(s, p.data(), 50, y.data());
  for (std::int64_t blk = 0; blk < 4; ++blk) {
    const std::int64_t lo = blk * 16, hi = std::min<std::int64_t>(50, lo + 16);
    double mean = 0;
    for (std::int64_t i = lo; i < hi; ++i) mean += std::fabs(x[i]);
    mean /= double(hi - lo);
    for (std::int64_t i = lo; i < hi; ++i)
      ASSERT_NEAR(y[i], (x[i] >= 0 ? 1 : -1) * mean, 1e-6);
  }
}

// 1-bit with error feedback: what is not sent is carried, so the residual stays
// bounded and the running sum of decoded values tracks the running sum of inputs.
TEST(CodecOneBit, ErrorFeedbackResidualStaysBoundedOverThousandSteps) {
  const Spec s = Spec::parse("onebit:64");
  const std::int64_t n = 512;
  std::vector<float> err(n, 0.f), sent_sum(n, 0.f);
  std::vector<double> true_sum(n, 0.0);
  std::vector<std::uint8_t> p(encoded_bytes(s, n));
  std::vector<float> back(n);
  double max_err_norm = 0, grad_norm = 0;
  for (int step = 0; step < 1000; ++step) {
    std::vector<float> g = randn(n, 100 + step);
    for (std::int64_t i = 0; i < n; ++i) true_sum[i] += g[i];
    encode_with_feedback(s, g.data(), err.data(), n, p.data());
    decode(s, p.data(), n, back.data());
    double e2 = 0, g2 = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      sent_sum[i] += back[i];
      e2 += double(err[i]) * err[i];
      g2 += double(g[i]) * g[i];
    }
    max_err_norm = std::max(max_err_norm, std::sqrt(e2));
    grad_norm = std::sqrt(g2);
  }
  EXPECT_LT(max_err_norm, 4 * grad_norm);  // bounded, not growing with steps
  for (std::int64_t i = 0; i < n; ++i)  // sum sent + residual == sum of inputs
    ASSERT_NEAR(double(sent_sum[i]) + err[i], true_sum[i], 1e-2);
}

TEST(CodecTopK, PicksExactlyTheKLargestMagnitudes) {
  const std::int64_t n = 1000, k = 37;
  std::vector<float> x = randn(n, 5);
  std::vector<std::uint8_t> p(8 * k);
  topk_encode(x.data(), n, k, p.data());
  std::vector<std::int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return std::fabs(x[a]) > std::fabs(x[b]); });
  std::vector<std::int32_t> want(order.begin(), order.begin() + k);
  std::sort(want.begin(), want.end());
  const auto* idx = reinterpret_cast<const std::int32_t*>(p.data());
  const auto* val = reinterpret_cast<const float*>(p.data() + 4 * k);
  for (std::int64_t i = 0; i < k; ++i) {
    ASSERT_EQ(idx[i], want[i]);
    ASSERT_EQ(val[i], x[want[i]]);
  }
  std::vector<float> acc(n, 0.f);
  topk_decode_add(p.data(), k, n, acc.data());
  EXPECT_EQ(acc[want[0]], x[want[0]]);
  std::vector<std::uint8_t> bad = p;
  reinterpret_cast<std::int32_t*>(bad.data())[0] = 5000;
  EXPECT_THROW(topk_decode_add(bad.data(), k, n, acc.data()), ValueError);
}

TEST(CodecPowerSgd, GramSchmidtGivesOrthonormalColumns) {
  const std::int64_t rows = 40, cols = 4;
  std::vector<float> m = randn(rows * cols, 6);
  gram_schmidt(m.data(), rows, cols);
  for (std::int64_t a = 0; a < cols; ++a)
    for (std::int64_t b = 0; b < cols; ++b) {
      double dot = 0;
      for (std::int64_t r = 0; r < rows; ++r) dot += double(m[r * cols + a]) * m[r * cols + b];
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-5);
    }
}

}  // namespace
}  // namespace mapp::codec
