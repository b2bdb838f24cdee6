// A custom C++ trainer: a tensor-parallel MLP regressing a fixed random
// teacher, tensor x data parallel, AdamW, no Python anywhere.
//
//   torchrun --no-python --nproc-per-node 4 build/py/examples/train_tp_mlp 2 200
#include <torch/torch.h>

#include <iostream>

#include "mapp/torch/dist.h"
#include "mapp/torch/nn.h"
#include "mapp/torch/ops.h"

int main(int argc, char** argv) {
  const int tp = argc > 1 ? std::atoi(argv[1]) : 2, steps = argc > 2 ? std::atoi(argv[2]) : 200;
  const auto st =
      mapp::dist::init_from_env({.tp = tp});  // RANK, WORLD_SIZE, MASTER_* from torchrun
  torch::manual_seed(0);  // the same seed everywhere: every rank draws the same full weights
  mapp::nn::ColumnParallelLinear fc1(mapp::nn::ColumnParallelLinearOptions(32, 128), st);
  mapp::nn::RowParallelLinear fc2(mapp::nn::RowParallelLinearOptions(128, 32), st);
  const at::Tensor teacher = torch::randn({32, 32}) / 6.0;
  std::vector<at::Tensor> params = fc1->parameters();
  for (const auto& p : fc2->parameters()) params.push_back(p);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(3e-3));
  torch::manual_seed(1 + st.dp_rank());  // each data-parallel rank its own batches
  for (int step = 1; step <= steps; ++step) {
    const at::Tensor x = torch::randn({64, 32});
    const at::Tensor loss = (fc2(torch::gelu(fc1(x))) - x.matmul(teacher)).pow(2).mean();
    opt.zero_grad();
    loss.backward();
    for (auto& p : params) {  // data parallelism: average the gradients over dp x cp
      mapp::torch_ext::all_reduce_sum_(p.mutable_grad(), st.data_context_group());
      p.mutable_grad().div_(st.dp_size() * st.cp_size());
    }
    opt.step();
    at::Tensor mean = loss.detach().clone();  // the loss over the data-parallel ranks
    mapp::torch_ext::all_reduce_sum_(mean, st.data_context_group());
    if (st.rank() == 0 && (step == 1 || step % 50 == 0))
      std::cout << "step " << step << " loss " << mean.item<double>() / st.dp_size() << std::endl;
  }
  mapp::dist::destroy(st);
}
