#include "mapp/tp/cross_entropy.h"

#include <cmath>
#include <limits>

#include "mapp/common/check.h"

namespace mapp {
namespace {

template <typename T>
void local_stats(const T* logits, const std::int64_t* target, std::int64_t rows,
                 std::int64_t vocab, std::int64_t vocab_start, T* stats) {
  MAPP_CHECK(vocab >= 1, "vocab_ce_local_stats: the logits shard has ", vocab,
             " columns; it needs at least one");
  MAPP_CHECK(rows >= 0, "vocab_ce_local_stats: negative row count ", rows);
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* x = logits + r * vocab;
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t j = 0; j < vocab; ++j) m = std::max(m, static_cast<double>(x[j]));
    double s = 0.0;
    for (std::int64_t j = 0; j < vocab; ++j) s += std::exp(static_cast<double>(x[j]) - m);
    const std::int64_t local = target[r] - vocab_start;
    const double t = (local >= 0 && local < vocab) ? static_cast<double>(x[local]) : 0.0;
    stats[kVocabCeStatsPerRow * r + 0] = static_cast<T>(m);
    stats[kVocabCeStatsPerRow * r + 1] = static_cast<T>(s);
    stats[kVocabCeStatsPerRow * r + 2] = static_cast<T>(t);
  }
}

}  // namespace

void vocab_ce_local_stats(const float* logits, const std::int64_t* target,
                          std::int64_t rows, std::int64_t vocab, std::int64_t vocab_start,
                          float* stats) {
  local_stats(logits, target, rows, vocab, vocab_start, stats);
}

void vocab_ce_local_stats(const double* logits, const std::int64_t* target,
                          std::int64_t rows, std::int64_t vocab, std::int64_t vocab_start,
                          double* stats) {
  local_stats(logits, target, rows, vocab, vocab_start, stats);
}

}  // namespace mapp
