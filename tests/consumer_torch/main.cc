// Calls the vocab-parallel cross-entropy statistics through the installed
// megatronapp::torch and checks them against the closed form for a 2-way split.
#include <ATen/ATen.h>

#include <cmath>
#include <iostream>

#include "mapp/torch/ops.h"

int main() {
  at::manual_seed(0);
  const at::Tensor logits = at::randn({4, 10});
  const at::Tensor target = at::tensor({0, 9, 4, 5}, at::kLong);
  const at::Tensor lo = mapp::torch_ext::vocab_ce_local_stats(logits.narrow(1, 0, 5), target, 0);
  const at::Tensor hi = mapp::torch_ext::vocab_ce_local_stats(logits.narrow(1, 5, 5), target, 5);
  const at::Tensor m = at::maximum(lo.select(1, 0), hi.select(1, 0));
  const at::Tensor lse = m + at::log(lo.select(1, 1) * at::exp(lo.select(1, 0) - m) +
                                     hi.select(1, 1) * at::exp(hi.select(1, 0) - m));
  const at::Tensor loss = lse - lo.select(1, 2) - hi.select(1, 2);
  const at::Tensor want = at::logsumexp(logits, 1) - logits.gather(1, target.unsqueeze(1)).squeeze(1);
  const double err = (loss - want).abs().max().item<double>();
  std::cout << "max |loss - closed form| = " << err << "\n";
  return err < 1e-5 ? 0 : 1;
}
