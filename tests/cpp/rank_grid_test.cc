#include "mapp/topology/rank_grid.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "mapp/common/check.h"

namespace mapp {
namespace {

struct Config {
  int world, tp, pp, dp;
};

// Every (tp, pp, dp) whose product is a world size up to 16.
std::vector<Config> all_configs() {
  std::vector<Config> out;
  for (int world = 1; world <= 16; ++world)
    for (int tp = 1; tp <= world; ++tp)
      for (int pp = 1; pp <= world; ++pp)
        if (world % (tp * pp) == 0) out.push_back({world, tp, pp, world / (tp * pp)});
  return out;
}

const std::vector<std::vector<Axis>> kAxisSets = {
    {Axis::kTensor}, {Axis::kData}, {Axis::kPipeline},
    {Axis::kTensor, Axis::kPipeline},  // model-parallel group
    {Axis::kTensor, Axis::kData}, {Axis::kData, Axis::kPipeline}};

TEST(RankGrid, MegatronOrderForEveryConfig) {
  for (const Config& c : all_configs()) {
    RankGrid grid(c.world, c.tp, c.pp);
    ASSERT_EQ(grid.dp(), c.dp);
    for (int pp = 0; pp < c.pp; ++pp)
      for (int dp = 0; dp < c.dp; ++dp)
        for (int tp = 0; tp < c.tp; ++tp) {
          const int rank = pp * c.dp * c.tp + dp * c.tp + tp;  // Megatron's formula
          EXPECT_EQ(grid.rank(Coord{tp, 0, dp, pp}), rank);
          EXPECT_EQ(grid.coord(rank), (Coord{tp, 0, dp, pp}));
        }
  }
}

TEST(RankGrid, GroupsPartitionTheWorldForEveryConfig) {
  for (const Config& c : all_configs()) {
    RankGrid grid(c.world, c.tp, c.pp);
    for (const auto& axes : kAxisSets) {
      int expected_size = 1;
      for (Axis a : axes) expected_size *= grid.size(a);
      std::multiset<int> covered;
      for (const auto& g : grid.groups(axes)) {
        ASSERT_EQ(static_cast<int>(g.size()), expected_size);
        for (int r : g) {
          covered.insert(r);
          // Members differ from each other only along `axes`.
          EXPECT_EQ(grid.group(r, axes), g);
          const Coord a = grid.coord(r), b = grid.coord(g.front());
          for (int i = 0; i < kNumAxes; ++i) {
            const Axis axis = static_cast<Axis>(i);
            bool free = false;
            for (Axis x : axes) free |= (x == axis);
            if (!free) EXPECT_EQ(a.get(axis), b.get(axis));
          }
        }
      }
      ASSERT_EQ(static_cast<int>(covered.size()), c.world);
      for (int r = 0; r < c.world; ++r) EXPECT_EQ(covered.count(r), 1u);
    }
  }
}

TEST(RankGrid, ConcreteGroupsOfEightRanks) {
  RankGrid grid(8, /*tp=*/2, /*pp=*/2);  // dp = 2
  EXPECT_EQ(grid.groups({Axis::kTensor}),
            (std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(grid.groups({Axis::kData}),
            (std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(grid.groups({Axis::kPipeline}),
            (std::vector<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(grid.embedding_group(6), (std::vector<int>{2, 6}));
  EXPECT_EQ(RankGrid(4, 2, 1).embedding_group(3), (std::vector<int>{3}));
}

TEST(RankGrid, ContextAxisSitsBetweenTensorAndData) {
  RankGrid grid(16, /*tp=*/2, /*pp=*/2, /*dp=*/2, /*cp=*/2);
  EXPECT_EQ(grid.rank(Coord{1, 1, 1, 1}), ((1 * 2 + 1) * 2 + 1) * 2 + 1);
  EXPECT_EQ(grid.group(0, {Axis::kContext}), (std::vector<int>{0, 2}));
}

// Megatron-Core's expert layout: ep carved out of dp, ep varying fastest.
TEST(RankGrid, ExpertGroupsCarvedOutOfData) {
  RankGrid grid(16, /*tp=*/2, /*pp=*/2, /*dp=*/4, /*cp=*/1, /*ep=*/2);
  EXPECT_EQ(grid.edp(), 2);
  // rank 0: tp0 dp0 pp0; its dp group is {0, 2, 4, 6}.
  EXPECT_EQ(grid.expert_group(0), (std::vector<int>{0, 2}));
  EXPECT_EQ(grid.expert_data_group(0), (std::vector<int>{0, 4}));
  EXPECT_EQ(grid.expert_group(13), (std::vector<int>{13, 15}));  // tp1 dp2 pp1
  EXPECT_EQ(grid.expert_data_group(13), (std::vector<int>{9, 13}));
  EXPECT_EQ(grid.ep_rank(6), 1);
  EXPECT_EQ(grid.edp_rank(6), 1);
  for (const auto& gs : {grid.expert_groups(), grid.expert_data_groups()}) {
    std::vector<int> seen(16, 0);
    for (const auto& g : gs)
      for (int r : g) seen[r]++;
    EXPECT_EQ(seen, std::vector<int>(16, 1));
  }
  EXPECT_EQ(grid.expert_groups().size(), 8u);
  // Every expert group lies inside one data group; ep x edp covers it.
  for (int r = 0; r < 16; ++r) {
    const auto dp = grid.group(r, {Axis::kData});
    for (int m : grid.expert_group(r))
      EXPECT_TRUE(std::find(dp.begin(), dp.end(), m) != dp.end());
  }
  // With a context axis the expert ranks come from cp x dp, cp fastest.
  RankGrid with_cp(8, /*tp=*/1, /*pp=*/1, /*dp=*/2, /*cp=*/4, /*ep=*/8);
  EXPECT_EQ(with_cp.expert_group(0), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(with_cp.ep_rank(5), 5);
  EXPECT_EQ(RankGrid(4, 1, 1).expert_group(2), (std::vector<int>{2}));
}

TEST(RankGrid, ExpertTensorParallelSmallerThanTensor) {
  // tp 4 x dp 2, etp 2, ep 4: rank r has tp = r % 4, dp = r / 4 and f = r.
  RankGrid grid(8, /*tp=*/4, /*pp=*/1, /*dp=*/2, /*cp=*/1, /*ep=*/4, /*etp=*/2);
  EXPECT_EQ(grid.etp(), 2);
  EXPECT_EQ(grid.edp(), 1);
  EXPECT_EQ(grid.etp_rank(5), 1);
  EXPECT_EQ(grid.ep_rank(5), 2);
  EXPECT_EQ(grid.expert_group(0), (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(grid.expert_data_group(0), (std::vector<int>{0}));
  EXPECT_EQ(grid.expert_tensor_group(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(grid.expert_token_group(5), (std::vector<int>{5, 7}));
  for (const auto& gs : {grid.expert_groups(), grid.expert_data_groups(),
                         grid.expert_tensor_groups(), grid.expert_token_groups()}) {
    std::vector<int> seen(8, 0);
    for (const auto& g : gs)
      for (int r : g) seen[r]++;
    EXPECT_EQ(seen, std::vector<int>(8, 1));
  }
  // DeepSeek-V3's layout in small: attention over tp 2, experts whole (etp 1)
  // and spread over both tensor ranks.
  RankGrid ds(4, /*tp=*/2, /*pp=*/2, /*dp=*/1, /*cp=*/1, /*ep=*/2, /*etp=*/1);
  EXPECT_EQ(ds.expert_group(2), (std::vector<int>{2, 3}));
  EXPECT_EQ(ds.expert_tensor_group(3), (std::vector<int>{3}));
  EXPECT_EQ(ds.expert_token_group(3), (std::vector<int>{2, 3}));
  EXPECT_EQ(ds.describe(), "world 4 = tp 2 x cp 1 x dp 1 x pp 2 (experts: etp 1 x ep 2 x edp 1)");
  // The default (etp = tp) keeps the expert grid inside the data ranks.
  RankGrid same(8, 2, 1, 4, 1, 2);
  EXPECT_EQ(same.etp(), 2);
  EXPECT_EQ(same.expert_tensor_group(3), same.group(3, {Axis::kTensor}));
  EXPECT_EQ(same.expert_token_group(3), (std::vector<int>{3}));
}

void expect_error_mentions(const std::function<void()>& f,
                           const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const ValueError& e) {
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(RankGrid, InvalidConfigsNameEveryFactor) {
  expect_error_mentions([] { RankGrid(6, 4, 1); },
                        {"world size 6", "tensor(4)", "pipeline(1)", "context(1)", "= 4"});
  expect_error_mentions([] { RankGrid(8, 2, 2, 3); },
                        {"world size 8", "tensor(2)", "pipeline(2)", "data(3)", "= 12"});
  expect_error_mentions([] { RankGrid(8, 0, 1); }, {"tensor=0"});
  expect_error_mentions([] { RankGrid(4, 2, 1).coord(4); }, {"rank 4", "[0, 4)"});
  expect_error_mentions([] { RankGrid(4, 2, 1).rank(Coord{2, 0, 0, 0}); }, {"tp coordinate 2"});
  expect_error_mentions([] { RankGrid(8, 4, 1, 0, 1, 1, 3); },
                        {"expert-tensor-parallel size 3", "tensor-parallel size 4"});
  expect_error_mentions([] { RankGrid(8, 2, 1, 0, 1, 3); },
                        {"expert-model-parallel size 3", "data(4)", "divides 4"});
  EXPECT_THROW(parse_axis("xp"), ValueError);
}

}  // namespace
}  // namespace mapp
