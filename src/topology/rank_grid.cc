#include "mapp/topology/rank_grid.h"

#include <algorithm>
#include <sstream>

#include "mapp/common/check.h"

namespace mapp {

const char* axis_name(Axis axis) {
  switch (axis) {
    case Axis::kTensor: return "tp";
    case Axis::kContext: return "cp";
    case Axis::kData: return "dp";
    case Axis::kPipeline: return "pp";
  }
  return "?";
}

Axis parse_axis(const std::string& name) {
  for (int i = 0; i < kNumAxes; ++i) {
    if (name == axis_name(static_cast<Axis>(i))) return static_cast<Axis>(i);
  }
  MAPP_CHECK(false, "unknown axis '", name, "'; use one of tp, cp, dp, pp");
}

int Coord::get(Axis axis) const {
  switch (axis) {
    case Axis::kTensor: return tp;
    case Axis::kContext: return cp;
    case Axis::kData: return dp;
    case Axis::kPipeline: return pp;
  }
  return 0;
}

RankGrid::RankGrid(int world_size, int tp, int pp, int dp, int cp, int ep, int etp)
    : world_size_(world_size), sizes_{tp, cp, dp, pp}, ep_(ep), etp_(etp == 0 ? tp : etp) {
  MAPP_CHECK(world_size >= 1, "world size must be >= 1, got ", world_size);
  MAPP_CHECK(tp >= 1 && pp >= 1 && cp >= 1 && dp >= 0,
             "parallel sizes must be >= 1 (dp may be 0 to infer it): got tensor=", tp,
             " context=", cp, " pipeline=", pp, " data=", dp);
  const long long model = 1LL * tp * cp * pp;
  if (dp == 0) {
    MAPP_CHECK(world_size % model == 0, "world size ", world_size,
               " is not divisible by tensor(", tp, ") x context(", cp, ") x pipeline(",
               pp, ") = ", model,
               "; launch a multiple of that many ranks or change the parallel sizes");
    sizes_[static_cast<int>(Axis::kData)] = static_cast<int>(world_size / model);
  } else {
    MAPP_CHECK(model * dp == world_size, "world size ", world_size,
               " != tensor(", tp, ") x context(", cp, ") x pipeline(", pp,
               ") x data(", dp, ") = ", model * dp,
               "; the four sizes must multiply to the number of ranks");
  }
  MAPP_CHECK(etp_ >= 1 && tp % etp_ == 0, "expert-tensor-parallel size ", etp_,
             " does not divide the tensor-parallel size ", tp,
             ": the experts' shards are split over a subset of one tensor group; choose a "
             "divisor of ", tp);
  const int data = tp / etp_ * this->cp() * this->dp();
  MAPP_CHECK(ep >= 1 && data % ep == 0, "expert-model-parallel size ", ep,
             " does not divide (tensor(", tp, ") / expert-tensor(", etp_, ")) x data(",
             this->dp(), ") x context(", this->cp(), ") = ", data, " (world ", world_size,
             " / (tensor(", tp, ") x pipeline(", pp,
             "))): experts are sharded over the data-parallel ranks (and the tensor ranks "
             "beyond the expert-tensor size); choose an expert-parallel size that divides ",
             data, " or launch more ranks");
}

int RankGrid::stage_index(int rank) const {
  const Coord c = coord(rank);
  return (c.dp * cp() + c.cp) * tp() + c.tp;
}

template <typename Keep>
std::vector<int> RankGrid::stage_ranks(int rank, Keep&& keep) const {
  const int pp_i = coord(rank).pp;
  std::vector<int> out;
  for (int f = 0; f < tp() * cp() * dp(); ++f) {
    if (!keep(f)) continue;
    out.push_back(this->rank(Coord{f % tp(), f / tp() % cp(), f / (tp() * cp()), pp_i}));
  }
  std::sort(out.begin(), out.end());
  return out;
}

int RankGrid::etp_rank(int rank) const { return coord(rank).tp % etp_; }

int RankGrid::ep_rank(int rank) const { return stage_index(rank) / etp_ % ep_; }

int RankGrid::edp_rank(int rank) const { return stage_index(rank) / etp_ / ep_; }

std::vector<int> RankGrid::expert_group(int rank) const {
  const int f0 = stage_index(rank);
  return stage_ranks(rank, [&](int f) {
    return f % etp_ == f0 % etp_ && f / etp_ / ep_ == f0 / etp_ / ep_;
  });
}

std::vector<int> RankGrid::expert_data_group(int rank) const {
  const int f0 = stage_index(rank);
  return stage_ranks(rank, [&](int f) {
    return f % etp_ == f0 % etp_ && f / etp_ % ep_ == f0 / etp_ % ep_;
  });
}

std::vector<int> RankGrid::expert_tensor_group(int rank) const {
  const int f0 = stage_index(rank);
  return stage_ranks(rank, [&](int f) { return f / etp_ == f0 / etp_; });
}

std::vector<int> RankGrid::expert_token_group(int rank) const {
  const int f0 = stage_index(rank);
  return stage_ranks(rank, [&](int f) { return f / tp() == f0 / tp() && f % etp_ == f0 % etp_; });
}

std::vector<std::vector<int>> RankGrid::partition(
    const std::function<std::vector<int>(int)>& group_of) const {
  std::vector<std::vector<int>> out;
  std::vector<bool> seen(world_size_, false);
  for (int r = 0; r < world_size_; ++r) {
    if (seen[r]) continue;
    auto g = group_of(r);
    for (int m : g) seen[m] = true;
    out.push_back(std::move(g));
  }
  return out;
}

std::vector<std::vector<int>> RankGrid::expert_groups() const {
  return partition([this](int r) { return expert_group(r); });
}

std::vector<std::vector<int>> RankGrid::expert_data_groups() const {
  return partition([this](int r) { return expert_data_group(r); });
}

std::vector<std::vector<int>> RankGrid::expert_tensor_groups() const {
  return partition([this](int r) { return expert_tensor_group(r); });
}

std::vector<std::vector<int>> RankGrid::expert_token_groups() const {
  return partition([this](int r) { return expert_token_group(r); });
}

Coord RankGrid::coord(int rank) const {
  MAPP_CHECK(rank >= 0 && rank < world_size_, "rank ", rank, " is outside [0, ",
             world_size_, ")");
  Coord c;
  int r = rank;
  c.tp = r % tp();
  r /= tp();
  c.cp = r % cp();
  r /= cp();
  c.dp = r % dp();
  c.pp = r / dp();
  return c;
}

int RankGrid::rank(const Coord& c) const {
  for (int i = 0; i < kNumAxes; ++i) {
    const Axis a = static_cast<Axis>(i);
    MAPP_CHECK(c.get(a) >= 0 && c.get(a) < size(a), axis_name(a), " coordinate ",
               c.get(a), " is outside [0, ", size(a), ")");
  }
  return ((c.pp * dp() + c.dp) * cp() + c.cp) * tp() + c.tp;
}

std::vector<int> RankGrid::group(int rank, const std::vector<Axis>& axes) const {
  const Coord base = coord(rank);
  std::array<bool, kNumAxes> free{};
  for (Axis a : axes) free[static_cast<int>(a)] = true;
  // Enumerate the free axes' coordinates; fixed axes keep base's value.
  std::vector<int> out;
  for (int pp_i = 0; pp_i < pp(); ++pp_i) {
    if (!free[3] && pp_i != base.pp) continue;
    for (int dp_i = 0; dp_i < dp(); ++dp_i) {
      if (!free[2] && dp_i != base.dp) continue;
      for (int cp_i = 0; cp_i < cp(); ++cp_i) {
        if (!free[1] && cp_i != base.cp) continue;
        for (int tp_i = 0; tp_i < tp(); ++tp_i) {
          if (!free[0] && tp_i != base.tp) continue;
          out.push_back(this->rank(Coord{tp_i, cp_i, dp_i, pp_i}));
        }
      }
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::vector<int>> RankGrid::groups(const std::vector<Axis>& axes) const {
  return partition([&](int r) { return group(r, axes); });
}

std::vector<int> RankGrid::embedding_group(int rank) const {
  Coord c = coord(rank);
  Coord first = c, last = c;
  first.pp = 0;
  last.pp = pp() - 1;
  const int a = this->rank(first), b = this->rank(last);
  return a == b ? std::vector<int>{a} : std::vector<int>{a, b};
}

std::string RankGrid::describe() const {
  std::ostringstream os;
  os << "world " << world_size_ << " = tp " << tp() << " x cp " << cp() << " x dp "
     << dp() << " x pp " << pp();
  if (ep_ > 1 || etp_ != tp()) {
    os << " (experts: ";
    if (etp_ != tp()) os << "etp " << etp_ << " x ";
    os << "ep " << ep_ << " x edp " << edp() << ")";
  }
  return os.str();
}

}  // namespace mapp
