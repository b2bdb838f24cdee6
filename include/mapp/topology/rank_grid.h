// RankGrid: the pure math of the hybrid-parallel rank grid.
//
// A world of N ranks is viewed as a 4-D array with axes, from fastest to
// slowest varying (Megatron-LM's default order "tp-cp-dp-pp"):
//
//     rank = ((pp * DP + dp) * CP + cp) * TP + tp
//
// so with CP = 1 this is Megatron's  rank = pp_rank*dp*tp + dp_rank*tp + tp_rank.
// Tensor-parallel peers are adjacent ranks (same node, fastest links), pipeline
// stages are the furthest apart. A *group along a set of axes* is the set of
// ranks that share every coordinate except those axes: the tensor group of a
// rank varies only tp, the model-parallel group varies tp and pp, and so on.
// Every group along the same axes partitions the world.
//
// Invariants: tp, cp, pp, dp >= 1 and tp*cp*pp*dp == world_size.
//
// Expert parallelism (Megatron-Core's "tp-ep-dp" expert grid): the ranks of
// one pipeline stage are regrouped for the experts as etp x ep x edp, expert
// tensor parallelism (ETP, which divides TP) fastest. With the stage-local
// index f = (dp * CP + cp) * TP + tp (the order in which the stage's ranks
// appear in the world) and j = f / ETP:
//
//     etp_rank = tp % ETP,   ep_rank = j % EP,   edp_rank = j / EP
//
// With ETP = TP (the default) j = dp * CP + cp: the expert-parallel peers are
// adjacent data-parallel ranks with the same tensor rank. With ETP < TP the
// TP / ETP tensor ranks that share an expert shard index (the *expert token
// group*: each routes its own slice of the tokens) join the expert grid as
// well. Dense parameters are replicated over the cp x dp ranks; an expert
// shard over its edp ranks only. Invariants: ETP divides TP, EP divides
// (TP / ETP) * CP * DP.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mapp {

enum class Axis : std::uint8_t { kTensor = 0, kContext = 1, kData = 2, kPipeline = 3 };
inline constexpr int kNumAxes = 4;

// Short names used in messages and Python: "tp", "cp", "dp", "pp".
const char* axis_name(Axis axis);
// Parses "tp"/"cp"/"dp"/"pp"; throws ValueError.
Axis parse_axis(const std::string& name);

struct Coord {
  int tp = 0;
  int cp = 0;
  int dp = 0;
  int pp = 0;
  int get(Axis axis) const;
  bool operator==(const Coord& o) const {
    return tp == o.tp && cp == o.cp && dp == o.dp && pp == o.pp;
  }
};

class RankGrid {
 public:
  // dp = 0 infers the data-parallel size as world / (tp*cp*pp). Throws
  // ValueError naming every factor when the sizes do not multiply to the world.
  // ep: the expert-parallel size; etp: the expert-tensor-parallel size (0:
  // equal to tp). ValueError unless etp divides tp and ep divides
  // (tp / etp) * cp * dp.
  RankGrid(int world_size, int tp, int pp, int dp = 0, int cp = 1, int ep = 1, int etp = 0);

  int world_size() const { return world_size_; }
  int size(Axis axis) const { return sizes_[static_cast<int>(axis)]; }
  int tp() const { return size(Axis::kTensor); }
  int cp() const { return size(Axis::kContext); }
  int dp() const { return size(Axis::kData); }
  int pp() const { return size(Axis::kPipeline); }
  int ep() const { return ep_; }
  int etp() const { return etp_; }
  int edp() const { return tp() / etp_ * cp() * dp() / ep_; }  // expert-data-parallel size

  // Expert-tensor, expert-parallel and expert-data-parallel coordinates of a
  // global rank.
  int etp_rank(int rank) const;
  int ep_rank(int rank) const;
  int edp_rank(int rank) const;
  // The ranks that shard the experts with `rank` (size ep), and those holding
  // the same experts (size edp, the group expert gradients are reduced over).
  std::vector<int> expert_group(int rank) const;
  std::vector<int> expert_data_group(int rank) const;
  // Every expert (expert-data) group, ordered by smallest rank.
  std::vector<std::vector<int>> expert_groups() const;
  std::vector<std::vector<int>> expert_data_groups() const;
  // The ranks holding the other shards of `rank`'s experts (size etp; the
  // tensor group when etp == tp), and the tensor ranks routing the other
  // slices of `rank`'s tokens (size tp / etp, same etp_rank).
  std::vector<int> expert_tensor_group(int rank) const;
  std::vector<int> expert_token_group(int rank) const;
  std::vector<std::vector<int>> expert_tensor_groups() const;
  std::vector<std::vector<int>> expert_token_groups() const;

  // Coordinates of a global rank, and back. Throw ValueError when out of range.
  Coord coord(int rank) const;
  int rank(const Coord& c) const;

  // Ranks sharing every coordinate of `rank` except those along `axes`,
  // ascending. group(r, {kTensor}) is r's tensor-parallel group.
  std::vector<int> group(int rank, const std::vector<Axis>& axes) const;
  // Every group along `axes`, ordered by their smallest rank; they partition
  // [0, world_size).
  std::vector<std::vector<int>> groups(const std::vector<Axis>& axes) const;

  // Ranks holding the first and the last pipeline stage for `rank`'s (tp, cp,
  // dp) position (the embedding group when input and output embeddings are
  // tied); a single rank when pp == 1.
  std::vector<int> embedding_group(int rank) const;

  // "world 8 = tp 2 x cp 1 x dp 2 x pp 2" (+ " (experts: etp 1 x ep 4 x edp 1)"
  // when ep > 1 or etp != tp).
  std::string describe() const;

 private:
  int world_size_;
  std::array<int, kNumAxes> sizes_;  // indexed by Axis
  int ep_ = 1;
  int etp_ = 1;

  // The stage-local index f of a rank (see above).
  int stage_index(int rank) const;
  // Ranks of rank's pipeline stage whose stage-local index f satisfies keep(f).
  template <typename Keep>
  std::vector<int> stage_ranks(int rank, Keep&& keep) const;
  // The groups `group_of(r)` of every rank, each once, ordered by smallest rank.
  std::vector<std::vector<int>> partition(const std::function<std::vector<int>(int)>& group_of) const;
};

}  // namespace mapp
