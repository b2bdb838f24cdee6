// Codec encode/decode of torch tensors on either device: the core's CPU
// functions (include/mapp/codec/codec.h) or the CUDA kernels (kernels/codec.cu)
// on the current stream of the tensor's device.
#include "codec_dispatch.h"

#include "mapp/common/check.h"
#ifdef MAPP_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "mapp/kernels/codec.cuh"
#endif

namespace mapp::torch_ext::internal {

using codec::Spec;

// Encodes x (with the residual `err` when given) into `out` (uint8, exactly
// encoded_bytes long).
void encode_into(const Spec& spec, const at::Tensor& x, const at::Tensor* err, at::Tensor out) {
  const std::int64_t n = x.numel();
  if (x.is_cuda()) {
#ifdef MAPP_WITH_CUDA_KERNELS
    const cudaError_t e = kernels::codec_encode(
        spec, x.data_ptr<float>(), err ? err->data_ptr<float>() : nullptr, n,
        out.data_ptr<std::uint8_t>(),
        c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    if (e != cudaSuccess) MAPP_FAIL_BACKEND("codec encode kernel: ", cudaGetErrorString(e));
#else
    MAPP_CHECK(false, "this build has no CUDA kernels; rebuild with the CUDA toolkit");
#endif
  } else {
    codec::encode_with_feedback(spec, x.data_ptr<float>(), err ? err->data_ptr<float>() : nullptr,
                                n, out.data_ptr<std::uint8_t>());
  }
}

at::Tensor encode(const Spec& spec, const at::Tensor& x, const at::Tensor* err) {
  at::Tensor out = at::empty({static_cast<std::int64_t>(codec::encoded_bytes(spec, x.numel()))},
                             x.options().dtype(at::kByte));
  encode_into(spec, x, err, out);
  return out;
}

void decode(const Spec& spec, const at::Tensor& payload, at::Tensor& out, bool accumulate) {
  const std::int64_t n = out.numel();
  if (out.is_cuda()) {
#ifdef MAPP_WITH_CUDA_KERNELS
    const cudaError_t e =
        kernels::codec_decode(spec, payload.data_ptr<std::uint8_t>(), n, out.data_ptr<float>(),
                              accumulate, c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
    if (e != cudaSuccess) MAPP_FAIL_BACKEND("codec decode kernel: ", cudaGetErrorString(e));
#else
    MAPP_CHECK(false, "this build has no CUDA kernels; rebuild with the CUDA toolkit");
#endif
  } else if (accumulate) {
    codec::decode_add(spec, payload.data_ptr<std::uint8_t>(), n, out.data_ptr<float>());
  } else {
    codec::decode(spec, payload.data_ptr<std::uint8_t>(), n, out.data_ptr<float>());
  }
}

}  // namespace mapp::torch_ext::internal
