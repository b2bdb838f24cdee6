// Compressed collectives over c10d, with error feedback, for CPU and CUDA
// tensors (codecs: include/mapp/codec/codec.h).
//
// Algorithms (W = group size, all bandwidth-efficient):
//  * element-wise codecs (bf16, fp16, int8, onebit): two phases, as 1-bit Adam.
//    The float32 buffer is padded to W equal chunks; phase 1 encodes chunk j
//    (with the worker residual) and all-to-alls the payloads, so rank r
//    receives every rank's encoding of chunk r and sums the decodings;
//    phase 2 encodes that reduced chunk (with the server residual) and
//    all-gathers the payloads; everyone decodes all chunks. Bytes per rank:
//    2 (W-1)/W x the payload of the whole buffer, like a ring all-reduce.
//  * topk: residual-compensated top-k (index, value) pairs all-gathered and
//    scatter-added.
//  * powersgd: per matrix of `layout`, P = M Q, all-reduce P, orthonormalize,
//    Q = M^T P, all-reduce Q, M ~ P Q^T (P and Q of all matrices travel in one
//    flat all-reduce each); elements outside the matrices are all-reduced
//    uncompressed. Q is warm-started from the previous call.
//  * none: a plain all-reduce.
// Results are sums, or means when `average`. Payloads travel as uint8 (Gloo
// has no bfloat16).
//
// State (residuals, PowerSGD Q) is owned by the caller so that it can be
// checkpointed: state_shapes() says what to allocate (zeros; PowerSGD Q: the
// same random values on every rank).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mapp/codec/codec.h"

namespace mapp::torch_ext {

struct CommStats {
  std::int64_t raw_bytes = 0;   // bytes an uncompressed fp32 ring all-reduce would send
  std::int64_t sent_bytes = 0;  // bytes this rank actually sent
};

// Shapes of the state tensors for a buffer of n elements over `world` ranks.
// layout: flattened (offset, rows, cols) triples of the matrices (PowerSGD).
std::vector<std::vector<std::int64_t>> state_shapes(const codec::Spec& spec, std::int64_t n,
                                                    std::int64_t world,
                                                    const std::vector<std::int64_t>& layout);

// In place on the 1-D contiguous buffer `buf` (any float dtype).
CommStats compressed_all_reduce(at::Tensor& buf, const codec::Spec& spec,
                                const std::vector<at::Tensor>& state,
                                const std::vector<std::int64_t>& layout, bool average,
                                const std::string& group_name);

// This rank's chunk (padded length / W, float32) of the sum (or mean). For
// non-element-wise codecs: a compressed all-reduce, then the chunk.
at::Tensor compressed_reduce_scatter(const at::Tensor& buf, const codec::Spec& spec,
                                     const std::vector<at::Tensor>& state,
                                     const std::vector<std::int64_t>& layout, bool average,
                                     const std::string& group_name, CommStats* stats);

// Elements per chunk after padding n for W ranks and the codec's alignment.
std::int64_t padded_chunk(const codec::Spec& spec, std::int64_t n, std::int64_t world);

// Runs `job` on the group's communication thread (jobs of one group run in
// submission order, so ranks that submit in the same order stay matched) and
// returns a handle for wait_async.
std::int64_t submit_async(const std::string& group_name, std::function<CommStats()> job);
// Blocks until the job is done; rethrows its error.
CommStats wait_async(std::int64_t handle);

}  // namespace mapp::torch_ext
