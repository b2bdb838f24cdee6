// The C++ GPT (mapp::nn::GPTModel) at the given tensor-parallel size: one
// forward and backward on seeded tokens; prints one JSON line per rank with
// the loss and every parameter's values and gradient, for the pytest's
// comparison with megatronapp.models.GPTModel on the same seed.
//
//   RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. mapp_gpt_check TP SP SEED
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
#include "mapp/torch/gpt.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: mapp_gpt_check TP SP SEED\n";
    return 2;
  }
  try {
    mapp::dist::InitOptions opts;
    opts.tp = std::atoi(argv[1]);
    opts.timeout = std::chrono::seconds(60);
    const auto st = mapp::dist::init_from_env(opts);
    const std::int64_t seed = std::atoll(argv[3]);
    mapp::nn::GPTConfig cfg;
    cfg.vocab_size = 128;
    cfg.hidden_size = 64;
    cfg.num_layers = 2;
    cfg.num_attention_heads = 4;
    cfg.seq_length = 32;
    cfg.sequence_parallel = std::atoi(argv[2]) != 0;
    mapp::nn::GPTModel model(cfg, st, seed);
    torch::manual_seed(seed + 1);
    const at::Tensor ids = at::randint(0, cfg.vocab_size, {2, 16}, at::kLong);
    const at::Tensor labels = at::randint(0, cfg.vocab_size, {2, 16}, at::kLong);
    const at::Tensor loss = model->forward(ids, labels).mean();
    loss.backward();
    std::cout << std::setprecision(17) << "{\"rank\": " << st.rank()
              << ", \"loss\": " << loss.item<double>() << ", \"params\": {";
    bool first = true;
    for (const auto& item : model->named_parameters()) {
      std::cout << (first ? "" : ", ") << "\"" << item.key()
                << "\": {\"value\": " << json_values(item.value())
                << ", \"grad\": " << json_values(item.value().grad()) << "}";
      first = false;
    }
    std::cout << "}}" << std::endl;
    mapp::dist::destroy(st);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
