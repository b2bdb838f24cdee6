// Codec encode/decode of float32 torch tensors on CPU (the core's reference
// functions) or CUDA (kernels/codec.cu, on the tensor device's current stream).
#pragma once

#include <ATen/ATen.h>

#include "mapp/codec/codec.h"

namespace mapp::torch_ext::internal {

// Encodes x (with the error-feedback residual `err` when given, updated in
// place) into `out` (uint8, exactly codec::encoded_bytes long).
void encode_into(const codec::Spec& spec, const at::Tensor& x, const at::Tensor* err,
                 at::Tensor out);
at::Tensor encode(const codec::Spec& spec, const at::Tensor& x, const at::Tensor* err);
// Decodes `payload` into `out` (float32), adding to it when `accumulate`.
void decode(const codec::Spec& spec, const at::Tensor& payload, at::Tensor& out,
            bool accumulate);

}  // namespace mapp::torch_ext::internal
