#include "mapp/data/gpt_index.h"

#include "mapp/common/check.h"

namespace mapp::data {

std::vector<std::int64_t> build_sample_index(const std::int32_t* sizes, std::size_t num_sizes,
                                             const std::int32_t* document_index,
                                             std::size_t num_documents, std::int32_t seq_length,
                                             std::int64_t tokens, bool drop_last, int extra) {
  MAPP_CHECK(seq_length >= 1, "sample index: seq_length must be >= 1, got ", seq_length);
  MAPP_CHECK(extra >= 0, "sample index: extra tokens must be >= 0, got ", extra);
  MAPP_CHECK(num_documents > 0 && tokens > extra, "sample index: ", tokens, " tokens in ",
             num_documents, " documents are too few for one sample of ", seq_length, " + ", extra,
             " tokens");
  const std::int64_t usable = tokens - extra;
  const std::int64_t samples =
      drop_last ? usable / seq_length : (usable + seq_length - 1) / seq_length;
  MAPP_CHECK(samples >= 1, "sample index: ", tokens, " tokens are fewer than one sample of ",
             seq_length, " + ", extra, " tokens; use a shorter --seq-length or more data");
  auto size_of = [&](std::size_t pos) -> std::int64_t {
    const std::int32_t d = document_index[pos];
    MAPP_CHECK(d >= 0 && static_cast<std::size_t>(d) < num_sizes, "sample index: document ", d,
               " at position ", pos, " is outside the dataset's ", num_sizes, " documents");
    return sizes[d];
  };
  std::vector<std::int64_t> out(2 * static_cast<std::size_t>(samples + 1));
  std::size_t pos = 0;
  std::int64_t offset = 0;
  out[0] = 0;
  out[1] = 0;
  for (std::int64_t s = 1; s <= samples; ++s) {
    std::int64_t need = seq_length + extra;
    for (;;) {
      const std::int64_t left = size_of(pos) - offset;
      if (need <= left) {
        offset += need - extra;  // the next sample starts at this one's last token
        break;
      }
      need -= left;
      if (pos + 1 == num_documents) {  // only the final partial sample gets here
        MAPP_CHECK(!drop_last && s == samples, "sample index: ran out of documents at sample ", s,
                   " of ", samples, "; `tokens` (", tokens,
                   ") does not match the documents' sizes");
        offset = size_of(pos) - extra;
        break;
      }
      ++pos;
      offset = 0;
    }
    out[2 * s] = static_cast<std::int64_t>(pos);
    out[2 * s + 1] = offset;
  }
  return out;
}

void build_blend_index(const double* weights, int num_datasets, std::int64_t size,
                       std::int16_t* dataset_index, std::int64_t* dataset_sample_index) {
  MAPP_CHECK(num_datasets >= 1 && num_datasets <= 32767, "blend index: ", num_datasets,
             " datasets; use 1 to 32767");
  MAPP_CHECK(size >= 0, "blend index: size must be >= 0, got ", size);
  for (int j = 0; j < num_datasets; ++j)
    MAPP_CHECK(weights[j] >= 0, "blend index: weight ", j, " is negative (", weights[j], ")");
  std::vector<std::int64_t> drawn(static_cast<std::size_t>(num_datasets), 0);
  for (std::int64_t i = 0; i < size; ++i) {
    const double n = i < 1 ? 1.0 : static_cast<double>(i);
    int best = 0;
    double best_deficit = weights[0] * n - static_cast<double>(drawn[0]);
    for (int j = 1; j < num_datasets; ++j) {
      const double deficit = weights[j] * n - static_cast<double>(drawn[j]);
      if (deficit > best_deficit) {
        best_deficit = deficit;
        best = j;
      }
    }
    dataset_index[i] = static_cast<std::int16_t>(best);
    dataset_sample_index[i] = drawn[best]++;
  }
}

}  // namespace mapp::data
