// Tensor-parallel layers from C++ (mapp::nn) against a single-process float64
// reference built from the gathered full weights: embedding -> column ->
// GELU -> row (+ residual) -> column head -> vocab-parallel cross-entropy,
// forward and backward, optionally with sequence parallelism. Prints one JSON
// line per rank with the errors and this rank's weight shards (for the
// pytest's comparison with the Python modules at the same seed).
//
//   RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. mapp_tp_check TP SP SEED
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>

#include "json_values.h"
#include "mapp/torch/dist.h"
#include "mapp/torch/nn.h"
#include "mapp/torch/ops.h"

namespace {

double max_err(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: mapp_tp_check TP SP SEED\n";
    return 2;
  }
  try {
    mapp::dist::InitOptions opts;
    opts.tp = std::atoi(argv[1]);
    opts.timeout = std::chrono::seconds(60);
    const bool sp = std::atoi(argv[2]) != 0;
    const auto st = mapp::dist::init_from_env(opts);
    const std::string& g = st.tensor_group();
    const int64_t V = 64, H = 16, F = 32, S = 8, B = 2;
    torch::manual_seed(std::atoll(argv[3]));
    mapp::nn::VocabParallelEmbedding emb(
        mapp::nn::VocabParallelEmbeddingOptions(V, H).sequence_parallel(sp), st);
    mapp::nn::ColumnParallelLinear fc1(
        mapp::nn::ColumnParallelLinearOptions(H, F).sequence_parallel(sp), st);
    mapp::nn::RowParallelLinear fc2(mapp::nn::RowParallelLinearOptions(F, H).sequence_parallel(sp),
                                    st);
    mapp::nn::ColumnParallelLinear head(
        mapp::nn::ColumnParallelLinearOptions(H, V).bias(false).sequence_parallel(sp), st);
    const at::Tensor ids = at::randint(0, V, {S, B}, at::kLong);
    at::Tensor target = at::randint(0, V, {S, B}, at::kLong);
    target[0][0] = -100;  // ignored

    at::Tensor h = emb(ids);  // [S, B, H] (or [S/tp, B, H])
    at::Tensor y = fc2(at::gelu(fc1(h))) + h;
    at::Tensor loss =
        mapp::nn::vocab_parallel_cross_entropy(head(y), target, g).sum() / (S * B - 1);
    loss.backward();

    // The reference: full weights gathered along their split dims, float64, one process.
    auto full = [&](const at::Tensor& w, int64_t dim) {
      return mapp::torch_ext::all_gather(w.detach().contiguous(), dim, g)
          .to(at::kDouble)
          .requires_grad_();
    };
    at::Tensor E = full(emb->weight, 0), W1 = full(fc1->weight, 0), b1 = full(fc1->bias, 0),
               W2 = full(fc2->weight, 1), b2 = fc2->bias.detach().to(at::kDouble).requires_grad_(),
               Wh = full(head->weight, 0);
    at::Tensor rh = at::embedding(E, ids);
    at::Tensor ry = at::linear(at::gelu(at::linear(rh, W1, b1)), W2, b2) + rh;
    at::Tensor rloss = at::cross_entropy_loss(at::linear(ry, Wh).flatten(0, 1), target.flatten(),
                                              {}, at::Reduction::Mean, -100);
    rloss.backward();
    const int tp = st.tp_size(), r = st.tp_rank();
    auto shard = [&](const at::Tensor& full_grad, int64_t dim) {
      return dim < 0 ? full_grad : full_grad.chunk(tp, dim)[r];
    };
    double grad_err = 0;
    grad_err = std::max(grad_err, max_err(emb->weight.grad(), shard(E.grad(), 0)));
    grad_err = std::max(grad_err, max_err(fc1->weight.grad(), shard(W1.grad(), 0)));
    grad_err = std::max(grad_err, max_err(fc1->bias.grad(), shard(b1.grad(), 0)));
    grad_err = std::max(grad_err, max_err(fc2->weight.grad(), shard(W2.grad(), 1)));
    // Under sequence parallelism each rank's bias gradient covers its own
    // sequence shard: the sum over the group is the whole gradient.
    at::Tensor gb2 = fc2->bias.grad().clone();
    if (sp) mapp::torch_ext::all_reduce_sum_(gb2, g);
    grad_err = std::max(grad_err, max_err(gb2, b2.grad()));
    grad_err = std::max(grad_err, max_err(head->weight.grad(), shard(Wh.grad(), 0)));
    std::cout << std::setprecision(17) << "{\"rank\": " << st.rank()
              << ", \"loss\": " << loss.item<double>()
              << ", \"loss_err\": " << std::abs(loss.item<double>() - rloss.item<double>())
              << ", \"grad_err\": " << grad_err
              << ", \"weights\": {\"emb\": " << json_values(emb->weight)
              << ", \"fc1.w\": " << json_values(fc1->weight)
              << ", \"fc1.b\": " << json_values(fc1->bias)
              << ", \"fc2.w\": " << json_values(fc2->weight)
              << ", \"fc2.b\": " << json_values(fc2->bias)
              << ", \"head.w\": " << json_values(head->weight) << "}}" << std::endl;
    mapp::dist::destroy(st);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
