// Checkpoints for C++ trainers (include/mapp/torch/checkpoint.h): what a C++
// model and optimizer hold, collected for the file engine
// (checkpoint_engine.h) that python/megatronapp/checkpoint uses too.
#include "mapp/torch/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <utility>

#include "mapp/common/check.h"
#include "mapp/common/log.h"
#include "mapp/torch/checkpoint_engine.h"
#include "mapp/torch/nn.h"
#include "mapp/torch/ops.h"

namespace mapp {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Named = std::vector<std::pair<std::string, at::Tensor>>;

[[noreturn]] void fail(const std::string& what) { throw ValueError(what); }

std::string torch_dtype_name(at::ScalarType t) {  // str(torch.float32) == "torch.float32"
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kHalf:
      return "torch.float16";
    case at::kLong:
      return "torch.int64";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

void barrier(const dist::ParallelState& st) {
  at::Tensor t = at::zeros({1}, at::kFloat);
  torch_ext::all_reduce_sum_(t, st.world_group());
}

// ---- names and slices (as the Python module) ------------------------------------------------
struct Param {
  std::string name;  // global
  at::Tensor tensor;
  nn::ParamAttrs attrs;
};

std::vector<Param> params_of(const std::vector<CheckpointChunk>& chunks) {
  static const std::regex layer(R"(layers\.(\d+)\.(.*))");
  std::vector<Param> out;
  for (const auto& c : chunks)
    for (const auto& item : c.module->named_parameters()) {
      std::string n = item.key();
      std::smatch m;
      if (!c.layer_numbers.empty() && std::regex_match(n, m, layer)) {
        const std::size_t i = std::stoul(m[1].str());
        MAPP_CHECK(i < c.layer_numbers.size(), "checkpoint: parameter '", n, "' of local layer ", i,
                   " but the chunk names ", c.layer_numbers.size(), " layer numbers");
        n = "layers." + std::to_string(c.layer_numbers[i]) + "." + m[2].str();
      }
      out.push_back({n, item.value(), nn::param_attrs(item.value())});
    }
  return out;
}

std::optional<TpSlice> slice_of(const Param& p, const dist::ParallelState& st) {
  if (!p.attrs.tensor_parallel || p.attrs.partition_dim < 0) return std::nullopt;
  const std::int64_t n = p.tensor.size(p.attrs.partition_dim);
  return TpSlice{p.attrs.partition_dim, st.tp_rank() * n, (st.tp_rank() + 1) * n};
}

json slice_json(const std::optional<TpSlice>& sl) {  // metadata.json's "tp_slice"
  return sl ? json::array({sl->dim, sl->lo, sl->hi}) : json(nullptr);
}

std::vector<std::int64_t> global_shape(const Param& p, const dist::ParallelState& st) {
  std::vector<std::int64_t> shape(p.tensor.sizes().begin(), p.tensor.sizes().end());
  if (p.attrs.tensor_parallel && p.attrs.partition_dim >= 0)
    shape[p.attrs.partition_dim] *= st.tp_size();
  return shape;
}

bool owns_model_copy(const Param& p, const dist::ParallelState& st) {
  if (st.dp_rank() != 0 || st.cp_rank() != 0 || p.attrs.shared_embedding_replica) return false;
  return slice_of(p, st).has_value() || st.tp_rank() == 0;
}

std::string source_name(const Param& p) {  // the replica loads the first stage's copy
  return p.attrs.shared_embedding_replica ? "word_embeddings.weight" : p.name;
}

torch::optim::AdamWParamState& adamw_state(torch::optim::AdamW& opt, const at::Tensor& p) {
  auto& slot = opt.state()[p.unsafeGetTensorImpl()];
  if (!slot) {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    slot = std::move(s);
  }
  return static_cast<torch::optim::AdamWParamState&>(*slot);
}

const torch::optim::AdamWParamState* find_state(torch::optim::AdamW& opt, const at::Tensor& p) {
  const auto it = opt.state().find(p.unsafeGetTensorImpl());
  return it == opt.state().end()
             ? nullptr
             : static_cast<const torch::optim::AdamWParamState*>(it->second.get());
}

}  // namespace

// ---- save -----------------------------------------------------------------------------------

std::string save_checkpoint(const std::string& dir, std::int64_t iteration,
                            const std::vector<CheckpointChunk>& chunks,
                            const dist::ParallelState& st, const CheckpointOptions& options) {
  MAPP_CHECK(!(options.adamw && options.distributed),
             "save_checkpoint: pass either a plain AdamW or a DistributedOptimizer, not both");
  wait_pending_save();  // one save at a time
  const std::string name = checkpoint_name(iteration);
  const int rank = st.rank();
  if (rank == 0) begin_checkpoint(dir, name);
  barrier(st);
  const std::vector<Param> params = params_of(chunks);
  const std::string fname = "rank" + std::to_string(rank) + ".safetensors";
  Named tensors;
  json index = json::array();
  auto piece = [&](const Param& p, const std::string& kind, std::int64_t lo, const at::Tensor& t) {
    const std::string key = kind == "param"
                                ? "model/" + p.name
                                : "optim/" + p.name + "/" + kind + "@" + std::to_string(lo);
    const at::Tensor flat = t.dim() ? t.detach().reshape(-1) : t.detach();
    tensors.emplace_back(key, kind == "param" ? t.detach() : flat);
    json flat_range = nullptr;
    if (lo >= 0) flat_range = {lo, lo + t.numel()};
    index.push_back({{"name", p.name},
                     {"kind", kind},
                     {"global_shape", global_shape(p, st)},
                     {"dtype", torch_dtype_name(t.scalar_type())},
                     {"tp_slice", slice_json(slice_of(p, st))},
                     {"flat", flat_range},
                     {"file", fname},
                     {"key", key}});
  };
  for (const auto& p : params)
    if (owns_model_copy(p, st)) piece(p, "param", 0, p.tensor);
  auto step_tensor = [](std::int64_t step) {
    return at::scalar_tensor(static_cast<double>(step), at::kFloat);
  };
  if (options.adamw != nullptr) {
    for (const auto& p : params) {
      if (!owns_model_copy(p, st)) continue;
      const auto* s = find_state(*options.adamw, p.tensor);
      if (s == nullptr) continue;
      piece(p, "exp_avg", 0, s->exp_avg());
      piece(p, "exp_avg_sq", 0, s->exp_avg_sq());
      piece(p, "step", -1, step_tensor(s->step()));
    }
  } else if (options.distributed != nullptr) {
    std::map<const c10::TensorImpl*, const Param*> by_impl;
    for (const auto& p : params) by_impl[p.tensor.unsafeGetTensorImpl()] = &p;
    for (const auto& sh : options.distributed->shards()) {
      const auto it = by_impl.find(sh.param.unsafeGetTensorImpl());
      MAPP_CHECK(it != by_impl.end(), "save_checkpoint: the DistributedOptimizer holds a ",
                 "parameter that is in none of the chunks");
      const Param& p = *it->second;
      if (p.attrs.shared_embedding_replica) continue;
      if (!slice_of(p, st) && st.tp_rank() != 0) continue;
      piece(p, "main", sh.lo, sh.main);
      if (const auto* s = find_state(options.distributed->inner(), sh.main)) {
        piece(p, "exp_avg", sh.lo, s->exp_avg());
        piece(p, "exp_avg_sq", sh.lo, s->exp_avg_sq());
        piece(p, "step", -1, step_tensor(s->step()));
      }
    }
  }
  // Per-rank state: RNG and codec state (restored under the same layout).
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    tensors.emplace_back("rank/rng_cpu", gen.get_state());
  }
  json ddp_meta = json::array();
  for (std::size_t ci = 0; ci < chunks.size(); ++ci) {
    DistributedDataParallel* ddp = chunks[ci].ddp;
    if (ddp == nullptr) continue;
    ddp_meta.push_back({{"chunk", ci}, {"sync_steps", ddp->synchronized_steps()}});
    for (const auto& [key, t] : ddp->codec_state())
      tensors.emplace_back("rank/ddp" + std::to_string(ci) + "/" + key, t);
  }
  const json meta = {{"format", kCheckpointFormat},
                     {"iteration", iteration},
                     {"config", json::parse(options.config_json)},
                     {"extra", json::parse(options.extra_json)},
                     {"parallel",
                      {{"world", st.world_size()},
                       {"tp", st.tp_size()},
                       {"pp", st.pp_size()},
                       {"dp", st.dp_size()},
                       {"ep", 1},
                       {"cp", st.cp_size()},
                       {"vpp", chunks.size()}}}};
  SaveJob job{dir,
              name,
              rank,
              st.world_size(),
              std::move(tensors),
              index.dump(),
              ddp_meta.dump(),
              {{"rank", std::to_string(rank)}, {"iteration", std::to_string(iteration)}},
              meta.dump()};
  static std::int64_t saves = 0;  // the same count on every rank: every rank saves alike
  const std::string prefix = "mapp_ckpt_cpp/" + std::to_string(++saves) + "/";
  if (options.async_save) {  // the blocking part: a host copy of everything
    for (auto& [key, t] : job.tensors) t = t.detach().to(at::kCPU, /*non_blocking=*/false, true);
    set_pending_save(
        std::make_shared<AsyncCheckpointSave>(std::move(job), rendezvous_store(), prefix));
    return "";
  }
  return run_save_job(std::move(job), rendezvous_store(), prefix);
}

// ---- load -----------------------------------------------------------------------------------

std::optional<CheckpointInfo> load_checkpoint(const std::string& dir_or_path,
                                              const std::vector<CheckpointChunk>& chunks,
                                              const dist::ParallelState& st,
                                              const CheckpointOptions& options) {
  const auto found = read_checkpoint_metadata(dir_or_path);
  if (!found) return std::nullopt;
  const std::string& path = found->first;
  const json meta = json::parse(found->second);
  const json want = json::parse(options.config_json);
  if (meta.contains("config") && meta["config"].is_object()) {
    std::string diff;
    for (const auto& [k, v] : want.items())
      if (meta["config"].contains(k) && meta["config"][k] != v)
        diff += (diff.empty() ? "" : ", ") + k + " = " + meta["config"][k].dump() +
                " in the checkpoint, " + v.dump() + " here";
    if (!diff.empty()) fail(path + ": checkpoint from an incompatible model: " + diff);
  }
  at::NoGradGuard no_grad;
  CheckpointLoader ld(path, found->second);
  const std::vector<Param> params = params_of(chunks);
  for (const auto& p : params)
    ld.into(source_name(p), "param", p.tensor.detach(), slice_of(p, st), global_shape(p, st));
  // Moments land in fresh tensors shaped like `target`; the optimizer takes
  // them once every read is done.
  std::vector<std::function<void()>> install;
  auto load_moments = [&](torch::optim::AdamW& opt, const at::Tensor& target, const Param& p,
                          const std::string& n, std::optional<std::pair<std::int64_t, std::int64_t>>
                                                    flat) {
    if (!ld.has(n, "exp_avg")) return;
    auto moment = [&](const char* kind) {
      at::Tensor m = at::empty_like(target, at::MemoryFormat::Contiguous);
      ld.into(n, kind, m, slice_of(p, st), global_shape(p, st), flat);
      return m;
    };
    at::Tensor avg = moment("exp_avg"), sq = moment("exp_avg_sq");
    std::optional<std::int64_t> step;
    if (ld.has(n, "step")) step = static_cast<std::int64_t>(ld.scalar(n, "step").item<double>());
    install.emplace_back([&opt, target, avg, sq, step] {
      auto& s = adamw_state(opt, target);
      s.exp_avg(avg);
      s.exp_avg_sq(sq);
      if (step) s.step(*step);
    });
  };
  if (options.adamw != nullptr) {
    for (const auto& p : params)
      load_moments(*options.adamw, p.tensor, p, source_name(p), std::nullopt);
  } else if (options.distributed != nullptr) {
    std::map<const c10::TensorImpl*, const Param*> by_impl;
    for (const auto& p : params) by_impl[p.tensor.unsafeGetTensorImpl()] = &p;
    for (const auto& sh : options.distributed->shards()) {
      const Param& p = *by_impl.at(sh.param.unsafeGetTensorImpl());
      const std::string n = source_name(p);
      const std::pair<std::int64_t, std::int64_t> flat{sh.lo, sh.hi};
      ld.into(n, ld.has(n, "main") ? "main" : "param", sh.main.detach(), slice_of(p, st),
              global_shape(p, st), flat);
      load_moments(options.distributed->inner(), sh.main, p, n, flat);
    }
  }
  ld.wait();
  for (auto& f : install) f();
  const json& par = meta["parallel"];
  const bool same = par.value("world", -1) == st.world_size() &&
                    par.value("tp", -1) == st.tp_size() && par.value("pp", -1) == st.pp_size() &&
                    par.value("dp", -1) == st.dp_size() && par.value("ep", 1) == 1 &&
                    par.value("cp", 1) == st.cp_size() &&
                    par.value("vpp", -1) == static_cast<int>(chunks.size());
  if (same) {
    std::map<std::string, at::Tensor> own;
    const TensorFile mine((fs::path(path) / ("rank" + std::to_string(st.rank()) + ".safetensors"))
                              .string());
    for (const auto& k : mine.keys())
      if (k.rfind("rank/", 0) == 0) own[k] = mine.tensor(k);
    if (own.count("rank/rng_cpu")) {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(own["rank/rng_cpu"]);
    }
    const json& ddp = meta.value("ddp", json::object());
    if (ddp.contains(std::to_string(st.rank())))
      for (const auto& entry : ddp[std::to_string(st.rank())]) {
        const std::size_t ci = entry.at("chunk");
        if (ci >= chunks.size() || chunks[ci].ddp == nullptr) continue;
        const std::string prefix = "rank/ddp" + std::to_string(ci) + "/";
        std::map<std::string, at::Tensor> codec;
        for (const auto& [k, t] : own)
          if (k.rfind(prefix, 0) == 0) codec[k.substr(prefix.size())] = t;
        chunks[ci].ddp->load_codec_state(codec, entry.at("sync_steps").get<int>());
      }
  } else if (st.rank() == 0) {
    log(LogLevel::kWarn,
        "checkpoint " + path + " was saved with layout " + par.dump() +
            "; loading into tp=" + std::to_string(st.tp_size()) +
            " pp=" + std::to_string(st.pp_size()) + " dp=" + std::to_string(st.dp_size()) +
            ": parameters and optimizer state resharded, RNG and gradient-codec state restart");
  }
  return CheckpointInfo{meta["iteration"].get<std::int64_t>(), path,
                        meta.value("extra", json::object()).dump(), same};
}

}  // namespace mapp
