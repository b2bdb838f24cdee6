// Gradient compression codecs (CPU reference implementations, torch-free).
//
// A codec turns n float32 values into a byte payload and back. Element-wise
// codecs (bf16, fp16, int8, onebit) encode a chunk independently, so a
// collective can split a bucket into per-rank chunks; top-k selects (index,
// value) pairs; PowerSGD is a low-rank factorization of a matrix and lives in
// the collective layer (it needs matmuls), with gram_schmidt here.
//
// Payload layouts (all little-endian, scales first so they stay 4-byte aligned):
//   bf16 / fp16   n x u16
//   int8          ceil(n/B) x f32 scale (absmax/127), then n x i8 (round to nearest)
//   onebit        ceil(n/B) x f32 scale (mean |x|), then ceil(n/8) bytes of sign
//                 bits (bit i of byte i/8 is 1 when x_i >= 0); decodes to +-scale
//   topk          k x i32 index, then k x f32 value
// kernels/codec.cu implements the same layouts; GPU tests compare byte for byte.
#pragma once

#include <cstdint>
#include <string>

namespace mapp::codec {

enum class Kind { kNone, kBF16, kFP16, kInt8, kOneBit, kTopK, kPowerSGD };

struct Spec {
  Kind kind = Kind::kNone;
  std::int64_t block = 256;  // int8 / onebit: elements per scale
  double ratio = 0.01;       // topk: fraction of elements kept
  std::int64_t rank = 4;     // powersgd: rank of the approximation

  // "none", "bf16", "fp16", "int8[:block]", "onebit[:block]", "topk:<ratio>",
  // "powersgd:<rank>". Throws ValueError listing the valid forms.
  static Spec parse(const std::string& text);
  std::string str() const;
  // Lossy in a way that accumulates (needs error feedback): int8, onebit, topk, powersgd.
  bool biased() const;
  // Element-wise codecs can encode any chunk independently.
  bool elementwise() const;
  // Chunks handed to encode() must be a multiple of this many elements.
  std::int64_t alignment() const;
};

// Payload size of n elements (element-wise codecs and topk).
std::size_t encoded_bytes(const Spec& spec, std::int64_t n);
// Number of values top-k keeps out of n (at least 1 when n > 0).
std::int64_t topk_count(const Spec& spec, std::int64_t n);

// Element-wise codecs. `out` holds encoded_bytes(spec, n) bytes.
void encode(const Spec& spec, const float* x, std::int64_t n, std::uint8_t* out);
void decode(const Spec& spec, const std::uint8_t* in, std::int64_t n, float* out);
void decode_add(const Spec& spec, const std::uint8_t* in, std::int64_t n, float* acc);
// Error feedback: x' = x + err; out = encode(x'); err = x' - decode(out).
// `err` may be null (no feedback).
void encode_with_feedback(const Spec& spec, const float* x, float* err, std::int64_t n,
                          std::uint8_t* out);

// Top-k by magnitude: the k entries of largest |x| (ties: lower index first),
// written in ascending index order. Payload = k indices then k values.
void topk_encode(const float* x, std::int64_t n, std::int64_t k, std::uint8_t* out);
// acc[idx] += val for every pair of a top-k payload; indices are checked.
void topk_decode_add(const std::uint8_t* in, std::int64_t k, std::int64_t n, float* acc);

// Orthonormalizes the columns of the row-major [rows, cols] matrix in place
// (modified Gram-Schmidt; a zero column becomes zero). PowerSGD's step.
void gram_schmidt(float* m, std::int64_t rows, std::int64_t cols);

// IEEE conversions used by the cast codecs (round to nearest even).
std::uint16_t float_to_bf16(float f);
float bf16_to_float(std::uint16_t h);
std::uint16_t float_to_fp16(float f);
float fp16_to_float(std::uint16_t h);

}  // namespace mapp::codec
