// Fused scale + causal mask + softmax (CPU reference), the core-attention
// softmax of Megatron's local attention (its CUDA kernel is
// scaled_upper_triang_masked_softmax).
//
// x holds `rows` rows of `cols` attention scores; row r is query position
// q = r mod q_len of some (batch, head). Key position c is visible iff
// c <= q + (cols - q_len) (causal, aligned at the end when keys outnumber
// queries). Forward, per row:
//     y_c = exp(scale * x_c - m) / sum_{visible} exp(scale * x_k - m), 0 if masked
// with m the row's visible maximum; one read of x, one write of y, masked
// entries never exponentiated. Backward (dy -> dx), per row:
//     dx_c = scale * y_c * (dy_c - sum_k dy_k y_k)
// which is 0 on masked entries. float rows use a vectorized exp of about 1 ulp
// (softmax.cc); double rows std::exp.
#pragma once

#include <cstdint>

namespace mapp {

void scaled_causal_softmax(const float* x, std::int64_t rows, std::int64_t cols, std::int64_t q_len,
                           float scale, float* y);
void scaled_causal_softmax(const double* x, std::int64_t rows, std::int64_t cols,
                           std::int64_t q_len, double scale, double* y);

void scaled_causal_softmax_backward(const float* y, const float* dy, std::int64_t rows,
                                    std::int64_t cols, std::int64_t q_len, float scale, float* dx);
void scaled_causal_softmax_backward(const double* y, const double* dy, std::int64_t rows,
                                    std::int64_t cols, std::int64_t q_len, double scale,
                                    double* dx);

}  // namespace mapp
