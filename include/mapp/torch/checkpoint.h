// Checkpoints for C++ trainers, in the files Python writes and reads
// (megatronapp.checkpoint, docs/checkpoint.md): a C++ run resumes a Python
// checkpoint and a Python run resumes a C++ one, at the same or another
// layout.
//
//   mapp::save_checkpoint("ckpt", it, {{model.ptr(), stage.layer_numbers, &ddp}}, st,
//                         {.adamw = &adamw, .config_json = R"({"hidden_size": 256})"});
//   auto info = mapp::load_checkpoint("ckpt", chunks, st, {.adamw = &adamw});  // nullopt: none
//
// The files themselves are the file engine's (checkpoint_engine.h); this
// collects what a C++ model and optimizer hold and where it loads.
//
// Layout of <dir>/iter_0000100/: rank<R>.safetensors (safetensors, with a
// CRC-32 per tensor in the header metadata) holding what rank R owns — its
// tensor-parallel shards of the model (data-parallel rank 0; replicated
// parameters from tensor rank 0; not the last stage's tied-embedding
// replica), its optimizer state (AdamW moments and step per parameter, or
// its ZeRO-1 pieces with their fp32 main values), its RNG state and its
// gradient-codec state — and metadata.json naming every piece by global name
// (layer numbers global), global shape, tensor-parallel slice and flat range.
// Saving commits atomically (temporary directory, fsyncs, rename, `latest`
// replaced by rename). Loading assembles each global tensor from its pieces
// (checking shapes, coverage and checksums) and takes this rank's slice, so
// any (tp, pp, dp, ZeRO or not) loads into any other; RNG and codec state
// are restored under the same layout only.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mapp/torch/checkpoint_engine.h"
#include "mapp/torch/ddp.h"
#include "mapp/torch/dist.h"

namespace mapp {

// One model chunk of this rank.
struct CheckpointChunk {
  std::shared_ptr<torch::nn::Module> module;
  // Global number of local layer i (module parameters named layers.<i>.*);
  // empty: local numbers are global.
  std::vector<std::int64_t> layer_numbers;
  DistributedDataParallel* ddp = nullptr;  // its codec state is saved per rank
};

struct CheckpointOptions {
  // The optimizer whose state is saved / restored: a plain AdamW over the
  // chunks' parameters, or the ZeRO-1 DistributedOptimizer (at most one).
  torch::optim::AdamW* adamw = nullptr;
  DistributedOptimizer* distributed = nullptr;
  // JSON objects: the model fields a checkpoint must agree on (loading
  // compares the fields present in both) and free-form extras (e.g.
  // consumed_samples), as pretrain_gpt.py writes them.
  std::string config_json = "{}";
  std::string extra_json = "{}";
  // Megatron's --async-save: returns once the state is copied to host memory;
  // a background thread writes, fsyncs and commits (wait_pending_save() for
  // its path; the next save waits for it first).
  bool async_save = false;
};

struct CheckpointInfo {
  std::int64_t iteration = 0;
  std::string path;          // the iter_* directory loaded
  std::string extra_json;    // the extras saved with it
  bool same_layout = false;  // RNG and codec state were restored
};

// Collective (every rank calls it): writes and commits <dir>/iter_<7 digits>
// and points <dir>/latest at it; returns its path ("" with async_save: see
// wait_pending_save in checkpoint_engine.h). The ranks meet through the store
// dist::init joined for the commit (the engine's run_save_job).
std::string save_checkpoint(const std::string& dir, std::int64_t iteration,
                            const std::vector<CheckpointChunk>& chunks,
                            const dist::ParallelState& state, const CheckpointOptions& options);

// Loads <dir_or_path> (an iter_* directory, or the one <dir>/latest names)
// into this rank's chunks and optimizer; nullopt when the directory has no
// checkpoint. No collective. Throws ValueError naming the file and tensor for
// anything corrupt or incompatible (including a differing model config).
std::optional<CheckpointInfo> load_checkpoint(const std::string& dir_or_path,
                                              const std::vector<CheckpointChunk>& chunks,
                                              const dist::ParallelState& state,
                                              const CheckpointOptions& options);

}  // namespace mapp
