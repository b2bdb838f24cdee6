// Element-wise gradient codecs on the GPU. Block-scaled codecs (int8, onebit)
// use one thread block per codec block: pass 1 folds the error-feedback
// residual in and reduces the block's scale (absmax or mean |x|); pass 2
// quantizes and leaves the new residual. Casts and decoders are grid-stride
// element-wise loops. Layouts match src/codec/codec.cc exactly.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "mapp/kernels/codec.cuh"

namespace mapp::kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float block_reduce(float v, bool is_max) {
  __shared__ float partial[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float r = partial[0];
  for (int i = 1; i < kThreads / 32; ++i) r = is_max ? fmaxf(r, partial[i]) : r + partial[i];
  __syncthreads();  // partial is reused by the next call
  return r;
}

// Pass 1 of a block: x' = x + err (kept in err, or read from x), scale.
__device__ float fold_and_scale(const float* x, float* err, std::int64_t lo, std::int64_t hi,
                                bool absmax) {
  float acc = 0.f;
  for (std::int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    float v = x[i];
    if (err) {
      v += err[i];
      err[i] = v;
    }
    acc = absmax ? fmaxf(acc, fabsf(v)) : acc + fabsf(v);
  }
  return block_reduce(acc, absmax);
}

__global__ void int8_encode(const float* x, float* err, std::int64_t n, std::int64_t b,
                            float* scales, std::int8_t* q) {
  const std::int64_t blk = blockIdx.x, lo = blk * b, hi = min(n, lo + b);
  const float scale = fold_and_scale(x, err, lo, hi, true) / 127.f;
  if (threadIdx.x == 0) scales[blk] = scale;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (std::int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float v = err ? err[i] : x[i];
    const float r = fminf(fmaxf(nearbyintf(v * inv), -127.f), 127.f);
    q[i] = static_cast<std::int8_t>(r);
    if (err) err[i] = v - r * scale;
  }
}

__global__ void onebit_encode(const float* x, float* err, std::int64_t n, std::int64_t b,
                              float* scales, std::uint8_t* bits) {
  const std::int64_t blk = blockIdx.x, lo = blk * b, hi = min(n, lo + b);
  const float scale = fold_and_scale(x, err, lo, hi, false) / static_cast<float>(hi - lo);
  if (threadIdx.x == 0) scales[blk] = scale;
  // b is a multiple of 8, so bytes never straddle blocks.
  for (std::int64_t byte = lo / 8 + threadIdx.x; byte * 8 < hi; byte += kThreads) {
    std::uint8_t m = 0;
    for (int j = 0; j < 8; ++j) {
      const std::int64_t i = byte * 8 + j;
      if (i >= hi) break;
      const float v = err ? err[i] : x[i];
      if (v >= 0.f) m |= static_cast<std::uint8_t>(1u << j);
      if (err) err[i] = v - (v >= 0.f ? scale : -scale);
    }
    bits[byte] = m;
  }
}

template <bool kBf16>
__global__ void cast_encode(const float* x, float* err, std::int64_t n, std::uint16_t* h) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const float v = err ? x[i] + err[i] : x[i];
    float back;
    if constexpr (kBf16) {
      const __nv_bfloat16 c = __float2bfloat16_rn(v);
      h[i] = __bfloat16_as_ushort(c);
      back = __bfloat162float(c);
    } else {
      const __half c = __float2half_rn(v);
      h[i] = __half_as_ushort(c);
      back = __half2float(c);
    }
    if (err) err[i] = v - back;
  }
}

__global__ void copy_encode(const float* x, float* err, std::int64_t n, float* out) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    out[i] = err ? x[i] + err[i] : x[i];
    if (err) err[i] = 0.f;
  }
}

template <codec::Kind kKind>
__global__ void decode_kernel(const std::uint8_t* in, std::int64_t n, std::int64_t b, float* out,
                              bool accumulate) {
  const std::int64_t nb = (n + b - 1) / b;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    float v;
    if constexpr (kKind == codec::Kind::kInt8) {
      const float* scales = reinterpret_cast<const float*>(in);
      v = static_cast<float>(reinterpret_cast<const std::int8_t*>(in + 4 * nb)[i]) * scales[i / b];
    } else if constexpr (kKind == codec::Kind::kOneBit) {
      const float s = reinterpret_cast<const float*>(in)[i / b];
      v = ((in[4 * nb + i / 8] >> (i % 8)) & 1) ? s : -s;
    } else if constexpr (kKind == codec::Kind::kBF16) {
      v = __bfloat162float(__ushort_as_bfloat16(reinterpret_cast<const std::uint16_t*>(in)[i]));
    } else if constexpr (kKind == codec::Kind::kFP16) {
      v = __half2float(__ushort_as_half(reinterpret_cast<const std::uint16_t*>(in)[i]));
    } else {
      v = reinterpret_cast<const float*>(in)[i];
    }
    out[i] = accumulate ? out[i] + v : v;
  }
}

unsigned grid_for(std::int64_t n) {
  const std::int64_t g = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 ? 65535 : g));
}

}  // namespace

cudaError_t codec_encode(const codec::Spec& spec, const float* x, float* err, std::int64_t n,
                         std::uint8_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const std::int64_t b = spec.block;
  const std::int64_t nb = (n + b - 1) / b;
  switch (spec.kind) {
    case codec::Kind::kNone:
      copy_encode<<<grid_for(n), kThreads, 0, stream>>>(x, err, n, reinterpret_cast<float*>(out));
      break;
    case codec::Kind::kBF16:
      cast_encode<true><<<grid_for(n), kThreads, 0, stream>>>(
          x, err, n, reinterpret_cast<std::uint16_t*>(out));
      break;
    case codec::Kind::kFP16:
      cast_encode<false><<<grid_for(n), kThreads, 0, stream>>>(
          x, err, n, reinterpret_cast<std::uint16_t*>(out));
      break;
    case codec::Kind::kInt8:
      if (nb > 0x7fffffff) return cudaErrorInvalidValue;
      int8_encode<<<static_cast<unsigned>(nb), kThreads, 0, stream>>>(
          x, err, n, b, reinterpret_cast<float*>(out),
          reinterpret_cast<std::int8_t*>(out + 4 * nb));
      break;
    case codec::Kind::kOneBit:
      if (nb > 0x7fffffff) return cudaErrorInvalidValue;
      onebit_encode<<<static_cast<unsigned>(nb), kThreads, 0, stream>>>(
          x, err, n, b, reinterpret_cast<float*>(out), out + 4 * nb);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t codec_decode(const codec::Spec& spec, const std::uint8_t* in, std::int64_t n,
                         float* out, bool accumulate, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned g = grid_for(n);
  const std::int64_t b = spec.block;
  switch (spec.kind) {
    case codec::Kind::kNone:
      decode_kernel<codec::Kind::kNone><<<g, kThreads, 0, stream>>>(in, n, b, out, accumulate);
      break;
    case codec::Kind::kBF16:
      decode_kernel<codec::Kind::kBF16><<<g, kThreads, 0, stream>>>(in, n, b, out, accumulate);
      break;
    case codec::Kind::kFP16:
      decode_kernel<codec::Kind::kFP16><<<g, kThreads, 0, stream>>>(in, n, b, out, accumulate);
      break;
    case codec::Kind::kInt8:
      decode_kernel<codec::Kind::kInt8><<<g, kThreads, 0, stream>>>(in, n, b, out, accumulate);
      break;
    case codec::Kind::kOneBit:
      decode_kernel<codec::Kind::kOneBit><<<g, kThreads, 0, stream>>>(in, n, b, out, accumulate);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace mapp::kernels
