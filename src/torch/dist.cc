// mapp::dist: process groups from C++ (include/mapp/torch/dist.h).
//
// Gloo's headers are the one piece of the c10d API the torch wheel does not
// ship; CMake compiles this file with MAPP_HAVE_GLOO_HEADERS when it found
// them (Debian's libgloo-dev). Only ProcessGroupGloo's constructor, its
// Options and createDefaultDevice are used: their layout is torch's own
// header, the Gloo types stay behind pointers.
#include "mapp/torch/dist.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <utility>
#include <vector>

#include "mapp/common/check.h"
#include "mapp/torch/checkpoint_engine.h"
#include "mapp/torch/ops.h"
#include "c10d_util.h"

#ifdef MAPP_HAVE_GLOO_HEADERS
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "gloo_device.h"
#endif
#ifdef MAPP_HAVE_NCCL_PG
#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace mapp::dist {
namespace {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int to_int(const std::string& value, const char* name) {
  try {
    std::size_t used = 0;
    const int v = std::stoi(value, &used);
    if (used == value.size()) return v;
  } catch (const std::exception&) {
  }
  MAPP_CHECK(false, "environment variable ", name, "='", value, "' is not an integer");
  return 0;
}

std::string join(const std::vector<int>& v) {
  std::ostringstream os;
  for (std::size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
  return os.str();
}

// The group of `groups` (a partition of the world) that holds `rank`, and its index.
std::pair<int, std::vector<int>> mine(const std::vector<std::vector<int>>& groups, int rank) {
  for (std::size_t i = 0; i < groups.size(); ++i)
    if (std::find(groups[i].begin(), groups[i].end(), rank) != groups[i].end())
      return {static_cast<int>(i), groups[i]};
  MAPP_CHECK_STATE(false, "rank ", rank, " is in none of the groups");
  return {};
}

}  // namespace

LaunchEnv launch_env() {
  LaunchEnv env;
  if (get("RANK") || get("WORLD_SIZE")) {
    env.source = "torchrun";
    for (const char* name : {"RANK", "WORLD_SIZE"})
      MAPP_CHECK(get(name), "environment variable ", name,
                 " is not set (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                 "MASTER_PORT; set them yourself when launching each rank by hand)");
    env.rank = to_int(*get("RANK"), "RANK");
    env.world_size = to_int(*get("WORLD_SIZE"), "WORLD_SIZE");
    env.local_rank = get("LOCAL_RANK") ? to_int(*get("LOCAL_RANK"), "LOCAL_RANK") : 0;
  } else if (get("SLURM_PROCID")) {
    env.source = "slurm";
    MAPP_CHECK(get("SLURM_NTASKS"),
               "SLURM_PROCID is set but SLURM_NTASKS is not: launch with srun");
    env.rank = to_int(*get("SLURM_PROCID"), "SLURM_PROCID");
    env.world_size = to_int(*get("SLURM_NTASKS"), "SLURM_NTASKS");
    env.local_rank = get("SLURM_LOCALID") ? to_int(*get("SLURM_LOCALID"), "SLURM_LOCALID") : 0;
  } else {
    MAPP_CHECK(false,
               "no launcher environment: set RANK and WORLD_SIZE (and MASTER_ADDR, MASTER_PORT), "
               "e.g. launch with torchrun --no-python, or run under srun (SLURM_PROCID, "
               "SLURM_NTASKS)");
  }
  std::optional<std::string> addr = get("MASTER_ADDR");
  if (!addr && env.source == "slurm") addr = get("SLURM_LAUNCH_NODE_IPADDR");
  if (!addr && env.world_size == 1) addr = std::string("127.0.0.1");
  MAPP_CHECK(addr,
             "environment variable MASTER_ADDR is not set: the address of rank 0's host, "
             "where the rendezvous store listens");
  env.master_addr = *addr;
  if (auto port = get("MASTER_PORT")) env.master_port = to_int(*port, "MASTER_PORT");
  env.agent_store = get("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  MAPP_CHECK(env.world_size >= 1, "WORLD_SIZE must be >= 1, got ", env.world_size);
  MAPP_CHECK(env.rank >= 0 && env.rank < env.world_size, "RANK ", env.rank,
             " is outside the world of WORLD_SIZE ", env.world_size);
  MAPP_CHECK(env.master_port > 0 && env.master_port < 65536, "MASTER_PORT ", env.master_port,
             " is not a TCP port");
  return env;
}

std::vector<std::string> ParallelState::group_names() const {
  std::vector<std::string> out;
  for (const std::string* n : {&world_, &tensor_, &pipeline_, &data_, &context_, &data_context_,
                               &model_, &embedding_, &expert_, &expert_data_})
    if (!n->empty() && std::find(out.begin(), out.end(), *n) == out.end()) out.push_back(*n);
  return out;
}

bool available() {
#ifdef MAPP_HAVE_GLOO_HEADERS
  return true;
#else
  return false;
#endif
}

bool nccl_available() {
#if defined(MAPP_HAVE_GLOO_HEADERS) && defined(MAPP_HAVE_NCCL_PG)
  return true;
#else
  return false;
#endif
}

namespace {

// c10d's registry holds groups weakly: these strong references keep the
// groups init() created alive until destroy().
std::mutex& owned_mu() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, c10::intrusive_ptr<c10d::ProcessGroup>>& owned() {
  static auto* groups = new std::map<std::string, c10::intrusive_ptr<c10d::ProcessGroup>>();
  return *groups;  // leaked: outlives static destruction order at exit
}

}  // namespace

#ifdef MAPP_HAVE_GLOO_HEADERS
namespace {

// A process group of `ranks` (this process is `ranks[me]`) over `store`
// under `prefix`, registered with c10d as `name`: Gloo for CPU tensors and,
// with `nccl`, NCCL for CUDA tensors (torch's "cpu:gloo,cuda:nccl").
void create_group(const c10::intrusive_ptr<c10d::Store>& store, const std::string& name,
                  const std::vector<int>& ranks, int rank, std::chrono::milliseconds timeout,
                  bool nccl) {
  const int me = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  const int size = static_cast<int>(ranks.size());
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store);
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices.push_back(torch_ext::internal::gloo_device());  // honours GLOO_SOCKET_IFNAME
  c10::intrusive_ptr<c10d::ProcessGroupGloo> backend;
  try {
    backend = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, me, size, opts);
  } catch (const std::exception& e) {
    MAPP_FAIL_BACKEND("creating process group '", name, "' (ranks ", join(ranks),
                      ") failed after at most ", timeout.count(), " ms: ", e.what(),
                      " (did every rank start, with the same --tensor/--pipeline/--context "
                      "sizes?)");
  }
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(prefixed, me, size);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
#ifdef MAPP_HAVE_NCCL_PG
  if (nccl) {
    // Its own store prefix: NCCL's unique-id exchange must not meet Gloo's keys.
    auto nccl_store = c10::make_intrusive<c10d::PrefixStore>(name + "/nccl", store);
    auto nopts = c10d::ProcessGroupNCCL::Options::create();
    nopts->timeout = timeout;
    c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl_backend;
    try {
      nccl_backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(nccl_store, me, size, nopts);
    } catch (const std::exception& e) {
      MAPP_FAIL_BACKEND("creating the NCCL backend of process group '", name, "' (ranks ",
                        join(ranks), ") failed: ", e.what());
    }
    pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl_backend);
    pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  }
#else
  MAPP_CHECK(!nccl, "NCCL process groups need a megatronapp built with CUDA and a CUDA torch");
#endif
  pg->setGroupName(name);  // (names the backend too)
  std::lock_guard<std::mutex> lock(owned_mu());
  MAPP_CHECK_STATE(owned().count(name) == 0, "process group '", name,
                   "' exists already: call mapp::dist::destroy before initializing again");
  owned()[name] = pg;
  c10d::register_process_group(name, pg);
}

// Moves the group's CPU collectives through one shared-memory segment when
// every member runs on this node (Python: enable_shared_memory). Returns
// whether it attached.
bool attach_shared_memory(const c10::intrusive_ptr<c10d::Store>& store, const std::string& name,
                          const std::vector<int>& ranks, int rank) {
  const int size = static_cast<int>(ranks.size());
  const int me = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  auto group = torch_ext::internal::rendezvous_shm(*store, "mapp.shm/" + name + "/", me, size,
                                                   "group '" + name + "'");
  if (!group) return false;
  torch_ext::internal::shm_register(name, std::move(group));
  return true;
}

}  // namespace
#endif

ParallelState init(const LaunchEnv& env, const InitOptions& options) {
  MAPP_CHECK(options.backend == "gloo" || options.backend == "nccl", "backend '", options.backend,
             "': expected 'gloo' (CPU tensors) or 'nccl' (CUDA tensors, with Gloo for CPU ones)");
  const bool nccl = options.backend == "nccl";
  MAPP_CHECK(!nccl || nccl_available(),
             "backend 'nccl' is not available: this megatronapp::torch was built without CUDA "
             "or against a CPU-only torch; use 'gloo' or rebuild with the CUDA toolkit");
  MAPP_CHECK(options.timeout.count() > 0, "InitOptions.timeout must be positive");
  // The grid first: a world that does not divide fails here, on every rank,
  // before anyone waits for a peer.
  RankGrid grid(env.world_size, options.tp, options.pp, 0, options.cp, options.ep);
  ParallelState state(grid, env.rank, env.local_rank);
#ifndef MAPP_HAVE_GLOO_HEADERS
  MAPP_CHECK(false,
             "this megatronapp::torch was built without Gloo's headers, so it cannot "
             "create process groups from C++; install libgloo-dev and rebuild");
  return state;
#else
#ifdef MAPP_HAVE_NCCL_PG
  if (nccl) {  // one GPU per local rank, current before any NCCL communicator exists
    const int devices = static_cast<int>(c10::cuda::device_count());
    MAPP_CHECK(env.local_rank < devices, "backend 'nccl': LOCAL_RANK ", env.local_rank,
               " has no GPU (this node has ", devices,
               "); launch at most one rank per GPU (--nproc-per-node)");
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(env.local_rank));
  }
#endif
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(env.master_port);
  so.isServer = env.rank == 0 && !env.agent_store;
  so.numWorkers = env.world_size;
  so.waitWorkers = true;
  so.timeout = options.timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    MAPP_FAIL_BACKEND("rendezvous at ", env.master_addr, ":", env.master_port, " (rank ", env.rank,
                      " of ", env.world_size, ") failed: ", e.what(),
                      " (is rank 0 running, and MASTER_ADDR/MASTER_PORT the same on every rank?)");
  }
  set_rendezvous_store(store);  // checkpoint commits meet here (checkpoint_engine.h)
  const int r = env.rank;
  const bool shared = options.shared_memory && get("MAPP_SHM_COLLECTIVES").value_or("1") != "0";
  auto make = [&](const std::string& kind, const std::vector<std::vector<int>>& groups) {
    auto [index, ranks] = mine(groups, r);
    std::string name = "mapp." + kind + "." + std::to_string(index);
    create_group(store, name, ranks, r, options.timeout, nccl);
    if (shared && kind != "pp" && kind != "world") attach_shared_memory(store, name, ranks, r);
    return name;
  };
  std::vector<int> all(env.world_size);
  for (int i = 0; i < env.world_size; ++i) all[i] = i;
  // Every rank creates its groups in the same order (each creation is a
  // rendezvous among that group's members only).
  state.world_ = make("world", {all});
  state.tensor_ = make("tp", grid.groups({Axis::kTensor}));
  state.pipeline_ = make("pp", grid.groups({Axis::kPipeline}));
  state.data_ = make("dp", grid.groups({Axis::kData}));
  state.context_ = make("cp", grid.groups({Axis::kContext}));
  state.data_context_ = make("dp_cp", grid.groups({Axis::kData, Axis::kContext}));
  state.model_ = make("mp", grid.groups({Axis::kTensor, Axis::kPipeline}));
  std::vector<std::vector<int>> embedding;
  for (int i = 0; i < env.world_size; ++i) {
    auto g = grid.embedding_group(i);
    if (std::find(embedding.begin(), embedding.end(), g) == embedding.end()) embedding.push_back(g);
  }
  std::sort(embedding.begin(), embedding.end());
  const auto& own = grid.embedding_group(r);
  if (std::find(own.begin(), own.end(), r) != own.end())  // middle stages hold no embedding
    state.embedding_ = make("embd", embedding);
  state.expert_ = make("ep", grid.expert_groups());
  state.expert_data_ = make("edp", grid.expert_data_groups());
  return state;
#endif
}

ParallelState init_from_env(const InitOptions& options) { return init(launch_env(), options); }

void destroy(const ParallelState& state) {
  std::lock_guard<std::mutex> lock(owned_mu());
  for (const std::string& name : state.group_names()) {
    if (owned().erase(name) == 0) continue;  // not ours, or destroyed already
    if (torch_ext::shm_attached(name)) torch_ext::shm_detach(name);
    try {
      c10d::unregister_process_group(name);
    } catch (const std::exception&) {
      // already unregistered
    }
  }
}

}  // namespace mapp::dist
