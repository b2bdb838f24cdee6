// CUDA kernels of the element-wise codecs (include/mapp/codec/codec.h has the
// payload layouts; byte-for-byte the same as the CPU reference).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mapp/codec/codec.h"

namespace mapp::kernels {

// out = encode(x + err); err = (x + err) - decode(out) when err != nullptr.
// Element-wise codecs only (none, bf16, fp16, int8, onebit).
cudaError_t codec_encode(const codec::Spec& spec, const float* x, float* err, std::int64_t n,
                         std::uint8_t* out, cudaStream_t stream);
// out = decode(in), or out += decode(in) when accumulate.
cudaError_t codec_decode(const codec::Spec& spec, const std::uint8_t* in, std::int64_t n,
                         float* out, bool accumulate, cudaStream_t stream);

}  // namespace mapp::kernels
