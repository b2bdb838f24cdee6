// Mixture-of-experts token routing: the plan of which rows go where, and the
// CPU reference kernels that move rows by it (torch-free).
//
// A routing decision is `expert_of[T x k]`: for token t its k chosen experts
// (-1: not sent, e.g. dropped by the router). plan_routes() sorts the
// assignments by expert (stable: token order within an expert), enforces an
// optional per-expert capacity (assignments past it are dropped, in token
// order), optionally pads every expert to exactly `capacity` rows (static
// shapes), and records both directions of the permutation:
//
//   row_of[t*k + j]   the permuted row of assignment (t, j), or -1 (dropped)
//   assignment_of[r]  the assignment a permuted row holds, or -1 (padding)
//
// Expert e's rows are [offset(e), offset(e) + rows_per_expert[e]). The
// expert-parallel exchange (src/torch/moe.cc) sends expert e's rows to rank
// e / (E / ep); regroup_order() turns what arrives, ordered [source][local
// expert], into [local expert][source] so each local expert's rows are one
// contiguous block for the grouped GEMM, and back.
//
// kernels/moe.cu implements gather/combine/weight_grads on the GPU with the
// same plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mapp::moe {

struct RoutePlan {
  std::int64_t tokens = 0;
  std::int64_t topk = 0;
  std::int64_t num_experts = 0;
  std::int64_t capacity = -1;                 // rows kept per expert; -1: dropless
  bool pad = false;                           // every expert holds exactly `capacity` rows
  std::vector<std::int64_t> rows_per_expert;  // [E] rows in the permuted buffer
  std::vector<std::int64_t> kept_per_expert;  // [E] real (unpadded) rows
  std::vector<std::int64_t> row_of;           // [T*k]
  std::vector<std::int64_t> assignment_of;    // [rows()]

  std::int64_t rows() const { return static_cast<std::int64_t>(assignment_of.size()); }
  // Assignments that were routed (expert_of >= 0) but did not fit the capacity.
  std::int64_t dropped_by_capacity = 0;
};

// Throws ValueError when an expert id is outside [-1, num_experts), when
// pad is set without a capacity, or when a size is negative.
RoutePlan plan_routes(const std::int64_t* expert_of, std::int64_t tokens, std::int64_t topk,
                      std::int64_t num_experts, std::int64_t capacity, bool pad);

// dst[r] = src[token of assignment_of[r]] (row_bytes bytes each); padding rows
// are zeroed. dst holds plan.rows() rows.
void gather_rows(const RoutePlan& plan, const std::byte* src, std::int64_t row_bytes,
                 std::byte* dst);

// dst[r] *= w[assignment_of[r]] for every real row (hidden h): the probability
// weighting of the combine's backward. T = float or double.
template <typename T>
void scale_rows(const RoutePlan& plan, const T* w, std::int64_t h, T* dst);

// out[t] = sum_j w[t, j] * y[row_of[t, j]] over kept assignments (w null: 1);
// tokens with none get zeros. Accumulates in double for double, float else.
template <typename T>
void combine_rows(const RoutePlan& plan, const T* y, const T* w, std::int64_t h, T* out);

// gw[t, j] = <g[t], y[row_of[t, j]]> (0 for dropped): the gradient of the
// combine's weights.
template <typename T>
void weight_grads(const RoutePlan& plan, const T* g, const T* y, std::int64_t h, T* gw);

// Blocks ordered [i][j] (a x b of them, block (i, j) holding counts[i*b + j]
// rows) reordered to [j][i]: out row r is input row order[r]. The transposed
// counts (b x a) give the inverse.
std::vector<std::int64_t> regroup_order(const std::int64_t* counts, std::int64_t a, std::int64_t b);

}  // namespace mapp::moe
