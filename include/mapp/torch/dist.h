// Process groups from C++: a C++ trainer starts the same parallel layout that
// Python's megatronapp.initialize_model_parallel builds, without Python.
//
//   auto state = mapp::dist::init_from_env({.tp = 2, .pp = 2});
//   at::Tensor t = ...;
//   mapp::torch_ext::all_reduce_sum_(t, state.tensor_group());
//
// init_from_env reads the launcher's environment (torchrun: RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT; SLURM: SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID with MASTER_ADDR or SLURM_LAUNCH_NODE_IPADDR), meets the other
// ranks at a c10d::TCPStore (rank 0 serves it), and creates one process group
// per group of the RankGrid (tp, cp, dp, pp order, as Megatron): each member
// creates only its own groups, over a store prefix unique to the group. Every
// group is registered with c10d under its name, so every operator of
// mapp/torch/ops.h (and torch.ops.mapp.*) resolves it.
//
// Backend: "gloo" (CPU tensors), or "nccl": every group then has an NCCL
// backend for CUDA tensors (the current device is LOCAL_RANK's GPU) next to
// its Gloo backend for CPU ones, as torch's "cpu:gloo,cuda:nccl". Built only
// where Gloo's headers were found (Debian: libgloo-dev);
// mapp::dist::available() / nccl_available() say what this build has.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "mapp/topology/rank_grid.h"

namespace mapp::dist {

// Where this process sits in the job, as the launcher says.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;
  int master_port = 29500;
  std::string source;  // "torchrun" or "slurm"
  // torchrun's agent already serves the store at MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True): every rank connects as a client.
  bool agent_store = false;
};

// Reads the launcher's variables; throws ValueError naming the missing or
// malformed variable and how to set it.
LaunchEnv launch_env();

struct InitOptions {
  int tp = 1;                    // --tensor-model-parallel-size
  int pp = 1;                    // --pipeline-model-parallel-size
  int cp = 1;                    // --context-parallel-size
  int ep = 1;                    // --expert-model-parallel-size
  std::string backend = "gloo";  // or "nccl"
  // Groups whose members all run on this node move their CPU collectives
  // through shared memory (as Python's initialize_model_parallel does;
  // MAPP_SHM_COLLECTIVES=0 turns it off).
  bool shared_memory = true;
  // How long the rendezvous and every collective may take.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

// This rank's coordinates and the names of its registered groups.
class ParallelState {
 public:
  const RankGrid& grid() const { return grid_; }
  int rank() const { return rank_; }
  int world_size() const { return grid_.world_size(); }
  int local_rank() const { return local_rank_; }
  int tp_rank() const { return coord_.tp; }
  int cp_rank() const { return coord_.cp; }
  int dp_rank() const { return coord_.dp; }
  int pp_rank() const { return coord_.pp; }
  int tp_size() const { return grid_.tp(); }
  int cp_size() const { return grid_.cp(); }
  int dp_size() const { return grid_.dp(); }
  int pp_size() const { return grid_.pp(); }
  bool is_first_stage() const { return coord_.pp == 0; }
  bool is_last_stage() const { return coord_.pp == grid_.pp() - 1; }

  // Registered c10d group names (pass them to the mapp operators).
  const std::string& world_group() const { return world_; }
  const std::string& tensor_group() const { return tensor_; }
  const std::string& pipeline_group() const { return pipeline_; }
  const std::string& data_group() const { return data_; }
  const std::string& context_group() const { return context_; }
  // dp x cp: the ranks that hold the same weights (DDP and ZeRO-1 reduce here).
  const std::string& data_context_group() const { return data_context_; }
  // tp x pp: one model replica.
  const std::string& model_group() const { return model_; }
  // First and last stage of this (tp, cp, dp) position (tied embeddings);
  // empty on the middle stages, which are not members.
  const std::string& embedding_group() const { return embedding_; }
  const std::string& expert_group() const { return expert_; }
  const std::string& expert_data_group() const { return expert_data_; }

  // Every group name this state registered.
  std::vector<std::string> group_names() const;

 private:
  friend ParallelState init(const LaunchEnv&, const InitOptions&);
  ParallelState(RankGrid grid, int rank, int local_rank)
      : grid_(std::move(grid)), rank_(rank), local_rank_(local_rank), coord_(grid_.coord(rank)) {}
  RankGrid grid_;
  int rank_;
  int local_rank_;
  Coord coord_;
  std::string world_, tensor_, pipeline_, data_, context_, data_context_, model_, embedding_,
      expert_, expert_data_;
};

// Whether this build can create process groups from C++ (Gloo headers found).
bool available();
// Whether it can create NCCL backends (built with CUDA against a CUDA torch).
bool nccl_available();

// init(launch_env(), options). Throws ValueError for a world the sizes do not
// divide (naming every factor, as Python does) and BackendError when the
// rendezvous times out (naming the address and the ranks that did not come).
ParallelState init_from_env(const InitOptions& options = {});
ParallelState init(const LaunchEnv& env, const InitOptions& options);

// Unregisters every group that `state` registered (the groups are destroyed
// once no operator holds them).
void destroy(const ParallelState& state);

}  // namespace mapp::dist
