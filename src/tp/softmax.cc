#include "mapp/tp/softmax.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "mapp/common/check.h"

namespace mapp {
namespace {

void check(std::int64_t rows, std::int64_t cols, std::int64_t q_len) {
  MAPP_CHECK(rows >= 0 && cols >= 1, "scaled_causal_softmax: bad shape, ", rows, " rows of ", cols);
  MAPP_CHECK(q_len >= 1 && q_len <= cols && rows % q_len == 0, "scaled_causal_softmax: ", rows,
             " rows are not whole blocks of ", q_len,
             " queries, or there are more queries than the ", cols, " keys");
}

// exp for x <= 0 (softmax arguments after the max is subtracted), branch-free
// so that the loops below vectorize: x = n ln2 + r with |r| <= ln2 / 2
// (Cody-Waite split of ln2), exp(r) by its degree-6 Taylor polynomial
// (relative error < 2e-7, about 1 ulp), 2^n put into the exponent bits.
// Arguments below -87 return exp(-87) ~ 1.6e-38 instead of a denormal.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = x * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  // The integer n sits in the low mantissa bits of `shifted`.
  const std::int32_t ni = __builtin_bit_cast(std::int32_t, shifted) - 0x4B400000;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * __builtin_bit_cast(float, (ni + 127) << 23);
}

inline double exp_nonpositive(double x) { return std::exp(x); }

// The row kernels of the forward pass, vectorized over columns.
template <typename T>
inline T row_max(const T* in, std::int64_t n, T scale) {
  T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
  for (std::int64_t c = 0; c < n; ++c) m = std::max(m, in[c] * scale);
  return m;
}

// out[c] = exp(scale * in[c] - m) (a map: vectorizes), then their sum over
// eight partial sums (vectorizes without reassociation flags).
template <typename T>
inline T exp_sum(const T* in, std::int64_t n, T scale, T m, T* __restrict out) {
#pragma omp simd
  for (std::int64_t c = 0; c < n; ++c) out[c] = exp_nonpositive(in[c] * scale - m);
  T part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    for (int j = 0; j < 8; ++j) part[j] += out[c + j];
  }
  T sum = 0;
  for (; c < n; ++c) sum += out[c];
  for (int j = 0; j < 8; ++j) sum += part[j];
  return sum;
}

template <typename T>
void forward(const T* x, std::int64_t rows, std::int64_t cols, std::int64_t q_len, T scale, T* y) {
  check(rows, cols, q_len);
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* in = x + r * cols;
    T* out = y + r * cols;
    const std::int64_t visible = r % q_len + (cols - q_len) + 1;  // columns [0, visible)
    const T m = row_max(in, visible, scale);
    const T inv = T(1) / exp_sum(in, visible, scale, m, out);
#pragma omp simd
    for (std::int64_t c = 0; c < visible; ++c) out[c] *= inv;
    std::fill(out + visible, out + cols, T(0));
  }
}

template <typename T>
void backward(const T* y, const T* dy, std::int64_t rows, std::int64_t cols, std::int64_t q_len,
              T scale, T* dx) {
  check(rows, cols, q_len);
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* yr = y + r * cols;
    const T* gr = dy + r * cols;
    T* out = dx + r * cols;
    const std::int64_t visible = r % q_len + (cols - q_len) + 1;
    T d = 0;
#pragma omp simd reduction(+ : d)
    for (std::int64_t c = 0; c < visible; ++c) d += gr[c] * yr[c];
#pragma omp simd
    for (std::int64_t c = 0; c < visible; ++c) out[c] = scale * yr[c] * (gr[c] - d);
    std::fill(out + visible, out + cols, T(0));
  }
}

}  // namespace

void scaled_causal_softmax(const float* x, std::int64_t rows, std::int64_t cols, std::int64_t q_len,
                           float scale, float* y) {
  forward(x, rows, cols, q_len, scale, y);
}
void scaled_causal_softmax(const double* x, std::int64_t rows, std::int64_t cols,
                           std::int64_t q_len, double scale, double* y) {
  forward(x, rows, cols, q_len, scale, y);
}
void scaled_causal_softmax_backward(const float* y, const float* dy, std::int64_t rows,
                                    std::int64_t cols, std::int64_t q_len, float scale, float* dx) {
  backward(y, dy, rows, cols, q_len, scale, dx);
}
void scaled_causal_softmax_backward(const double* y, const double* dy, std::int64_t rows,
                                    std::int64_t cols, std::int64_t q_len, double scale,
                                    double* dx) {
  backward(y, dy, rows, cols, q_len, scale, dx);
}

}  // namespace mapp
