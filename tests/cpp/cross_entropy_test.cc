#include "mapp/tp/cross_entropy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "mapp/common/check.h"

namespace mapp {
namespace {

// Closed form: cross-entropy of a full row, straight from the definition.
double full_loss(const std::vector<double>& row, std::int64_t target) {
  double z = 0;
  for (double v : row) z += std::exp(v);
  return std::log(z) - row[target];
}

// Splitting the vocabulary into shards and combining their statistics must
// give the loss of the unsplit row, for every shard count that divides V.
TEST(VocabCrossEntropy, ShardedStatsCombineToFullLoss) {
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 3.0);
  const std::int64_t rows = 5, vocab = 24;
  std::vector<double> logits(rows * vocab);
  for (auto& v : logits) v = normal(rng);
  std::vector<std::int64_t> target = {0, 23, 7, 12, 18};
  for (int shards : {1, 2, 3, 4, 6}) {
    const std::int64_t local = vocab / shards;
    std::vector<std::vector<double>> stats(shards, std::vector<double>(rows * 3));
    for (int s = 0; s < shards; ++s) {
      std::vector<double> shard(rows * local);
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t j = 0; j < local; ++j)
          shard[r * local + j] = logits[r * vocab + s * local + j];
      vocab_ce_local_stats(shard.data(), target.data(), rows, local, s * local,
                           stats[s].data());
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      double M = -INFINITY, tsum = 0;
      for (int s = 0; s < shards; ++s) M = std::max(M, stats[s][3 * r]);
      double sum = 0;
      for (int s = 0; s < shards; ++s) {
        sum += stats[s][3 * r + 1] * std::exp(stats[s][3 * r] - M);
        tsum += stats[s][3 * r + 2];
      }
      const std::vector<double> row(logits.begin() + r * vocab,
                                    logits.begin() + (r + 1) * vocab);
      EXPECT_NEAR(M + std::log(sum) - tsum, full_loss(row, target[r]), 1e-12)
          << "shards=" << shards << " row=" << r;
    }
  }
}

TEST(VocabCrossEntropy, TargetOutsideShardContributesZero) {
  const std::vector<float> logits = {1.f, 2.f, 3.f};
  const std::vector<std::int64_t> target = {-100};
  std::vector<float> stats(3);
  vocab_ce_local_stats(logits.data(), target.data(), 1, 3, 0, stats.data());
  EXPECT_FLOAT_EQ(stats[0], 3.f);
  EXPECT_NEAR(stats[1], std::exp(-2.0) + std::exp(-1.0) + 1.0, 1e-6);
  EXPECT_FLOAT_EQ(stats[2], 0.f);
}

TEST(VocabCrossEntropy, LargeLogitsDoNotOverflow) {
  const std::vector<float> logits = {1000.f, 999.f};
  const std::vector<std::int64_t> target = {1};
  std::vector<float> stats(3);
  vocab_ce_local_stats(logits.data(), target.data(), 1, 2, 0, stats.data());
  EXPECT_TRUE(std::isfinite(stats[1]));
  EXPECT_NEAR(stats[1], 1.0 + std::exp(-1.0), 1e-6);
  EXPECT_FLOAT_EQ(stats[2], 999.f);
}

TEST(VocabCrossEntropy, EmptyShardIsRejected) {
  const std::vector<std::int64_t> target = {0};
  float stats[3];
  EXPECT_THROW(vocab_ce_local_stats(static_cast<const float*>(nullptr), target.data(), 1, 0,
                                    0, stats),
               ValueError);
}

}  // namespace
}  // namespace mapp
