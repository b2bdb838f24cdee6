#include "mapp/moe/dispatch.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "mapp/common/check.h"

namespace mapp::moe {

RoutePlan plan_routes(const std::int64_t* expert_of, std::int64_t tokens, std::int64_t topk,
                      std::int64_t num_experts, std::int64_t capacity, bool pad) {
  MAPP_CHECK(tokens >= 0 && topk >= 1 && num_experts >= 1, "moe routing: need tokens >= 0, ",
             "topk >= 1 and num_experts >= 1; got tokens=", tokens, " topk=", topk,
             " num_experts=", num_experts);
  MAPP_CHECK(capacity >= -1, "moe routing: capacity must be -1 (dropless) or >= 0, got ", capacity);
  MAPP_CHECK(!pad || capacity >= 0,
             "moe routing: padding to capacity needs a capacity (--moe-expert-capacity-factor)");
  RoutePlan p;
  p.tokens = tokens;
  p.topk = topk;
  p.num_experts = num_experts;
  p.capacity = capacity;
  p.pad = pad;
  const std::int64_t n = tokens * topk;
  p.kept_per_expert.assign(num_experts, 0);
  p.row_of.assign(n, -1);
  // First pass: rank of each assignment within its expert (token order).
  std::vector<std::int64_t> rank_in_expert(n, -1);
  for (std::int64_t a = 0; a < n; ++a) {
    const std::int64_t e = expert_of[a];
    MAPP_CHECK(e >= -1 && e < num_experts, "moe routing: token ", a / topk, " choice ", a % topk,
               " names expert ", e, ", outside [0, ", num_experts, ") (-1 means not routed)");
    if (e < 0) continue;
    if (capacity >= 0 && p.kept_per_expert[e] >= capacity) {
      ++p.dropped_by_capacity;
      continue;
    }
    rank_in_expert[a] = p.kept_per_expert[e]++;
  }
  p.rows_per_expert = pad ? std::vector<std::int64_t>(num_experts, capacity) : p.kept_per_expert;
  std::vector<std::int64_t> offset(num_experts + 1, 0);
  for (std::int64_t e = 0; e < num_experts; ++e) offset[e + 1] = offset[e] + p.rows_per_expert[e];
  p.assignment_of.assign(offset[num_experts], -1);
  for (std::int64_t a = 0; a < n; ++a) {
    if (rank_in_expert[a] < 0) continue;
    const std::int64_t r = offset[expert_of[a]] + rank_in_expert[a];
    p.row_of[a] = r;
    p.assignment_of[r] = a;
  }
  return p;
}

void gather_rows(const RoutePlan& plan, const std::byte* src, std::int64_t row_bytes,
                 std::byte* dst) {
  const auto bytes = static_cast<std::size_t>(row_bytes);
  for (std::int64_t r = 0; r < plan.rows(); ++r) {
    const std::int64_t a = plan.assignment_of[r];
    std::byte* out = dst + r * row_bytes;
    if (a < 0) {
      std::memset(out, 0, bytes);
    } else {
      std::memcpy(out, src + (a / plan.topk) * row_bytes, bytes);
    }
  }
}

namespace {
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
}  // namespace

template <typename T>
void scale_rows(const RoutePlan& plan, const T* w, std::int64_t h, T* dst) {
  for (std::int64_t r = 0; r < plan.rows(); ++r) {
    const std::int64_t a = plan.assignment_of[r];
    if (a < 0) continue;
    T* row = dst + r * h;
    const T s = w[a];
    for (std::int64_t i = 0; i < h; ++i) row[i] *= s;
  }
}

template <typename T>
void combine_rows(const RoutePlan& plan, const T* y, const T* w, std::int64_t h, T* out) {
  std::vector<Acc<T>> acc(static_cast<std::size_t>(h));
  for (std::int64_t t = 0; t < plan.tokens; ++t) {
    std::fill(acc.begin(), acc.end(), Acc<T>(0));
    for (std::int64_t j = 0; j < plan.topk; ++j) {
      const std::int64_t a = t * plan.topk + j;
      const std::int64_t r = plan.row_of[a];
      if (r < 0) continue;
      const Acc<T> s = w ? static_cast<Acc<T>>(w[a]) : Acc<T>(1);
      const T* row = y + r * h;
      for (std::int64_t i = 0; i < h; ++i) acc[i] += s * static_cast<Acc<T>>(row[i]);
    }
    T* o = out + t * h;
    for (std::int64_t i = 0; i < h; ++i) o[i] = static_cast<T>(acc[i]);
  }
}

template <typename T>
void weight_grads(const RoutePlan& plan, const T* g, const T* y, std::int64_t h, T* gw) {
  for (std::int64_t a = 0; a < plan.tokens * plan.topk; ++a) {
    const std::int64_t r = plan.row_of[a];
    Acc<T> s = 0;
    if (r >= 0) {
      const T* gr = g + (a / plan.topk) * h;
      const T* yr = y + r * h;
      for (std::int64_t i = 0; i < h; ++i) s += static_cast<Acc<T>>(gr[i]) * yr[i];
    }
    gw[a] = static_cast<T>(s);
  }
}

std::vector<std::int64_t> regroup_order(const std::int64_t* counts, std::int64_t a,
                                        std::int64_t b) {
  // Offset of block (i, j) in the input: row-major over [i][j].
  std::vector<std::int64_t> in_off(static_cast<std::size_t>(a * b) + 1, 0);
  for (std::int64_t k = 0; k < a * b; ++k) {
    MAPP_CHECK(counts[k] >= 0, "moe regroup: negative row count ", counts[k]);
    in_off[k + 1] = in_off[k] + counts[k];
  }
  std::vector<std::int64_t> order;
  order.reserve(static_cast<std::size_t>(in_off.back()));
  for (std::int64_t j = 0; j < b; ++j) {
    for (std::int64_t i = 0; i < a; ++i) {
      for (std::int64_t r = 0; r < counts[i * b + j]; ++r) order.push_back(in_off[i * b + j] + r);
    }
  }
  return order;
}

template void scale_rows<float>(const RoutePlan&, const float*, std::int64_t, float*);
template void scale_rows<double>(const RoutePlan&, const double*, std::int64_t, double*);
template void combine_rows<float>(const RoutePlan&, const float*, const float*, std::int64_t,
                                  float*);
template void combine_rows<double>(const RoutePlan&, const double*, const double*, std::int64_t,
                                   double*);
template void weight_grads<float>(const RoutePlan&, const float*, const float*, std::int64_t,
                                  float*);
template void weight_grads<double>(const RoutePlan&, const double*, const double*, std::int64_t,
                                   double*);

}  // namespace mapp::moe
