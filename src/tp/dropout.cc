#include "mapp/tp/dropout.h"

#include <algorithm>
#include <cmath>

#include "mapp/common/check.h"

namespace mapp {
namespace {

// Chris Wellons' "lowbias32" integer hash (bias ~0.17 against an ideal
// avalanche); two rounds keyed by the seed make each element's word.
inline std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

struct Key {
  std::uint32_t k1, k2;
};

// The key of elements [hi * 2^33, (hi + 1) * 2^33): the 32-bit pair counter
// wraps there, so the high part of the index joins the seed.
inline Key key_for(std::uint64_t seed, std::uint64_t hi) {
  const std::uint64_t s = seed ^ (hi * 0x9E3779B97F4A7C15ULL);
  const std::uint32_t k1 =
      mix32(static_cast<std::uint32_t>(s) ^ mix32(static_cast<std::uint32_t>(s >> 32)));
  return {k1, mix32(k1 + 0x632BE5ABU)};
}

// 16 random bits of element i (the low or high half of its pair's word).
inline std::uint32_t bits16(Key k, std::uint64_t i) {
  const std::uint32_t w = mix32(mix32(static_cast<std::uint32_t>(i >> 1) + k.k1) ^ k.k2);
  return (w >> ((i & 1) * 16)) & 0xFFFFU;
}

// Calls body(begin, end, key) for the pieces of [begin, end) with one key.
template <typename F>
inline void by_key(std::uint64_t seed, std::int64_t begin, std::int64_t end, F&& body) {
  MAPP_CHECK(begin >= 0 && begin <= end, "dropout: bad range [", begin, ", ", end, ")");
  constexpr std::int64_t kSpan = std::int64_t{1} << 33;
  while (begin < end) {
    const std::int64_t hi = begin / kSpan;
    const std::int64_t stop = std::min(end, (hi + 1) * kSpan);
    body(begin, stop, key_for(seed, static_cast<std::uint64_t>(hi)));
    begin = stop;
  }
}

// Branch-free loops over global indices (vectorized with AVX2 where the CPU
// has it: one clone per target, picked at load time).
template <typename T>
__attribute__((always_inline)) inline void apply_piece(Key k, std::uint32_t threshold, T scale,
                                                       std::int64_t begin, std::int64_t end,
                                                       const T* x, T* __restrict out) {
#pragma omp simd
  for (std::int64_t i = begin; i < end; ++i) {
    out[i - begin] =
        x[i - begin] * (bits16(k, static_cast<std::uint64_t>(i)) >= threshold ? scale : T(0));
  }
}

__attribute__((target_clones("avx2", "default"))) void apply_f32(Key k, std::uint32_t threshold,
                                                                 float scale, std::int64_t begin,
                                                                 std::int64_t end, const float* x,
                                                                 float* out) {
  apply_piece(k, threshold, scale, begin, end, x, out);
}

__attribute__((target_clones("avx2", "default"))) void apply_f64(Key k, std::uint32_t threshold,
                                                                 double scale, std::int64_t begin,
                                                                 std::int64_t end, const double* x,
                                                                 double* out) {
  apply_piece(k, threshold, scale, begin, end, x, out);
}

__attribute__((target_clones("avx2", "default"))) void mask_piece(Key k, std::uint32_t threshold,
                                                                  std::int64_t begin,
                                                                  std::int64_t end,
                                                                  std::uint8_t* __restrict mask) {
#pragma omp simd
  for (std::int64_t i = begin; i < end; ++i) {
    mask[i - begin] = bits16(k, static_cast<std::uint64_t>(i)) >= threshold ? 1 : 0;
  }
}

}  // namespace

std::uint32_t dropout_threshold(double p) {
  MAPP_CHECK(p >= 0.0 && p < 1.0, "dropout: probability must be in [0, 1), got ", p);
  const double t = std::nearbyint(p * 65536.0);
  return static_cast<std::uint32_t>(std::min(t, 65535.0));
}

void dropout_mask(std::uint64_t seed, std::uint32_t threshold, std::int64_t begin, std::int64_t end,
                  std::uint8_t* mask) {
  by_key(seed, begin, end, [&](std::int64_t lo, std::int64_t hi, Key k) {
    mask_piece(k, threshold, lo, hi, mask + (lo - begin));
  });
}

void dropout_apply(std::uint64_t seed, std::uint32_t threshold, float scale, std::int64_t begin,
                   std::int64_t end, const float* x, float* out) {
  by_key(seed, begin, end, [&](std::int64_t lo, std::int64_t hi, Key k) {
    apply_f32(k, threshold, scale, lo, hi, x + (lo - begin), out + (lo - begin));
  });
}

void dropout_apply(std::uint64_t seed, std::uint32_t threshold, double scale, std::int64_t begin,
                   std::int64_t end, const double* x, double* out) {
  by_key(seed, begin, end, [&](std::int64_t lo, std::int64_t hi, Key k) {
    apply_f64(k, threshold, scale, lo, hi, x + (lo - begin), out + (lo - begin));
  });
}

}  // namespace mapp
