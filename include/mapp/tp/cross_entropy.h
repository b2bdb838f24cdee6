// Local statistics of vocabulary-parallel cross-entropy (CPU reference).
//
// With logits sharded on the vocabulary dimension, each tensor-parallel rank
// holds the columns [vocab_start, vocab_start + vocab) of every row. One pass
// over the shard yields, per row,
//     stats[3*row + 0] = m = max_j x_j
//     stats[3*row + 1] = s = sum_j exp(x_j - m)
//     stats[3*row + 2] = t = x_{target - vocab_start} if target in the shard, else 0
// and a single all-gather of these 3 floats per row lets every rank finish
//     M = max_r m_r,  lse = M + log(sum_r s_r exp(m_r - M)),  loss = lse - sum_r t_r.
// Megatron-LM needs three all-reduces (max, target logit, sum-exp) for the same.
// kernels/cross_entropy.cu is the CUDA version of this function; tests compare.
#pragma once

#include <cstdint>

namespace mapp {

inline constexpr int kVocabCeStatsPerRow = 3;

// logits: row-major [rows, vocab]; target: [rows] global vocabulary ids (any
// value outside the shard, e.g. an ignore index, contributes t = 0);
// stats: [rows, 3]. Accumulates in double. Throws ValueError if vocab < 1.
void vocab_ce_local_stats(const float* logits, const std::int64_t* target,
                          std::int64_t rows, std::int64_t vocab, std::int64_t vocab_start,
                          float* stats);
void vocab_ce_local_stats(const double* logits, const std::int64_t* target,
                          std::int64_t rows, std::int64_t vocab, std::int64_t vocab_start,
                          double* stats);

}  // namespace mapp
