// The index arithmetic of GPT pre-training data (Megatron-compatible), in the
// torch-free core because it walks every document of a corpus once:
//
// * sample index: where each training sample of `seq_length + extra` tokens
//   starts, walking the documents in `document_index` order (samples cross
//   document boundaries; consecutive samples overlap by `extra` tokens, the
//   label of the last position);
// * blend index: which dataset, and which of its samples, each sample of a
//   weighted blend comes from (greedy: the dataset furthest below its share).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mapp::data {

// Rows (document_index position, offset in that document) of the start of
// every sample, plus one row for the end of the last: 2 * (samples + 1)
// values, row-major. `sizes[d]` is document d's token count; `tokens` is the
// sum of sizes over `document_index`. With drop_last the final partial sample
// is dropped, else it ends at the last token. Throws ValueError on a document
// id outside `sizes`, seq_length < 1 or too few tokens for one sample.
std::vector<std::int64_t> build_sample_index(const std::int32_t* sizes, std::size_t num_sizes,
                                             const std::int32_t* document_index,
                                             std::size_t num_documents, std::int32_t seq_length,
                                             std::int64_t tokens, bool drop_last, int extra);

// For each of `size` samples of a blend with normalized `weights`: the
// dataset (dataset_index) and that dataset's running sample number
// (dataset_sample_index). After n samples every dataset j has been drawn
// within one sample of weights[j] * n.
void build_blend_index(const double* weights, int num_datasets, std::int64_t size,
                       std::int16_t* dataset_index, std::int64_t* dataset_sample_index);

}  // namespace mapp::data
