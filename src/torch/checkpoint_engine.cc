// The checkpoint file engine (include/mapp/torch/checkpoint_engine.h).
#include "mapp/torch/checkpoint_engine.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>
#include <regex>

#include "mapp/common/check.h"
#include "mapp/common/log.h"

namespace mapp {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Named = std::vector<std::pair<std::string, at::Tensor>>;

[[noreturn]] void fail(const std::string& what) { throw ValueError(what); }

const std::vector<std::pair<const char*, at::ScalarType>>& dtypes() {
  static const std::vector<std::pair<const char*, at::ScalarType>> d = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  return d;
}

const char* dtype_code(const std::string& path, at::ScalarType t) {
  for (const auto& [code, type] : dtypes())
    if (type == t) return code;
  fail(path + ": tensors of dtype " + c10::toString(t) + " cannot be saved");
}

std::int64_t prod(const std::vector<std::int64_t>& v, std::size_t from = 0) {
  std::int64_t p = 1;
  for (std::size_t i = from; i < v.size(); ++i) p *= v[i];
  return p;
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  MAPP_CHECK(fd >= 0, "checkpoint: cannot open '", path, "' to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  MAPP_CHECK(rc == 0, "checkpoint: fsync of '", path, "' failed: ", std::strerror(errno));
}

// A file written whole and fsynced before it is closed.
class OutFile {
 public:
  explicit OutFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail(path_ + ": cannot write checkpoint file: " + std::strerror(errno));
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const void* data, std::size_t n) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail(path_ + ": writing failed (disk full?): " + std::strerror(errno));
      p += w;
      n -= static_cast<std::size_t>(w);
    }
  }
  void close() {
    if (::fsync(fd_) != 0) fail(path_ + ": fsync failed: " + std::strerror(errno));
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) fail(path_ + ": close failed: " + std::strerror(errno));
  }

 private:
  std::string path_;
  int fd_ = -1;
};

void write_text(const std::string& path, const std::string& text) {
  OutFile f(path);
  f.write(text.data(), text.size());
  f.close();
}

std::string read_text(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path + ": cannot open: " + std::strerror(errno));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      fail(path + ": cannot read: " + std::strerror(errno));
    }
    if (n == 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

// ---- geometry: flat ranges of row-major regions as boxes contiguous in memory ---------------
struct Box {
  std::vector<std::int64_t> start, size;
  std::int64_t offset;  // elements from the range's first
};

// [lo, hi) of a tensor of `shape`, as boxes in `shape`'s coordinates.
std::vector<Box> boxes_of(const std::vector<std::int64_t>& shape, std::int64_t lo,
                          std::int64_t hi) {
  if (shape.empty()) return {Box{{}, {}, 0}};
  std::vector<Box> out;
  const std::int64_t inner = prod(shape, 1);
  if (inner == 0 || hi <= lo) return out;
  const std::vector<std::int64_t> tail(shape.begin() + 1, shape.end());
  auto lift = [&](std::int64_t row, const std::vector<Box>& sub, std::int64_t base) {
    for (const Box& b : sub) {
      Box x{{row}, {1}, base + b.offset};
      x.start.insert(x.start.end(), b.start.begin(), b.start.end());
      x.size.insert(x.size.end(), b.size.begin(), b.size.end());
      out.push_back(std::move(x));
    }
  };
  const std::int64_t r0 = lo / inner, r1 = (hi - 1) / inner;
  if (r0 == r1) {
    if (tail.empty()) return {Box{{lo}, {hi - lo}, 0}};
    lift(r0, boxes_of(tail, lo - r0 * inner, hi - r0 * inner), 0);
    return out;
  }
  std::int64_t first = r0;
  if (lo % inner) {
    lift(r0, boxes_of(tail, lo % inner, inner), 0);
    first = r0 + 1;
  }
  const std::int64_t last = hi % inner == 0 ? r1 : r1 - 1;
  if (last >= first) {
    Box b{{first}, {last - first + 1}, first * inner - lo};
    for (std::int64_t d : tail) b.start.push_back(0), b.size.push_back(d);
    out.push_back(std::move(b));
  }
  if (hi % inner) lift(r1, boxes_of(tail, 0, hi - r1 * inner), r1 * inner - lo);
  return out;
}

// (shape, offset per dim) of a tensor-parallel region in global coordinates.
std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> region(
    const std::vector<std::int64_t>& global, const std::optional<TpSlice>& tp) {
  std::vector<std::int64_t> shape = global, off(global.size(), 0);
  if (tp) {
    MAPP_CHECK(tp->dim >= 0 && tp->dim < static_cast<std::int64_t>(shape.size()) &&
                   tp->lo >= 0 && tp->lo <= tp->hi && tp->hi <= shape[tp->dim],
               "checkpoint: tensor-parallel slice [", tp->dim, ", ", tp->lo, ", ", tp->hi,
               ") outside a tensor of ", shape.size(), " dims");
    shape[tp->dim] = tp->hi - tp->lo;
    off[tp->dim] = tp->lo;
  }
  return {shape, off};
}

std::string shape_str(const std::vector<std::int64_t>& shape) {  // as Python prints a list
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::vector<std::int64_t> strides_of(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> st(shape.size());
  std::int64_t acc = 1;
  for (std::size_t d = shape.size(); d-- > 0;) st[d] = acc, acc *= shape[d];
  return st;
}

std::uint32_t crc_of(const at::Tensor& t) {
  return t.numel() ? crc32(t.data_ptr(), t.nbytes()) : 0u;
}

}  // namespace

// ---- CRC-32, slicing by 8 ----------------------------------------------------------------------

std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc) {
  static const auto table = [] {
    std::array<std::array<std::uint32_t, 256>, 8> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (std::uint32_t i = 0; i < 256; ++i)
        t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
    return t;
  }();
  std::uint32_t c = ~crc;
  const auto* p = static_cast<const unsigned char*>(data);
  while (n >= 8) {  // little-endian words
    std::uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = table[7][lo & 0xFF] ^ table[6][(lo >> 8) & 0xFF] ^ table[5][(lo >> 16) & 0xFF] ^
        table[4][lo >> 24] ^ table[3][hi & 0xFF] ^ table[2][(hi >> 8) & 0xFF] ^
        table[1][(hi >> 16) & 0xFF] ^ table[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return ~c;
}

// ---- tensor files ----------------------------------------------------------------------------

std::int64_t write_safetensors(const std::string& path, const Named& tensors,
                               const std::vector<std::pair<std::string, std::string>>& metadata) {
  // Host copies only of what is not already contiguous host memory.
  std::vector<at::Tensor> host;
  host.reserve(tensors.size());
  json header = json::object(), crcs = json::object(), meta = json::object();
  std::int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    MAPP_CHECK(name != "__metadata__" && !header.contains(name), path,
               ": cannot serialize the tensors (the name '", name, "' is used twice or reserved)");
    at::Tensor h = t.detach();
    if (!h.device().is_cpu() || !h.is_contiguous()) h = h.to(at::kCPU).contiguous();
    const auto bytes = static_cast<std::int64_t>(h.nbytes());
    header[name] = {{"dtype", dtype_code(path, h.scalar_type())},
                    {"shape", std::vector<std::int64_t>(h.sizes().begin(), h.sizes().end())},
                    {"data_offsets", {offset, offset + bytes}}};
    crcs[name] = crc_of(h);
    offset += bytes;
    host.push_back(std::move(h));
  }
  for (const auto& [k, v] : metadata) meta[k] = v;
  meta["crc32"] = crcs.dump();
  header["__metadata__"] = meta;
  std::string head = header.dump();
  head.append((8 - head.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  OutFile f(path);
  std::array<unsigned char, 8> len{};
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((head.size() >> (8 * i)) & 0xFF);
  f.write(len.data(), len.size());
  f.write(head.data(), head.size());
  for (const auto& h : host)
    if (h.nbytes()) f.write(h.data_ptr(), h.nbytes());
  f.close();
  return static_cast<std::int64_t>(8 + head.size()) + offset;
}

TensorFile::TensorFile(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0)
    fail(path_ + ": cannot open checkpoint file: " +
         (errno == ENOENT ? std::string("no such file") : std::strerror(errno)));
  try {
    struct stat sb {};
    MAPP_CHECK(::fstat(fd_, &sb) == 0, path_, ": cannot stat: ", std::strerror(errno));
    const auto size = static_cast<std::int64_t>(sb.st_size);
    if (size < 8)
      fail(path_ + ": not a readable safetensors file (truncated: " + std::to_string(size) +
           " bytes)");
    std::array<unsigned char, 8> len{};
    read(len.data(), 8, 0);
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
    if (n > static_cast<std::uint64_t>(std::min<std::int64_t>(size - 8, 1LL << 30)))
      fail(path_ + ": not a readable safetensors file (header of " + std::to_string(n) +
           " bytes in a file of " + std::to_string(size) + ": truncated or corrupted)");
    std::string text(n, '\0');
    read(text.data(), static_cast<std::int64_t>(n), 8);
    json header;
    try {
      header = json::parse(text);
    } catch (const json::exception& e) {
      fail(path_ + ": not a readable safetensors file (malformed header: " + e.what() + ")");
    }
    if (!header.is_object())
      fail(path_ + ": not a readable safetensors file (malformed header: not an object)");
    const std::int64_t base = 8 + static_cast<std::int64_t>(n);
    std::vector<std::pair<std::int64_t, std::string>> order;
    for (const auto& [key, e] : header.items()) {
      if (key == "__metadata__") {
        if (e.is_object())
          for (const auto& [k, v] : e.items()) metadata_[k] = v.is_string() ? v.get<std::string>()
                                                                         : v.dump();
        continue;
      }
      bool ok = false;
      Entry ent{};
      try {
        const std::string code = e.at("dtype");
        bool known = false;
        for (const auto& [c, t] : dtypes())
          if (code == c) ent.dtype = t, known = true;
        ent.shape = e.at("shape").get<std::vector<std::int64_t>>();
        const auto off = e.at("data_offsets").get<std::vector<std::int64_t>>();
        const std::int64_t numel = prod(ent.shape);
        const bool shape_ok = std::all_of(ent.shape.begin(), ent.shape.end(),
                                          [](std::int64_t d) { return d >= 0; });
        if (known && shape_ok && off.size() == 2) {
          const std::int64_t item = c10::elementSize(ent.dtype);
          ent.offset = base + off[0];
          ent.nbytes = off[1] - off[0];
          ok = 0 <= off[0] && off[0] <= off[1] && base + off[1] <= size &&
               ent.nbytes == numel * item;
        }
      } catch (const json::exception&) {
        ok = false;
      }
      if (!ok)
        fail(path_ + ": tensor '" + key +
             "' has a malformed or out-of-file entry in the header (truncated or corrupted "
             "file)");
      order.emplace_back(ent.offset, key);
      entries_.emplace(key, std::move(ent));
    }
    std::sort(order.begin(), order.end());
    for (auto& [o, k] : order) keys_.push_back(std::move(k));
    const auto c = metadata_.find("crc32");
    if (c != metadata_.end()) {
      try {
        const json table = json::parse(c->second);
        for (const auto& [k, v] : table.items()) crcs_[k] = v.get<std::uint32_t>();
      } catch (const json::exception&) {
        fail(path_ + ": malformed crc32 metadata");
      }
    }
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

TensorFile::~TensorFile() {
  if (fd_ >= 0) ::close(fd_);
}

const TensorFile::Entry& TensorFile::entry(const std::string& key) const {
  const auto it = entries_.find(key);
  if (it == entries_.end()) fail(path_ + ": no tensor '" + key + "' in this file");
  return it->second;
}

void TensorFile::read(void* dst, std::int64_t nbytes, std::int64_t offset) const {
  auto* p = static_cast<char*>(dst);
  std::int64_t done = 0;
  while (done < nbytes) {
    const ssize_t got = ::pread(fd_, p + done, static_cast<std::size_t>(nbytes - done),
                                static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail(path_ + ": read failed: " + std::strerror(errno));
    if (got == 0) fail(path_ + ": file ended early at byte " + std::to_string(offset + done));
    done += got;
  }
}

at::Tensor TensorFile::tensor(const std::string& key, bool verify) const {
  const Entry& e = entry(key);
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  if (e.nbytes) read(t.data_ptr(), e.nbytes, e.offset);
  if (verify) check(key, crc_of(t));
  return t;
}

void TensorFile::check(const std::string& key, std::uint32_t crc) const {
  const auto it = crcs_.find(key);
  if (it != crcs_.end() && it->second != crc)
    fail(path_ + ": checksum mismatch in tensor '" + key + "' (the file is corrupted)");
}

std::uint32_t TensorFile::crc_streamed(const std::string& key, std::int64_t budget) const {
  const Entry& e = entry(key);
  std::vector<unsigned char> buf(static_cast<std::size_t>(std::min(e.nbytes, budget)));
  std::uint32_t crc = 0;
  for (std::int64_t done = 0; done < e.nbytes;) {
    const std::int64_t n = std::min(budget, e.nbytes - done);
    read(buf.data(), n, e.offset + done);
    crc = crc32(buf.data(), static_cast<std::size_t>(n), crc);
    done += n;
  }
  return crc;
}

Named read_safetensors(const std::string& path,
                       const std::optional<std::vector<std::string>>& names) {
  TensorFile f(path);
  Named out;
  if (names) {
    std::vector<std::string> missing;
    for (const auto& k : *names)
      if (std::find(f.keys().begin(), f.keys().end(), k) == f.keys().end()) missing.push_back(k);
    if (!missing.empty()) {
      std::string list;
      for (std::size_t i = 0; i < missing.size() && i < 5; ++i)
        list += (i ? ", '" : "'") + missing[i] + "'";
      fail(path + ": no tensor(s) [" + list + "] in this file");
    }
  }
  for (const auto& k : names ? *names : f.keys()) out.emplace_back(k, f.tensor(k));
  return out;
}

// ---- the commit ------------------------------------------------------------------------------

std::string checkpoint_name(std::int64_t iteration) {
  char name[32];
  std::snprintf(name, sizeof(name), "iter_%07lld", static_cast<long long>(iteration));
  return name;
}

std::string begin_checkpoint(const std::string& dir, const std::string& name) {
  const fs::path tmp = fs::path(dir) / (".tmp." + name);
  std::error_code ec;
  fs::create_directories(dir, ec);
  MAPP_CHECK(!ec, "checkpoint: cannot create '", dir, "': ", ec.message());
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  MAPP_CHECK(!ec, "checkpoint: cannot create '", tmp.string(), "': ", ec.message());
  return tmp.string();
}

std::int64_t write_rank_files(const std::string& dir, const std::string& name, int rank,
                              const Named& tensors, const std::string& pieces_json,
                              const std::string& ddp_json,
                              const std::vector<std::pair<std::string, std::string>>& metadata) {
  const fs::path tmp = fs::path(dir) / (".tmp." + name);
  const std::string r = std::to_string(rank);
  const std::int64_t nbytes =
      write_safetensors((tmp / ("rank" + r + ".safetensors")).string(), tensors, metadata);
  json index = {{"rank", rank},
                {"pieces", json::parse(pieces_json)},
                {"ddp", json::parse(ddp_json)},
                {"bytes", nbytes}};
  write_text((tmp / ("index.rank" + r + ".json")).string(), index.dump());
  return nbytes;
}

std::string commit_checkpoint(const std::string& dir, const std::string& name,
                              const std::string& meta_json, int world) {
  const fs::path tmp = fs::path(dir) / (".tmp." + name);
  json meta = json::parse(meta_json);
  MAPP_CHECK(meta.is_object(), "commit_checkpoint: the metadata must be a JSON object");
  if (world > 0) {
    json pieces = json::array(), ddp = json::object();
    for (int r = 0; r < world; ++r) {
      const std::string p = (tmp / ("index.rank" + std::to_string(r) + ".json")).string();
      json idx;
      try {
        idx = json::parse(read_text(p));
      } catch (const json::exception& e) {
        fail(p + ": unreadable rank index (" + e.what() + ")");
      }
      for (auto& pc : idx.at("pieces")) pieces.push_back(std::move(pc));
      ddp[std::to_string(r)] = idx.at("ddp");
    }
    meta["pieces"] = std::move(pieces);
    meta["ddp"] = std::move(ddp);
  }
  write_text((tmp / "metadata.json").string(), meta.dump());
  fsync_path(tmp.string(), true);
  fs::path final_dir = fs::path(dir) / name;
  for (int n = 1; fs::exists(final_dir); ++n)  // never replace a committed checkpoint
    final_dir = fs::path(dir) / (name + "." + std::to_string(n));
  fs::rename(tmp, final_dir);
  fsync_path(dir, true);
  const fs::path pointer = fs::path(dir) / ".latest.tmp";
  write_text(pointer.string(), final_dir.filename().string() + "\n");
  fs::rename(pointer, fs::path(dir) / "latest");
  fsync_path(dir, true);
  return final_dir.string();
}

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  const fs::path ptr = fs::path(dir) / "latest";
  if (!fs::exists(ptr)) return std::nullopt;
  std::string name = read_text(ptr.string());
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.front())))
    name.erase(name.begin());
  static const std::regex valid(R"(iter_\d{7}(\.\d+)?)");
  if (!std::regex_match(name, valid))
    fail(ptr.string() + ": does not name a checkpoint ('" + name.substr(0, 40) + "')");
  const fs::path path = fs::path(dir) / name;
  if (!fs::is_regular_file(path / "metadata.json"))
    fail(ptr.string() + " names " + name + ", which has no metadata.json");
  return path.string();
}

std::optional<std::pair<std::string, std::string>> read_checkpoint_metadata(
    const std::string& dir_or_path) {
  std::string path = dir_or_path;
  if (!fs::is_regular_file(fs::path(path) / "metadata.json")) {
    const auto l = latest_checkpoint(dir_or_path);
    if (!l) return std::nullopt;
    path = *l;
  }
  const std::string mpath = (fs::path(path) / "metadata.json").string();
  json meta;
  try {
    meta = json::parse(read_text(mpath));
  } catch (const json::exception& e) {
    fail(mpath + ": unreadable checkpoint metadata (" + e.what() + ")");
  } catch (const ValueError& e) {
    fail(mpath + ": unreadable checkpoint metadata (" + e.what() + ")");
  }
  if (!meta.is_object() || !meta.contains("format") || meta["format"] != kCheckpointFormat)
    fail(mpath + ": not a megatronapp checkpoint of format " + std::to_string(kCheckpointFormat));
  for (const char* k : {"iteration", "parallel", "pieces"})
    if (!meta.contains(k)) fail(mpath + ": missing '" + k + "'");
  return std::make_pair(path, meta.dump());
}

// ---- streamed reads --------------------------------------------------------------------------

struct CheckpointLoader::Job {
  const TensorFile* file;
  std::string key;
  std::int64_t box_off;  // bytes: the stored box's first element in the file
  at::ScalarType dtype;
  std::vector<std::int64_t> box_shape, start, size;
  at::Tensor dview;
  bool whole;  // the stored piece is exactly this destination box
  // A device destination: the stream current in the caller's thread when the
  // read was queued. The copy is issued on it, so it is ordered after the
  // destination's producers and before whatever the caller runs next on it.
  std::optional<c10::Stream> stream;
};

CheckpointLoader::CheckpointLoader(std::string path, const std::string& metadata_json,
                                   LoaderOptions options)
    : path_(std::move(path)), options_(options) {
  options_.budget = std::max<std::int64_t>(options_.budget, 1 << 16);
  json meta;
  try {
    meta = json::parse(metadata_json);
    for (const json& pc : meta.at("pieces")) {
      Piece p;
      p.name = pc.at("name");
      p.kind = pc.at("kind");
      p.file = pc.at("file");
      p.key = pc.at("key");
      p.global_shape = pc.at("global_shape").get<std::vector<std::int64_t>>();
      if (pc.contains("tp_slice") && !pc["tp_slice"].is_null()) {
        const auto s = pc["tp_slice"].get<std::vector<std::int64_t>>();
        MAPP_CHECK(s.size() == 3, "tp_slice of 3 numbers");
        p.tp = TpSlice{s[0], s[1], s[2]};
      }
      if (pc.contains("flat") && !pc["flat"].is_null()) {
        const auto f = pc["flat"].get<std::vector<std::int64_t>>();
        MAPP_CHECK(f.size() == 2, "flat range of 2 numbers");
        p.lo = f[0];
        p.hi = f[1];
      }
      by_key_[{p.name, p.kind}].push_back(pieces_.size());
      pieces_.push_back(std::move(p));
    }
  } catch (const std::exception& e) {
    fail(path_ + ": malformed checkpoint metadata (" + e.what() + ")");
  }
  int n = options_.threads;
  if (n <= 0) n = static_cast<int>(std::min(8u, std::max(1u, std::thread::hardware_concurrency())));
  for (int i = 0; i < n; ++i) threads_.emplace_back([this] { worker(); });
}

CheckpointLoader::~CheckpointLoader() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return queue_.empty() && running_ == 0; });
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  finished_.clear();  // in this thread, after the workers are gone
}

void CheckpointLoader::worker() {
  for (;;) {
    std::function<void()> work;
    bool skip;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      work = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
      skip = error_ != nullptr;  // after a failure, the rest is not worth reading
    }
    std::exception_ptr err;
    if (!skip) {
      try {
        work();
      } catch (...) {
        err = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (err && !error_) error_ = err;
      // Not destroyed here: the job's last reference to a tensor Python owns
      // must drop in a thread that may take the GIL (the caller of wait()).
      finished_.push_back(std::move(work));
      --running_;
    }
    idle_cv_.notify_all();
  }
}

void CheckpointLoader::submit(std::function<void()> work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(work));
  }
  cv_.notify_one();
}

void CheckpointLoader::wait() {
  std::exception_ptr err;
  std::vector<std::function<void()>> finished;
  {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return queue_.empty() && running_ == 0; });
    err = error_;
    error_ = nullptr;
    finished.swap(finished_);
  }
  finished.clear();
  if (err) std::rethrow_exception(err);
}

bool CheckpointLoader::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.empty() && running_ == 0;
}

const TensorFile& CheckpointLoader::file(const std::string& name) {
  std::lock_guard<std::mutex> lock(files_mu_);
  auto it = files_.find(name);
  if (it == files_.end())
    it = files_.emplace(name, std::make_unique<TensorFile>((fs::path(path_) / name).string()))
             .first;
  return *it->second;
}

bool CheckpointLoader::has(const std::string& name, const std::string& kind) const {
  return by_key_.count({name, kind}) > 0;
}

std::vector<std::string> CheckpointLoader::kinds(const std::string& name) const {
  std::vector<std::string> out;  // by_key_ is ordered by (name, kind)
  for (auto it = by_key_.lower_bound({name, ""}); it != by_key_.end() && it->first.first == name;
       ++it)
    out.push_back(it->first.second);
  return out;
}

at::Tensor CheckpointLoader::scalar(const std::string& name, const std::string& kind) {
  const auto it = by_key_.find({name, kind});
  if (it == by_key_.end()) fail(path_ + ": no '" + kind + "' stored for tensor '" + name + "'");
  const Piece& pc = pieces_[it->second.front()];
  return file(pc.file).tensor(pc.key, options_.verify);
}

void CheckpointLoader::into(const std::string& name, const std::string& kind,
                            const at::Tensor& dest, const std::optional<TpSlice>& tp,
                            const std::vector<std::int64_t>& want_shape,
                            const std::optional<std::pair<std::int64_t, std::int64_t>>& flat) {
  const auto it = by_key_.find({name, kind});
  if (it == by_key_.end()) fail(path_ + ": no '" + kind + "' stored for tensor '" + name + "'");
  const std::vector<std::int64_t> gshape = pieces_[it->second.front()].global_shape;
  if (gshape != want_shape)
    fail(path_ + ": tensor '" + name + "' has global shape " + shape_str(gshape) +
         " in the checkpoint but " + shape_str(want_shape) +
         " in this model (a checkpoint from an incompatible model?)");
  const auto [dshape, doff] = region(gshape, tp);
  const std::int64_t dnumel = prod(dshape);
  const std::int64_t dlo = flat ? flat->first : 0, dhi = flat ? flat->second : dnumel;
  if (dest.numel() != dhi - dlo)
    fail(path_ + ": '" + name + "' destination has " + std::to_string(dest.numel()) +
         " elements for range [" + std::to_string(dlo) + ", " + std::to_string(dhi) + ")");
  if (!dest.is_contiguous()) fail(path_ + ": '" + name + "': destination is not contiguous");
  const at::Tensor dflat = dest.reshape(-1);
  const bool dcpu = dflat.device().is_cpu();
  std::optional<c10::Stream> stream;
  if (!dcpu)
    stream = c10::impl::VirtualGuardImpl(dflat.device().type()).getStream(dflat.device());
  std::vector<Job> jobs;
  std::int64_t covered = 0;
  for (const std::size_t i : it->second) {
    const Piece& pc = pieces_[i];
    const auto [pshape, poff] = region(gshape, pc.tp);
    const std::int64_t plo = pc.lo, phi = pc.hi < 0 ? prod(pshape) : pc.hi;
    const TensorFile& f = file(pc.file);
    const TensorFile::Entry& e = f.entry(pc.key);
    const std::int64_t item = c10::elementSize(e.dtype);
    if (e.nbytes != (phi - plo) * item || phi > prod(pshape) || plo < 0)
      fail(path_ + "/" + pc.file + ": piece " + pc.key + " of '" + name + "' has " +
           std::to_string(e.nbytes / item) + " elements for range [" + std::to_string(plo) +
           ", " + std::to_string(phi) + ")");
    if (pshape == dshape && poff == doff && plo == dlo && phi == dhi &&
        dflat.scalar_type() == e.dtype && dcpu) {  // saved under this layout: read in place
      covered += dflat.numel();
      jobs.push_back({&f, pc.key, e.offset, e.dtype, {dflat.numel()}, {0}, {dflat.numel()},
                      dflat, true, stream});
      continue;
    }
    for (const Box& pb : boxes_of(pshape, plo, phi)) {
      std::vector<std::int64_t> gps(pb.start.size());
      for (std::size_t d = 0; d < gps.size(); ++d) gps[d] = pb.start[d] + poff[d];
      for (const Box& db : boxes_of(dshape, dlo, dhi)) {
        const std::size_t nd = db.start.size();
        std::vector<std::int64_t> lo(nd), hi(nd), size(nd), src(nd), dst(nd);
        bool empty = false;
        for (std::size_t d = 0; d < nd; ++d) {
          const std::int64_t gd = db.start[d] + doff[d];
          lo[d] = std::max(gps[d], gd);
          hi[d] = std::min(gps[d] + pb.size[d], gd + db.size[d]);
          if (hi[d] <= lo[d]) empty = true;
          size[d] = hi[d] - lo[d];
          src[d] = lo[d] - gps[d];
          dst[d] = lo[d] - gd;
        }
        if (empty) continue;
        covered += prod(size);
        at::Tensor dview = dflat.narrow(0, db.offset, prod(db.size)).view(db.size);
        for (std::size_t d = 0; d < nd; ++d) dview = dview.narrow(d, dst[d], size[d]);
        const bool whole = size == pb.size && prod(pb.size) == phi - plo &&
                           dview.is_contiguous() && dview.scalar_type() == e.dtype && dcpu;
        jobs.push_back({&f, pc.key, e.offset + pb.offset * item, e.dtype, pb.size, src, size,
                        dview, whole, stream});
      }
    }
  }
  if (covered != dest.numel())
    fail(path_ + ": '" + kind + "' of tensor '" + name + "' is " +
         (covered < dest.numel() ? "incomplete (missing " +
                                       std::to_string(dest.numel() - covered) + " elements)"
                                 : std::string("stored twice (overlapping pieces)")));
  for (auto& job : jobs)
    submit([this, job = std::move(job)] { run_job(job); });
}

void CheckpointLoader::run_job(const Job& job) {
  const TensorFile& f = *job.file;
  const std::pair<std::string, std::string> id{f.path(), job.key};
  if (job.whole) {
    if (job.dview.numel())
      f.read(job.dview.data_ptr(), static_cast<std::int64_t>(job.dview.nbytes()), job.box_off);
    if (options_.verify) {
      f.check(job.key, crc_of(job.dview));
      std::lock_guard<std::mutex> lock(checked_mu_);
      checked_.insert(id);
    }
    return;
  }
  std::optional<c10::StreamGuard> guard;  // sets the device too
  if (job.stream) guard.emplace(*job.stream);
  copy_box(f, job.box_off, job.dtype, strides_of(job.box_shape), job.start, job.size, job.dview);
  if (options_.verify) {
    bool first;
    {
      std::lock_guard<std::mutex> lock(checked_mu_);
      first = checked_.insert(id).second;
    }
    if (first) f.check(job.key, f.crc_streamed(job.key, options_.budget));
  }
}

void CheckpointLoader::copy_box(const TensorFile& f, std::int64_t box_off, at::ScalarType dtype,
                                const std::vector<std::int64_t>& strides,
                                std::vector<std::int64_t> start, std::vector<std::int64_t> size,
                                at::Tensor dview) {
  const std::int64_t item = c10::elementSize(dtype);
  std::int64_t first = 0, last = 0;
  for (std::size_t d = 0; d < size.size(); ++d) {
    first += start[d] * strides[d];
    last += (start[d] + size[d] - 1) * strides[d];
  }
  const std::int64_t span = last - first + 1;
  if (span * item > options_.budget) {
    const auto d = static_cast<std::size_t>(
        std::find_if(size.begin(), size.end(), [](std::int64_t n) { return n > 1; }) -
        size.begin());
    if (d < size.size()) {  // split the box in two along its first dimension > 1
      const std::int64_t h = size[d] / 2;
      std::vector<std::int64_t> a = size, b = size, s2 = start;
      a[d] = h;
      b[d] = size[d] - h;
      s2[d] += h;
      const auto dim = static_cast<std::int64_t>(d);
      copy_box(f, box_off, dtype, strides, start, a, dview.narrow(dim, 0, h));
      copy_box(f, box_off, dtype, strides, s2, b, dview.narrow(dim, h, size[d] - h));
      return;
    }
  }
  at::Tensor buf = at::empty({span}, at::TensorOptions().dtype(dtype));
  f.read(buf.data_ptr(), span * item, box_off + first * item);
  dview.copy_(buf.as_strided(size, strides));
}

// ---- a rank's save as one job ------------------------------------------------------------

std::string run_save_job(SaveJob job, const c10::intrusive_ptr<c10d::Store>& store,
                         const std::string& prefix) {
  MAPP_CHECK(store, "run_save_job: no rendezvous store (initialize the process groups first)");
  const auto t0 = std::chrono::steady_clock::now();
  write_rank_files(job.dir, job.name, job.rank, job.tensors, job.pieces_json, job.ddp_json,
                   job.metadata);
  job.tensors.clear();  // the host copies go as soon as they are on disk
  auto keys = [&](const char* what) {
    std::vector<std::string> out;
    for (int r = 0; r < job.world; ++r) out.push_back(prefix + what + "/" + std::to_string(r));
    return out;
  };
  auto arrive = [&](const char* what) {
    store->set(prefix + what + "/" + std::to_string(job.rank), std::vector<std::uint8_t>{'1'});
  };
  std::string final_path;
  try {
    arrive("written");
    if (job.rank == 0) {
      store->wait(keys("written"));
      final_path = commit_checkpoint(job.dir, job.name, job.meta_json, job.world);
      store->set(prefix + "path", std::vector<std::uint8_t>(final_path.begin(), final_path.end()));
      log(LogLevel::kInfo,
          "saved checkpoint " + final_path + " (" +
              std::to_string(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                                 .count()) +
              " s to write and commit)");
    }
    arrive("committed");
    store->wait(keys("committed"));
    if (job.rank != 0) {
      const std::vector<std::uint8_t> p = store->get(prefix + "path");
      final_path.assign(p.begin(), p.end());
    }
  } catch (const c10::Error& e) {  // the store's (DistStoreError: a timeout, a lost server)
    MAPP_FAIL_BACKEND("checkpoint ", job.name, ": rank ", job.rank, " could not meet the other ",
                      job.world - 1, " ranks through the store (", e.what_without_backtrace(),
                      "); did a rank fail while writing?");
  }
  return final_path;
}

AsyncCheckpointSave::AsyncCheckpointSave(SaveJob job, c10::intrusive_ptr<c10d::Store> store,
                                         std::string prefix)
    : thread_([this, job = std::move(job), store = std::move(store),
               prefix = std::move(prefix)]() mutable {
        try {
          path_ = run_save_job(std::move(job), store, prefix);
        } catch (...) {
          error_ = std::current_exception();
        }
        done_.store(true);
      }) {}

AsyncCheckpointSave::~AsyncCheckpointSave() {
  if (thread_.joinable()) thread_.join();
}

std::string AsyncCheckpointSave::wait() {
  if (thread_.joinable()) thread_.join();
  if (error_) std::rethrow_exception(error_);
  return path_;
}

namespace {
std::mutex pending_mu;
std::shared_ptr<AsyncCheckpointSave> pending;
c10::intrusive_ptr<c10d::Store> joined_store;
}  // namespace

void set_pending_save(std::shared_ptr<AsyncCheckpointSave> save) {
  wait_pending_save();
  std::lock_guard<std::mutex> lock(pending_mu);
  pending = std::move(save);
}

std::string wait_pending_save() {
  std::shared_ptr<AsyncCheckpointSave> p;
  {
    std::lock_guard<std::mutex> lock(pending_mu);
    p = std::move(pending);
    pending.reset();
  }
  return p ? p->wait() : std::string();
}

c10::intrusive_ptr<c10d::Store> rendezvous_store() {
  std::lock_guard<std::mutex> lock(pending_mu);
  return joined_store;
}

void set_rendezvous_store(c10::intrusive_ptr<c10d::Store> store) {
  std::lock_guard<std::mutex> lock(pending_mu);
  joined_store = std::move(store);
}

}  // namespace mapp
