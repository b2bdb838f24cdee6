// Counter-based dropout masks (CPU reference).
//
// Element i of a mask drawn with `seed` keeps its value iff the 16-bit word
//     u_i = bits [16 (i mod 2), 16 (i mod 2) + 16) of H(seed, i / 2)
// is >= threshold = round(p * 65536), H a keyed 32-bit integer hash. Every element is a pure
// function of (seed, i): any split of [0, n) over threads gives the same mask, and the backward
// pass regenerates the mask from the seed instead of keeping it (one byte per element less than a
// saved mask). The drop probability is threshold / 65536 (within 2^-17 of p); callers scale kept
// values by 65536 / (65536 - threshold), so the expectation is exact.
//
// H(seed, c) = mix(mix(c + k1) ^ k2), mix Wellons' "lowbias32" hash and
// (k1, k2) derived from the seed (and from i / 2^33 for huge tensors): 32-bit
// multiplies only, so the loops vectorize (an AVX2 clone is picked at load
// time where the CPU has it).
#pragma once

#include <cstdint>

namespace mapp {

// The drop threshold for probability p in [0, 1): round(p * 65536), capped at 65535.
std::uint32_t dropout_threshold(double p);

// mask[i - begin] = 1 if element i is kept, else 0, for i in [begin, end).
void dropout_mask(std::uint64_t seed, std::uint32_t threshold, std::int64_t begin, std::int64_t end,
                  std::uint8_t* mask);

// out[i] = keep(i) ? x[i] * scale : 0 for i in [begin, end) (x, out indexed from 0
// at begin). float and double.
void dropout_apply(std::uint64_t seed, std::uint32_t threshold, float scale, std::int64_t begin,
                   std::int64_t end, const float* x, float* out);
void dropout_apply(std::uint64_t seed, std::uint32_t threshold, double scale, std::int64_t begin,
                   std::int64_t end, const double* x, double* out);

}  // namespace mapp
