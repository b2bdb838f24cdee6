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
#include "mapp/torch/comm_engine.h"

namespace mapp::torch_ext {

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

// The same, asynchronously on the group's communication thread
// (comm_engine.h): `buf` (and `out`) must not be touched until the work is
// waited for.
c10::intrusive_ptr<CommWork> compressed_all_reduce_async(at::Tensor buf,
                                                         const CompressedOptions& opts,
                                                         std::vector<at::Tensor> state);
// Writes this rank's chunk into `out` (float32, padded length / W).
c10::intrusive_ptr<CommWork> compressed_reduce_scatter_async(at::Tensor buf, at::Tensor out,
                                                             const CompressedOptions& opts,
                                                             std::vector<at::Tensor> state);

// ZeRO-1's parameter gather, asynchronously: `buf` is a bucket's whole 1-D
// parameter buffer, split into group-size equal chunks; every member's chunk
// (chunk r of member r, the range its optimizer updated) is gathered into every
// member's `buf`. `buf` must not be read until the work is waited for
// (DistributedOptimizer with overlap_param_gather waits in forward pre-hooks).
c10::intrusive_ptr<CommWork> param_all_gather_async(at::Tensor buf, const std::string& group_name);

// Fresh state tensors of a codec for a buffer of n elements over `world` ranks
// (zero residuals; PowerSGD's Q drawn from `seed`, the same on every rank).
std::vector<at::Tensor> codec_state(const codec::Spec& spec, std::int64_t n, std::int64_t world,
                                    const std::vector<std::int64_t>& layout, std::int64_t seed,
                                    const at::TensorOptions& options);

// Throws unless `t` is a contiguous 1-D floating tensor.
void check_float_1d(const at::Tensor& t, const char* what);

}  // namespace mapp::torch_ext
