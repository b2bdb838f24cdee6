// Checkpoints for C++ trainers (include/mapp/torch/checkpoint.h), file for
// file the format of python/megatronapp/checkpoint (docs/checkpoint.md).
#include "mapp/torch/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <utility>

#include "mapp/common/check.h"
#include "mapp/common/log.h"
#include "mapp/torch/nn.h"
#include "mapp/torch/ops.h"

namespace mapp {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Named = std::vector<std::pair<std::string, at::Tensor>>;
constexpr int kFormatVersion = 1;

[[noreturn]] void fail(const std::string& what) { throw ValueError(what); }

// ---- CRC-32 (zlib's polynomial) and safetensors dtypes ------------------------------------
std::uint32_t crc32(const void* data, std::size_t n) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t c = 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

const std::vector<std::pair<const char*, at::ScalarType>>& dtypes() {
  static const std::vector<std::pair<const char*, at::ScalarType>> d = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  return d;
}

const char* dtype_code(at::ScalarType t) {
  for (const auto& [code, type] : dtypes())
    if (type == t) return code;
  fail(std::string("checkpoint: tensors of dtype ") + c10::toString(t) + " cannot be saved");
}

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

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  MAPP_CHECK(fd >= 0, "checkpoint: cannot open '", path, "' to fsync it");
  const int rc = ::fsync(fd);
  ::close(fd);
  MAPP_CHECK(rc == 0, "checkpoint: fsync of '", path, "' failed");
}

void write_file(const std::string& path, const std::string& bytes) {
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    MAPP_CHECK(f.good(), "checkpoint: cannot write '", path, "'");
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.flush();
    MAPP_CHECK(f.good(), "checkpoint: writing '", path, "' failed (disk full?)");
  }
  fsync_path(path, false);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path + ": cannot open checkpoint file: no such file");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
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

json tp_slice(const Param& p, const dist::ParallelState& st) {
  if (!p.attrs.tensor_parallel || p.attrs.partition_dim < 0) return nullptr;
  const std::int64_t n = p.tensor.size(p.attrs.partition_dim);
  return json::array({p.attrs.partition_dim, st.tp_rank() * n, (st.tp_rank() + 1) * n});
}

std::vector<std::int64_t> global_shape(const Param& p, const dist::ParallelState& st) {
  std::vector<std::int64_t> shape(p.tensor.sizes().begin(), p.tensor.sizes().end());
  if (p.attrs.tensor_parallel && p.attrs.partition_dim >= 0)
    shape[p.attrs.partition_dim] *= st.tp_size();
  return shape;
}

bool owns_model_copy(const Param& p, const dist::ParallelState& st) {
  if (st.dp_rank() != 0 || st.cp_rank() != 0 || p.attrs.shared_embedding_replica) return false;
  return !tp_slice(p, st).is_null() || st.tp_rank() == 0;
}

at::Tensor mine(const at::Tensor& full, const Param& p, const dist::ParallelState& st) {
  const json sl = tp_slice(p, st);
  if (sl.is_null()) return full;
  const std::int64_t lo = sl[1], hi = sl[2];
  return full.narrow(sl[0].get<std::int64_t>(), lo, hi - lo);
}

std::string source_name(const Param& p) {  // the replica loads the first stage's copy
  return p.attrs.shared_embedding_replica ? "word_embeddings.weight" : p.name;
}

// ---- the assembler: global tensors from stored pieces --------------------------------------
class Assembler {
 public:
  Assembler(std::string path, const json& meta) : path_(std::move(path)) {
    for (const auto& pc : meta.at("pieces"))
      by_key_[{pc.at("name").get<std::string>(), pc.at("kind").get<std::string>()}].push_back(pc);
  }
  bool has(const std::string& name, const std::string& kind) const {
    return by_key_.count({name, kind}) > 0;
  }
  at::Tensor scalar(const std::string& name, const std::string& kind) {
    const json& pc = by_key_.at({name, kind}).front();
    return tensor(pc);
  }
  at::Tensor full(const std::string& name, const std::string& kind,
                  const std::vector<std::int64_t>& want, at::ScalarType dtype) {
    const auto it = by_key_.find({name, kind});
    if (it == by_key_.end()) fail(path_ + ": no '" + kind + "' stored for tensor '" + name + "'");
    const auto gshape = it->second.front().at("global_shape").get<std::vector<std::int64_t>>();
    if (gshape != want)
      fail(path_ + ": tensor '" + name + "' has global shape " + json(gshape).dump() +
           " in the checkpoint but " + json(want).dump() +
           " in this model (a checkpoint from an incompatible model?)");
    at::Tensor out = at::empty(gshape, dtype);
    std::map<json, std::vector<const json*>> shards;  // tp_slice -> pieces
    for (const json& pc : it->second) shards[pc.at("tp_slice")].push_back(&pc);
    std::int64_t covered = 0;
    for (const auto& [sl, pieces] : shards) {
      at::Tensor region = sl.is_null()
                              ? out
                              : out.narrow(sl[0].get<std::int64_t>(), sl[1].get<std::int64_t>(),
                                           sl[2].get<std::int64_t>() - sl[1].get<std::int64_t>());
      at::Tensor flat = at::empty({region.numel()}, dtype);
      at::Tensor seen = at::zeros({region.numel()}, at::kBool);
      for (const json* pc : pieces) {
        const std::int64_t lo = (*pc)["flat"][0], hi = (*pc)["flat"][1];
        const at::Tensor t = tensor(*pc).reshape(-1);
        if (t.numel() != hi - lo || hi > flat.numel())
          fail(path_ + "/" + (*pc)["file"].get<std::string>() + ": piece " +
               (*pc)["key"].get<std::string>() + " of '" + name + "' has " +
               std::to_string(t.numel()) + " elements for range [" + std::to_string(lo) + ", " +
               std::to_string(hi) + ")");
        flat.slice(0, lo, hi).copy_(t.to(dtype));
        seen.slice(0, lo, hi).fill_(true);
      }
      if (!seen.all().item<bool>())
        fail(path_ + ": '" + kind + "' of tensor '" + name + "' is incomplete (missing " +
             std::to_string((~seen).sum().item<std::int64_t>()) + " elements)");
      region.copy_(flat.view(region.sizes()));
      covered += region.numel();
    }
    if (covered != out.numel())
      fail(path_ + ": tensor '" + name + "' is not fully covered by its shards");
    return out;
  }

 private:
  at::Tensor tensor(const json& pc) {
    const std::string file = pc.at("file"), key = pc.at("key");
    auto f = files_.find(file);
    if (f == files_.end()) {
      std::map<std::string, at::Tensor> m;
      for (auto& [k, t] : read_safetensors((fs::path(path_) / file).string())) m[k] = t;
      f = files_.emplace(file, std::move(m)).first;
    }
    const auto t = f->second.find(key);
    if (t == f->second.end()) fail(path_ + "/" + file + ": no tensor '" + key + "' in this file");
    return t->second;
  }

  std::string path_;
  std::map<std::pair<std::string, std::string>, std::vector<json>> by_key_;
  std::map<std::string, std::map<std::string, at::Tensor>> files_;
};

std::optional<std::string> latest_of(const std::string& dir) {
  const fs::path ptr = fs::path(dir) / "latest";
  if (!fs::exists(ptr)) return std::nullopt;
  std::string name = read_file(ptr.string());
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
  if (!std::regex_match(name, std::regex(R"(iter_\d{7}(\.\d+)?)")))
    fail(ptr.string() + ": does not name a checkpoint ('" + name.substr(0, 40) + "')");
  const fs::path path = fs::path(dir) / name;
  if (!fs::is_regular_file(path / "metadata.json"))
    fail(ptr.string() + " names " + name + ", which has no metadata.json");
  return path.string();
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

// ---- safetensors ----------------------------------------------------------------------------

std::int64_t write_safetensors(const std::string& path, const Named& tensors,
                               const std::vector<std::pair<std::string, std::string>>& metadata) {
  json header = json::object(), crcs = json::object();
  json meta = json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  std::vector<at::Tensor> host;
  std::int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    at::Tensor h = t.detach().to(at::kCPU).contiguous();
    const auto bytes = static_cast<std::int64_t>(h.nbytes());
    header[name] = {{"dtype", dtype_code(h.scalar_type())},
                    {"shape", std::vector<std::int64_t>(h.sizes().begin(), h.sizes().end())},
                    {"data_offsets", {offset, offset + bytes}}};
    crcs[name] = bytes ? crc32(h.data_ptr(), static_cast<std::size_t>(bytes)) : 0u;
    offset += bytes;
    host.push_back(h);
  }
  meta["crc32"] = crcs.dump();
  header["__metadata__"] = meta;
  std::string head = header.dump();
  head.append((8 - head.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::string blob(8 + head.size() + static_cast<std::size_t>(offset), '\0');
  const std::uint64_t n = head.size();
  for (int i = 0; i < 8; ++i) blob[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  std::memcpy(blob.data() + 8, head.data(), head.size());
  char* data = blob.data() + 8 + head.size();
  for (const auto& h : host) {
    if (h.nbytes()) std::memcpy(data, h.data_ptr(), h.nbytes());
    data += h.nbytes();
  }
  write_file(path, blob);
  return static_cast<std::int64_t>(blob.size());
}

Named read_safetensors(const std::string& path) {
  const std::string blob = read_file(path);
  auto bad = [&](const std::string& why) {
    fail(path + ": not a readable safetensors file (truncated or corrupted: " + why + ")");
  };
  if (blob.size() < 8) bad("shorter than its header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(blob[i]);
  if (n > blob.size() - 8) bad("header length " + std::to_string(n) + " past the end");
  json header;
  try {
    header = json::parse(blob.substr(8, n));
  } catch (const json::exception& e) {
    bad(std::string("malformed header: ") + e.what());
  }
  if (!header.is_object()) bad("the header is not a JSON object");
  json crcs = json::object();
  if (header.contains("__metadata__") && header["__metadata__"].contains("crc32")) {
    try {
      crcs = json::parse(header["__metadata__"]["crc32"].get<std::string>());
    } catch (const json::exception&) {
      fail(path + ": malformed crc32 metadata");
    }
  }
  const std::size_t base = 8 + n, data_bytes = blob.size() - base;
  Named out;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      const std::string code = e.at("dtype");
      at::ScalarType type = at::kByte;
      bool known = false;
      for (const auto& [c, t] : dtypes())
        if (code == c) type = t, known = true;
      if (!known) bad("tensor '" + name + "' has unknown dtype " + code);
      const auto shape = e.at("shape").get<std::vector<std::int64_t>>();
      const auto off = e.at("data_offsets").get<std::vector<std::uint64_t>>();
      at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
      if (off.size() != 2 || off[1] < off[0] || off[1] > data_bytes ||
          off[1] - off[0] != t.nbytes())
        bad("tensor '" + name + "' has data offsets outside the file or of the wrong size");
      if (t.nbytes()) std::memcpy(t.data_ptr(), blob.data() + base + off[0], t.nbytes());
      if (crcs.contains(name) &&
          crcs[name].get<std::uint32_t>() != (t.nbytes() ? crc32(t.data_ptr(), t.nbytes()) : 0u))
        fail(path + ": checksum mismatch in tensor '" + name + "' (the file is corrupted)");
      out.emplace_back(name, t);
    } catch (const json::exception& ex) {
      bad("tensor '" + name + "': " + ex.what());
    }
  }
  return out;
}

// ---- save -----------------------------------------------------------------------------------

std::string save_checkpoint(const std::string& dir, std::int64_t iteration,
                            const std::vector<CheckpointChunk>& chunks,
                            const dist::ParallelState& st, const CheckpointOptions& options) {
  MAPP_CHECK(!(options.adamw && options.distributed),
             "save_checkpoint: pass either a plain AdamW or a DistributedOptimizer, not both");
  char name[32];
  std::snprintf(name, sizeof(name), "iter_%07lld", static_cast<long long>(iteration));
  const fs::path tmp = fs::path(dir) / (std::string(".tmp.") + name);
  const int rank = st.rank();
  if (rank == 0) {
    fs::create_directories(dir);
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
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
                     {"tp_slice", tp_slice(p, st)},
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
      if (tp_slice(p, st).is_null() && st.tp_rank() != 0) continue;
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
  const std::int64_t nbytes =
      write_safetensors((tmp / fname).string(), tensors,
                        {{"rank", std::to_string(rank)}, {"iteration", std::to_string(iteration)}});
  write_file(
      (tmp / ("index.rank" + std::to_string(rank) + ".json")).string(),
      json({{"rank", rank}, {"pieces", index}, {"ddp", ddp_meta}, {"bytes", nbytes}}).dump());
  barrier(st);
  std::string final_path;
  if (rank == 0) {
    json pieces = json::array(), ddp = json::object();
    for (int r = 0; r < st.world_size(); ++r) {
      const json idx =
          json::parse(read_file((tmp / ("index.rank" + std::to_string(r) + ".json")).string()));
      for (const auto& pc : idx.at("pieces")) pieces.push_back(pc);
      ddp[std::to_string(r)] = idx.at("ddp");
    }
    json meta = {{"format", kFormatVersion},
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
                   {"vpp", chunks.size()}}},
                 {"pieces", pieces},
                 {"ddp", ddp}};
    write_file((tmp / "metadata.json").string(), meta.dump());
    fsync_path(tmp.string(), true);
    fs::path final_dir = fs::path(dir) / name;
    for (int n = 1; fs::exists(final_dir); ++n)  // never replace a committed checkpoint
      final_dir = fs::path(dir) / (std::string(name) + "." + std::to_string(n));
    fs::rename(tmp, final_dir);
    fsync_path(dir, true);
    const fs::path pointer = fs::path(dir) / ".latest.tmp";
    write_file(pointer.string(), final_dir.filename().string() + "\n");
    fs::rename(pointer, fs::path(dir) / "latest");
    fsync_path(dir, true);
    final_path = final_dir.string();
    log(LogLevel::kInfo, "saved checkpoint " + final_path);
  }
  barrier(st);
  return rank == 0 ? final_path : latest_of(dir).value_or("");
}

// ---- load -----------------------------------------------------------------------------------

std::optional<CheckpointInfo> load_checkpoint(const std::string& dir_or_path,
                                              const std::vector<CheckpointChunk>& chunks,
                                              const dist::ParallelState& st,
                                              const CheckpointOptions& options) {
  std::string path = dir_or_path;
  if (!fs::is_regular_file(fs::path(path) / "metadata.json")) {
    const auto l = latest_of(dir_or_path);
    if (!l) return std::nullopt;
    path = *l;
  }
  const std::string mpath = (fs::path(path) / "metadata.json").string();
  json meta;
  try {
    meta = json::parse(read_file(mpath));
  } catch (const json::exception& e) {
    fail(mpath + ": unreadable checkpoint metadata (" + e.what() + ")");
  }
  if (!meta.is_object() || meta.value("format", -1) != kFormatVersion)
    fail(mpath + ": not a megatronapp checkpoint of format " + std::to_string(kFormatVersion));
  for (const char* k : {"iteration", "parallel", "pieces"})
    if (!meta.contains(k)) fail(mpath + ": missing '" + k + "'");
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
  Assembler asm_(path, meta);
  const std::vector<Param> params = params_of(chunks);
  for (const auto& p : params) {
    const at::Tensor full =
        asm_.full(source_name(p), "param", global_shape(p, st), p.tensor.scalar_type());
    p.tensor.detach().copy_(mine(full, p, st));
  }
  auto load_moments = [&](torch::optim::AdamW& opt, const at::Tensor& target, const Param& p,
                          const std::string& n, std::int64_t lo, std::int64_t hi) {
    if (!asm_.has(n, "exp_avg")) return;
    auto moment = [&](const char* kind) {  // this rank's part, shaped like `target`
      at::Tensor m = mine(asm_.full(n, kind, global_shape(p, st), at::kFloat), p, st);
      if (lo >= 0) m = m.reshape(-1).slice(0, lo, hi);
      return m.to(target.scalar_type()).reshape(target.sizes()).clone();
    };
    auto& s = adamw_state(opt, target);
    s.exp_avg(moment("exp_avg"));
    s.exp_avg_sq(moment("exp_avg_sq"));
    if (asm_.has(n, "step"))
      s.step(static_cast<std::int64_t>(asm_.scalar(n, "step").item<double>()));
  };
  if (options.adamw != nullptr) {
    for (const auto& p : params) load_moments(*options.adamw, p.tensor, p, source_name(p), -1, -1);
  } else if (options.distributed != nullptr) {
    std::map<const c10::TensorImpl*, const Param*> by_impl;
    for (const auto& p : params) by_impl[p.tensor.unsafeGetTensorImpl()] = &p;
    for (const auto& sh : options.distributed->shards()) {
      const Param& p = *by_impl.at(sh.param.unsafeGetTensorImpl());
      const std::string n = source_name(p);
      const at::Tensor full =
          asm_.full(n, asm_.has(n, "main") ? "main" : "param", global_shape(p, st), at::kFloat);
      sh.main.detach().copy_(mine(full, p, st).reshape(-1).slice(0, sh.lo, sh.hi));
      load_moments(options.distributed->inner(), sh.main, p, n, sh.lo, sh.hi);
    }
  }
  const json& par = meta["parallel"];
  const bool same = par.value("world", -1) == st.world_size() &&
                    par.value("tp", -1) == st.tp_size() && par.value("pp", -1) == st.pp_size() &&
                    par.value("dp", -1) == st.dp_size() && par.value("ep", 1) == 1 &&
                    par.value("cp", 1) == st.cp_size() &&
                    par.value("vpp", -1) == static_cast<int>(chunks.size());
  if (same) {
    std::map<std::string, at::Tensor> own;
    for (auto& [k, t] : read_safetensors(
             (fs::path(path) / ("rank" + std::to_string(st.rank()) + ".safetensors")).string()))
      own[k] = t;
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
