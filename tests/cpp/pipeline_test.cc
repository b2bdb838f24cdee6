// Pipeline schedules: generators, validator, simulator (against closed forms),
// dynamic planner, import/export.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "mapp/common/check.h"
#include "mapp/pipeline/schedule.h"

namespace pl = mapp::pipeline;
using pl::ActionType;

namespace {

double bubble_time(const pl::SimResult& r) {
  double busy = 0;
  for (double b : r.busy) busy += b;
  return r.makespan * static_cast<double>(r.busy.size()) - busy;
}

int max_peak(const pl::Schedule& s) {
  int peak = 0;
  for (int st = 0; st < s.stages; ++st) peak = std::max(peak, s.peak_activations(st));
  return peak;
}

}  // namespace

TEST(PipelineSchedule, GeneratorsAreValid) {
  for (int p : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 4, 8, 9}) {
      for (const auto& s : {pl::gpipe(p, m), pl::one_f_one_b(p, m), pl::zero_bubble(p, m)}) {
        EXPECT_EQ(pl::validate(s), "") << s.name << " p=" << p << " m=" << m;
      }
      if (p > 1) {
        for (int v : {2, 3}) {
          if (m % p == 0) EXPECT_EQ(pl::validate(pl::interleaved(p, m, v)), "");
          for (auto pol : {pl::Policy::kDepthFirst, pl::Policy::kBreadthFirst, pl::Policy::kAuto,
                           pl::Policy::kAdaptive}) {
            const auto s = pl::dynamic(p, m, v, pol);
            EXPECT_EQ(pl::validate(s), "") << s.name << " p=" << p << " m=" << m << " v=" << v;
          }
        }
      }
    }
  }
}

TEST(PipelineSimulator, GPipeAnd1F1BBubbleMatchesClosedForm) {
  for (int p : {2, 4, 8}) {
    for (int m : {1, 4, 8, 16}) {
      const double expect = double(p - 1) / (m + p - 1);
      for (const auto& s : {pl::gpipe(p, m), pl::one_f_one_b(p, m)}) {
        for (double f : {1.0, 0.5}) {  // any forward/backward ratio
          const auto r = pl::simulate(s, pl::Costs::uniform(p, f, 1.0, 1.0));
          EXPECT_NEAR(r.bubble_fraction, expect, 1e-12) << s.name << " p=" << p << " m=" << m;
          EXPECT_NEAR(r.makespan, (m + p - 1) * (f + 2.0), 1e-9);
        }
      }
    }
  }
}

TEST(PipelineSimulator, InterleavedBubbleMatchesClosedForm) {
  for (int p : {2, 4}) {
    for (int v : {1, 2, 3}) {
      for (int m : {p, 2 * p, 4 * p}) {
        const auto s = pl::interleaved(p, m, v);
        const auto r = pl::simulate(s, pl::Costs::uniform(p, 1.0, 1.0, 1.0));
        EXPECT_NEAR(r.bubble_fraction, double(p - 1) / (v * m + p - 1), 1e-12)
            << "p=" << p << " m=" << m << " v=" << v;
      }
    }
  }
}

TEST(PipelineSimulator, ZeroBubbleH1HasAThirdOf1F1BBubble) {
  for (int p : {2, 4, 8}) {
    for (int m : {p, 2 * p, 3 * p + 1}) {
      const auto c = pl::Costs::uniform(p, 1.0, 1.0, 1.0);
      const auto zb = pl::simulate(pl::zero_bubble(p, m), c);
      const auto ofob = pl::simulate(pl::one_f_one_b(p, m), c);
      EXPECT_LE(bubble_time(zb), bubble_time(ofob) / 3.0 + 1e-9) << "p=" << p << " m=" << m;
      // ... with the peak memory of 1F1B (its first stage's, on every stage).
      EXPECT_EQ(*std::max_element(zb.peak_activations.begin(), zb.peak_activations.end()),
                ofob.peak_activations[0]);
    }
  }
}

TEST(PipelineSimulator, PeakActivationsAndP2P) {
  const int p = 4, m = 8;
  const auto r = pl::simulate(pl::one_f_one_b(p, m), pl::Costs::uniform(p));
  EXPECT_EQ(r.peak_activations, (std::vector<int>{4, 3, 2, 1}));
  EXPECT_EQ(max_peak(pl::gpipe(p, m)), m);
  // One transfer of time d on each of the p-1 links: the critical path of
  // the first microbatch gains (p-1) d forward and (p-1) d backward.
  const double d = 0.25;
  const auto slow = pl::simulate(pl::gpipe(p, 1), pl::Costs::uniform(p, 1, 1, 1, d));
  EXPECT_NEAR(slow.makespan, p * 3.0 + 2 * (p - 1) * d, 1e-12);
  // Link contention: back-to-back messages on one link queue behind each other.
  const auto c = pl::Costs::uniform(2, 0.1, 0.1, 0.1, 1.0);
  const auto g = pl::simulate(pl::gpipe(2, 3), c);
  // Activations of mb 0,1,2 leave at 0.1, 0.2, 0.3 but arrive at 1.1, 2.1, 3.1.
  // Stage 1 ends its backwards at 3.8; gradients leave at 3.4, 3.6, 3.8 and
  // arrive at 4.4, 5.4, 6.4; the last backward on stage 0 ends at 6.6.
  EXPECT_NEAR(g.makespan, 6.6, 1e-9);
}

TEST(PipelineValidator, RejectsBrokenSchedulesNamingTheAction) {
  auto s = pl::one_f_one_b(2, 2);
  // Backward before forward.
  {
    auto b = s;
    auto& l = b.actions[1];
    auto f = std::find_if(l.begin(), l.end(),
                          [](const pl::Action& a) { return a.type == ActionType::kForward; });
    auto bw = std::find_if(l.begin(), l.end(),
                           [](const pl::Action& a) { return a.type == ActionType::kBackward; });
    std::iter_swap(f, bw);
    EXPECT_NE(pl::validate(b).find("B(mb=0, chunk=0): backward before the forward"),
              std::string::npos)
        << pl::validate(b);
  }
  // A send without its receive.
  {
    auto b = s;
    auto& l = b.actions[1];
    l.erase(std::find_if(l.begin(), l.end(), [](const pl::Action& a) {
      return a.type == ActionType::kRecvActivation && a.microbatch == 1;
    }));
    const auto e = pl::validate(b);
    EXPECT_NE(e.find("F(mb=1, chunk=0): its input is never received"), std::string::npos) << e;
  }
  // Missing W after BI.
  {
    auto b = pl::zero_bubble(2, 2);
    auto& l = b.actions[0];
    l.erase(std::find_if(l.begin(), l.end(), [](const pl::Action& a) {
      return a.type == ActionType::kBackwardWeight;
    }));
    EXPECT_NE(pl::validate(b).find("never runs W of microbatch"), std::string::npos);
  }
  // W before BI.
  {
    pl::Schedule b;
    b.name = "hand";
    b.stages = 1;
    b.microbatches = 1;
    b.actions = {{{ActionType::kForward, 0, 0, -1},
                  {ActionType::kBackwardWeight, 0, 0, -1},
                  {ActionType::kBackwardInput, 0, 0, -1}}};
    EXPECT_NE(pl::validate(b).find("stage 0, action #1 W(mb=0, chunk=0): weight gradient before"),
              std::string::npos);
    EXPECT_THROW(pl::check_valid(b), mapp::ValueError);
  }
  // Deadlock: stage 0 runs 1F1B with no warm-up, stage 1 forwards both first.
  {
    pl::Schedule b;
    b.name = "hand";
    b.stages = 2;
    b.microbatches = 2;
    using A = pl::Action;
    b.actions = {{A{ActionType::kForward, 0}, A{ActionType::kBackward, 0},
                  A{ActionType::kForward, 1}, A{ActionType::kBackward, 1}},
                 {A{ActionType::kForward, 0}, A{ActionType::kForward, 1},
                  A{ActionType::kBackward, 0}, A{ActionType::kBackward, 1}}};
    pl::add_communication(b);
    const auto e = pl::validate(b);
    EXPECT_EQ(e.rfind("deadlock: stage 0", 0), 0u) << e;
    EXPECT_NE(e.find("B(mb=0, chunk=0) waits for a gradient from stage 1"), std::string::npos) << e;
    EXPECT_NE(e.find("F(mb=1, chunk=0) waits for an activation from stage 0"), std::string::npos)
        << e;
  }
  // Wrong peer.
  {
    auto b = pl::one_f_one_b(3, 3);
    for (auto& a : b.actions[1]) {
      if (a.type == ActionType::kSendActivation) {
        a.peer = 0;
        break;
      }
    }
    EXPECT_NE(pl::validate(b).find("peer must be stage 2"), std::string::npos);
  }
}

TEST(PipelineDynamic, DepthFirstKeeps1F1BMemory) {
  for (int p : {2, 4}) {
    for (int v : {1, 2}) {
      for (int m : {p, 2 * p}) {
        const auto dfc = pl::dynamic(p, m, v, pl::Policy::kDepthFirst);
        const auto ref = v == 1 ? pl::one_f_one_b(p, m) : pl::interleaved(p, m, v);
        EXPECT_LE(max_peak(dfc), max_peak(ref));
        EXPECT_EQ(max_peak(pl::dynamic(p, m, v, pl::Policy::kBreadthFirst)), m * v);
        EXPECT_LE(max_peak(pl::dynamic(p, m, v, pl::Policy::kAuto, 3)), 3);
      }
    }
  }
}

TEST(PipelineDynamic, AdaptiveNeverPredictedSlowerThan1F1BAndWinsUnderSlowdown) {
  const int p = 4, m = 8;
  for (int slow = 0; slow < p; ++slow) {
    auto c = pl::Costs::uniform(p, 1.0, 1.0, 1.0, 0.1);
    c.forward[slow] *= 1.5;
    c.backward_input[slow] *= 1.5;
    c.backward_weight[slow] *= 1.5;
    const auto ada = pl::dynamic(p, m, 1, pl::Policy::kAdaptive, {}, c);
    const double t_ada = pl::simulate(ada, c).makespan;
    const double t_1f1b = pl::simulate(pl::one_f_one_b(p, m), c).makespan;
    EXPECT_LE(t_ada, t_1f1b) << ada.name;
    EXPECT_GE(t_1f1b / t_ada, 1.05) << "slow stage " << slow << ": " << ada.name;
    EXPECT_LE(max_peak(ada), p);
  }
  // A slow link.
  auto c = pl::Costs::uniform(p, 1.0, 1.0, 1.0, 0.1);
  c.p2p[1] = 1.5;
  const auto ada = pl::dynamic(p, m, 1, pl::Policy::kAdaptive, {}, c);
  EXPECT_LT(pl::simulate(ada, c).makespan, pl::simulate(pl::one_f_one_b(p, m), c).makespan);
}

TEST(PipelineSchedule, BadInputIsRejected) {
  EXPECT_THROW(pl::interleaved(4, 6, 2), mapp::ValueError);  // m not a multiple of p
  EXPECT_THROW(pl::one_f_one_b(0, 4), mapp::ValueError);
  EXPECT_THROW(pl::dynamic(1, 4, 2, pl::Policy::kAuto), mapp::ValueError);
  EXPECT_THROW(pl::parse_policy("greedy"), mapp::ValueError);
  EXPECT_THROW(pl::dynamic(2, 4, 1, pl::Policy::kAuto, 0), mapp::ValueError);
  auto c = pl::Costs::uniform(3);
  EXPECT_THROW(pl::simulate(pl::one_f_one_b(4, 4), c), mapp::ValueError);
  try {
    pl::interleaved(4, 6, 2);
  } catch (const mapp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("must be a multiple of the pipeline size (4)"),
              std::string::npos);
  }
}

TEST(PipelineIO, RoundTripsAndRejectsMalformedInput) {
  for (const auto& s : {pl::interleaved(2, 4, 2), pl::zero_bubble(3, 5)}) {
    const auto c = pl::from_csv(pl::to_csv(s));
    const auto j = pl::from_json(pl::to_json(s));
    EXPECT_EQ(c.actions, s.actions);
    EXPECT_EQ(j.actions, s.actions);
    EXPECT_EQ(j.chunks, s.chunks);
    EXPECT_EQ(c.name, s.name);
  }
  // Hand-written compute-only CSV gets its communication.
  const std::string hand =
      "# megatronapp schedule name=mine stages=2 microbatches=1 chunks=1\n"
      "stage,type,microbatch,chunk\n0,F,0,0\n1,F,0,0\n1,B,0,0\n0,B,0,0\n";
  const auto h = pl::from_csv(hand);
  EXPECT_TRUE(h.has_communication());
  EXPECT_EQ(pl::validate(h), "");
  auto expect_error = [](const std::string& text, const std::string& fragment, bool json) {
    try {
      json ? pl::from_json(text) : pl::from_csv(text);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const mapp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_error("stage,type,microbatch,chunk\n", "stages, microbatches and chunks", false);
  expect_error(
      "# megatronapp schedule stages=1 microbatches=1 "
      "chunks=1\nstage,type,microbatch,chunk\n0,X,0,0\n",
      "unknown pipeline action type 'X'", false);
  expect_error(
      "# megatronapp schedule stages=1 microbatches=1 "
      "chunks=1\nstage,type,microbatch,chunk\n0,F,zero,0\n",
      "line 3: microbatch must be an integer", false);
  expect_error(
      "# megatronapp schedule stages=1 microbatches=1 "
      "chunks=1\nstage,type,microbatch,chunk\n5,F,0,0\n",
      "stage 5 out of range", false);
  expect_error(
      "# megatronapp schedule stages=1 microbatches=1 "
      "chunks=1\nstage,type,microbatch,chunk\n0,F,0,0\n",
      "never runs B", false);
  expect_error("{", "does not parse", true);
  expect_error("[]", "top level must be an object", true);
  expect_error(R"({"stages":1,"microbatches":1,"actions":[[{"type":"F","microbatch":"0"}]]})",
               "field 'microbatch' must be an integer", true);
  expect_error(R"({"stages":2,"microbatches":1,"actions":[[]]})", "one list per stage", true);
  expect_error(R"({"stages":1,"microbatches":1,"actions":[[{"type":"F","microbatch":3}]]})",
               "microbatch must lie in [0, 1)", true);
}

TEST(PipelineSimulator, ChromeTraceIsWellFormed) {
  const auto s = pl::interleaved(2, 2, 2);
  const auto r = pl::simulate(s, pl::Costs::uniform(2, 1, 1, 1, 0.1));
  const auto json = pl::chrome_trace(s, r);
  EXPECT_EQ(json.rfind("{\"displayTimeUnit\"", 0), 0u);
  EXPECT_NE(json.find("\"name\":\"F1.1\""), std::string::npos);
  EXPECT_NE(json.find("\"send activations\""), std::string::npos);
}

// ZB-V: two chunks per stage in a V; stage 0 holds the first and the last
// virtual stage and stage p-1 turns the microbatch around without a transfer.
TEST(PipelineZBV, WavePlacementIsValidAndHandsOffLocally) {
  for (int p : {2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 4, 8, 9}) {
      const auto s = pl::zb_v(p, m);
      ASSERT_EQ(pl::validate(s), "") << "p=" << p << " m=" << m;
      EXPECT_EQ(s.placement, pl::Placement::kWave);
      EXPECT_EQ(s.chunks, 2);
      EXPECT_EQ(s.vstage(0, 0), 0);
      EXPECT_EQ(s.vstage(0, 1), 2 * p - 1);
      EXPECT_EQ(s.vstage(p - 1, 1), p);
      for (int vs = 0; vs < 2 * p; ++vs) EXPECT_EQ(s.vstage(s.stage_of(vs), s.chunk_of(vs)), vs);
      // Sends per stage: m activations and m gradients leave each end stage
      // (stage p-1 hands the turn to itself), twice that from a middle stage.
      for (int st = 0; st < p; ++st) {
        int sends = 0;
        for (const auto& a : s.actions[st])
          sends += a.type == ActionType::kSendActivation || a.type == ActionType::kSendGrad;
        EXPECT_EQ(sends, (st == 0 || st == p - 1 ? 2 : 4) * m) << "p=" << p << " stage " << st;
      }
    }
  }
}

TEST(PipelineZBV, ReachesTheLowerBoundWithinOneF1BMemory) {
  for (int p : {2, 3, 4, 8}) {
    for (int m = 1; m <= 3 * p + 1; ++m) {
      const auto zbv = pl::simulate(pl::zb_v(p, m), pl::Costs::uniform(p, 1, 1, 1));
      // The same model as one chunk per stage: every action costs twice.
      const auto c2 = pl::Costs::uniform(p, 2, 2, 2);
      const auto h1 = pl::simulate(pl::zero_bubble(p, m), c2);
      const auto ofob = pl::simulate(pl::one_f_one_b(p, m), c2);
      EXPECT_LE(zbv.makespan, h1.makespan) << "p=" << p << " m=" << m;
      if (m == p || m == 2 * p) {
        // The last stage cannot start before p-1 forwards of one chunk; after
        // that the step is all compute, and ZB-H1's bubble is halved.
        EXPECT_NEAR(zbv.makespan, 6.0 * m + (p - 1), 1e-9) << "p=" << p << " m=" << m;
        EXPECT_NEAR(bubble_time(zbv), bubble_time(h1) / 2, 1e-9) << "p=" << p << " m=" << m;
      }
      // Memory: at most 1F1B's first stage (p microbatches of a whole stage,
      // i.e. 2p chunk activations) on every stage.
      for (int peak : zbv.peak_activations) EXPECT_LE(peak, 2 * ofob.peak_activations[0]);
    }
  }
  // Planned under measured costs: a slow last stage still beats ZB-H1.
  pl::Costs slow = pl::Costs::uniform(4, 1, 1, 1, 0.05);
  slow.forward[3] = slow.backward_input[3] = slow.backward_weight[3] = 1.5;
  pl::Costs slow2 = slow;
  for (auto* v : {&slow2.forward, &slow2.backward_input, &slow2.backward_weight})
    for (double& x : *v) x *= 2;
  EXPECT_LT(pl::simulate(pl::zb_v(4, 8, slow), slow).makespan,
            pl::simulate(pl::zero_bubble(4, 8), slow2).makespan);
}

TEST(PipelineZBV, RoundTripsAndRejectsTransfersInsideAStage) {
  const auto s = pl::zb_v(3, 4);
  for (const auto& t : {pl::from_csv(pl::to_csv(s)), pl::from_json(pl::to_json(s))}) {
    EXPECT_EQ(t.placement, pl::Placement::kWave);
    EXPECT_EQ(t.actions, s.actions);
  }
  EXPECT_NE(pl::to_csv(s).find("placement=wave"), std::string::npos);
  // Stage 1 of 2 holds virtual stages 1 and 2 (the turn): a send between
  // them is refused.
  pl::Schedule bad{"bad", 2, 1, 2, {{}, {}}, pl::Placement::kWave};
  bad.actions[0] = {{ActionType::kForward, 0, 0, -1},      {ActionType::kSendActivation, 0, 0, 1},
                    {ActionType::kRecvActivation, 0, 1, 1}, {ActionType::kForward, 0, 1, -1},
                    {ActionType::kBackward, 0, 1, -1},     {ActionType::kSendGrad, 0, 1, 1},
                    {ActionType::kRecvGrad, 0, 0, 1},      {ActionType::kBackward, 0, 0, -1}};
  bad.actions[1] = {{ActionType::kRecvActivation, 0, 0, 0}, {ActionType::kForward, 0, 0, -1},
                    {ActionType::kSendActivation, 0, 0, 1}};
  EXPECT_NE(pl::validate(bad).find("two chunks of one stage hand off"), std::string::npos)
      << pl::validate(bad);
  // A chunk that consumes its neighbour's hand-off before it is produced.
  pl::Schedule early{"early", 2, 1, 2, {{}, {}}, pl::Placement::kWave};
  early.actions[0] = {{ActionType::kForward, 0, 0, -1}, {ActionType::kForward, 0, 1, -1},
                      {ActionType::kBackward, 0, 1, -1}, {ActionType::kBackward, 0, 0, -1}};
  early.actions[1] = {{ActionType::kForward, 0, 1, -1}, {ActionType::kForward, 0, 0, -1},
                      {ActionType::kBackward, 0, 0, -1}, {ActionType::kBackward, 0, 1, -1}};
  pl::add_communication(early);
  EXPECT_NE(pl::validate(early).find("comes from this stage's own chunk"), std::string::npos)
      << pl::validate(early);
  EXPECT_THROW(pl::parse_placement("zigzag"), mapp::ValueError);
}

// --pipeline-schedule names: what each resolves to, and the clear errors.
TEST(PipelineSchedule, ByNameResolvesTheFlagNames) {
  EXPECT_EQ(pl::by_name("gpipe", 2, 4).actions, pl::gpipe(2, 4).actions);
  EXPECT_EQ(pl::by_name("1f1b", 2, 4).actions, pl::one_f_one_b(2, 4).actions);
  EXPECT_EQ(pl::by_name("1f1b", 2, 4, 2).actions, pl::interleaved(2, 4, 2).actions);
  EXPECT_EQ(pl::by_name("zero-bubble", 2, 4).actions, pl::zero_bubble(2, 4).actions);
  EXPECT_EQ(pl::by_name("zb-v", 2, 4, 2).actions, pl::zb_v(2, 4).actions);
  EXPECT_EQ(pl::by_name("dynamic", 2, 4, 1, "dfc").actions,
            pl::dynamic(2, 4, 1, pl::Policy::kDepthFirst).actions);
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const mapp::ValueError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] { pl::by_name("2f2b", 2, 4); }).find("unknown pipeline schedule '2f2b'"),
            std::string::npos);
  EXPECT_NE(message([] { pl::by_name("zb-v", 2, 4, 1); }).find("two model chunks"),
            std::string::npos);
  EXPECT_NE(message([] { pl::by_name("gpipe", 2, 4, 2); }).find("one model chunk per stage"),
            std::string::npos);
  EXPECT_NE(message([] { pl::by_name("dynamic", 2, 4, 1, "fastest"); }).find("policy"),
            std::string::npos);
}
