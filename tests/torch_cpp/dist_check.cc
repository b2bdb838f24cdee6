// Starts the parallel layout from C++ (mapp::dist::init_from_env) and sums
// each rank's id over every group it joined, through the mapp operators that
// resolve groups by name. Prints one JSON line per rank; the pytest
// (tests/python/test_cpp_dist.py) checks membership against Python's RankGrid
// and every sum against the closed form.
//
//   RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. mapp_dist_check TP PP CP EP [TIMEOUT_S]
#include <ATen/ATen.h>

#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>

#include "mapp/torch/dist.h"
#include "mapp/torch/ops.h"

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::cerr << "usage: mapp_dist_check TP PP CP EP [TIMEOUT_S]\n";
    return 2;
  }
  try {
    mapp::dist::InitOptions opts;
    opts.tp = std::atoi(argv[1]);
    opts.pp = std::atoi(argv[2]);
    opts.cp = std::atoi(argv[3]);
    opts.ep = std::atoi(argv[4]);
    opts.timeout = std::chrono::seconds(argc == 6 ? std::atoi(argv[5]) : 60);
    const mapp::dist::ParallelState st = mapp::dist::init_from_env(opts);
    std::cout << "{\"rank\": " << st.rank() << ", \"coord\": [" << st.tp_rank() << ", "
              << st.cp_rank() << ", " << st.dp_rank() << ", " << st.pp_rank() << "], \"groups\": {";
    const std::pair<const char*, const std::string*> groups[] = {
        {"world", &st.world_group()}, {"tp", &st.tensor_group()},
        {"pp", &st.pipeline_group()}, {"dp", &st.data_group()},
        {"cp", &st.context_group()},  {"dp_cp", &st.data_context_group()},
        {"mp", &st.model_group()},    {"embd", &st.embedding_group()},
        {"ep", &st.expert_group()},   {"edp", &st.expert_data_group()}};
    bool first = true;
    for (const auto& [kind, name] : groups) {
      if (name->empty()) continue;
      at::Tensor t = at::full({3}, static_cast<double>(st.rank()), at::kDouble);
      mapp::torch_ext::all_reduce_sum_(t, *name);
      // Members in group-rank order: every member's id at its own position.
      at::Tensor ids = mapp::torch_ext::all_gather(at::full({1}, st.rank(), at::kLong), 0, *name);
      std::cout << (first ? "" : ", ") << "\"" << kind << "\": {\"name\": \"" << *name
                << "\", \"size\": " << mapp::torch_ext::group_size(*name)
                << ", \"me\": " << mapp::torch_ext::group_rank(*name)
                << ", \"sum\": " << t[0].item<double>() << ", \"ranks\": [";
      for (int64_t i = 0; i < ids.numel(); ++i)
        std::cout << (i ? ", " : "") << ids[i].item<int64_t>();
      std::cout << "]}";
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
