#include <gtest/gtest.h>

#include <vector>

#include "mapp/common/check.h"
#include "mapp/moe/dispatch.h"

namespace mapp::moe {
namespace {

TEST(MoePlan, SortsByExpertKeepsTokenOrderAndDropsPastCapacity) {
  // 4 tokens, top-2, 3 experts; token 2's second choice not routed.
  const std::vector<std::int64_t> idx{0, 1, 1, 2, 2, -1, 1, 0};
  const RoutePlan p = plan_routes(idx.data(), 4, 2, 3, /*capacity=*/2, /*pad=*/false);
  EXPECT_EQ(p.kept_per_expert, (std::vector<std::int64_t>{2, 2, 2}));
  EXPECT_EQ(p.dropped_by_capacity, 1);  // expert 1's third assignment (token 3)
  EXPECT_EQ(p.row_of, (std::vector<std::int64_t>{0, 2, 3, 4, 5, -1, -1, 1}));
  EXPECT_EQ(p.assignment_of, (std::vector<std::int64_t>{0, 7, 1, 2, 3, 4}));
  const RoutePlan padded = plan_routes(idx.data(), 4, 2, 3, 3, true);
  EXPECT_EQ(padded.rows(), 9);
  EXPECT_EQ(padded.assignment_of[2], -1);  // expert 0 holds 2 rows + 1 padding
}

TEST(MoePlan, GatherCombineAndWeightGradsFollowThePlan) {
  const std::vector<std::int64_t> idx{1, 0, 0, -1};  // 2 tokens, top-2, 2 experts
  const RoutePlan p = plan_routes(idx.data(), 2, 2, 2, -1, false);
  const std::vector<float> x{1, 2, 3, 4};  // h = 2
  std::vector<float> rows(p.rows() * 2);
  gather_rows(p, reinterpret_cast<const std::byte*>(x.data()), 2 * sizeof(float),
              reinterpret_cast<std::byte*>(rows.data()));
  EXPECT_EQ(rows, (std::vector<float>{1, 2, 3, 4, 1, 2}));  // expert 0: t0, t1; expert 1: t0
  const std::vector<float> w{0.25f, 0.75f, 1.f, 0.f};
  std::vector<float> out(4);
  combine_rows(p, rows.data(), w.data(), 2, out.data());
  EXPECT_EQ(out, (std::vector<float>{1, 2, 3, 4}));
  std::vector<float> gw(4);
  weight_grads(p, x.data(), rows.data(), 2, gw.data());
  EXPECT_EQ(gw, (std::vector<float>{5, 5, 25, 0}));
}

TEST(MoePlan, RegroupOrderTransposesBlocksAndBack) {
  const std::vector<std::int64_t> counts{1, 0, 2, 1};  // [src 0: e0 1, e1 0][src 1: e0 2, e1 1]
  const auto order = regroup_order(counts.data(), 2, 2);
  EXPECT_EQ(order, (std::vector<std::int64_t>{0, 1, 2, 3}));
  const std::vector<std::int64_t> c2{1, 2, 2, 1};
  EXPECT_EQ(regroup_order(c2.data(), 2, 2), (std::vector<std::int64_t>{0, 3, 4, 1, 2, 5}));
}

TEST(MoePlan, BadRoutingIsAClearError) {
  const std::vector<std::int64_t> idx{0, 5};
  EXPECT_THROW(plan_routes(idx.data(), 1, 2, 4, -1, false), ValueError);
  EXPECT_THROW(plan_routes(idx.data(), 1, 2, 8, -1, true), ValueError);  // pad without capacity
}

}  // namespace
}  // namespace mapp::moe
