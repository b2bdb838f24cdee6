// Collectives over c10d process groups resolved by name.
//
// Why by name: the group registry (GroupRegistry.hpp) is the one handle that
// both Python (`group.group_name`) and C++ can hold without sharing pybind11
// internals, and it survives torch.compile tracing as a plain string.
#include <ATen/ATen.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "c10d_util.h"
#include "mapp/comm/shm_group.h"
#include "mapp/common/check.h"
#include "mapp/torch/comm_engine.h"
#include "mapp/torch/ops.h"

namespace mapp::torch_ext {
namespace internal {

// Groups whose members share this node and a shared-memory segment: their CPU
// tensors move through it (mapp::comm::ShmGroup) instead of Gloo's sockets.
std::mutex& shm_mu() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, std::shared_ptr<comm::ShmGroup>>& shm_groups() {
  static auto* groups = new std::map<std::string, std::shared_ptr<comm::ShmGroup>>();
  return *groups;  // leaked: outlives static destruction order at exit
}

std::shared_ptr<comm::ShmGroup> shm_for(const at::Tensor& t, const std::string& group_name) {
  if (!t.device().is_cpu()) return nullptr;
  std::lock_guard<std::mutex> lock(shm_mu());
  auto it = shm_groups().find(group_name);
  return it == shm_groups().end() ? nullptr : it->second;
}

// Elementwise dst += src over `bytes` of `dtype`, by ATen (every dtype, vectorized).
comm::ShmGroup::Reduce aten_add(at::ScalarType dtype) {
  return [dtype](void* dst, const void* src, std::size_t bytes) {
    const auto n = static_cast<std::int64_t>(bytes / c10::elementSize(dtype));
    const auto opts = at::TensorOptions().dtype(dtype);
    at::from_blob(dst, {n}, opts).add_(at::from_blob(const_cast<void*>(src), {n}, opts));
  };
}

bool has_shm(const at::Tensor& t, const std::string& group_name) {
  return shm_for(t, group_name) != nullptr;
}

// Runs `on_shm(group)` through the group's shared memory when it has one for
// `t`, else waits for the c10d Work that `issue()` returns; traced as `op`.
template <typename OnShm, typename Issue>
void dispatch(const char* op, const std::string& group_name, const at::Tensor& t, OnShm&& on_shm,
              Issue&& issue) {
  if (auto shm = shm_for(t, group_name)) {
    traced(op, group_name, t.nbytes(), [&] { on_shm(*shm); });
  } else {
    run(op, group_name, std::forward<Issue>(issue), t.nbytes());
  }
}

void all_reduce_base(at::Tensor& buf, const std::string& group_name, c10d::ProcessGroup& pg,
                     const char* op) {
  std::vector<at::Tensor> tensors{buf};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  dispatch(
      op, group_name, buf,
      [&](comm::ShmGroup& g) {
        g.all_reduce(buf.data_ptr(), buf.nbytes(), buf.element_size(), aten_add(buf.scalar_type()),
                     collective_timeout());
      },
      [&] { return pg.allreduce(tensors, opts); });
}

void all_gather_base(at::Tensor& out, const at::Tensor& in, const std::string& group_name,
                     c10d::ProcessGroup& pg, const char* op) {
  at::Tensor src = in;  // c10d's signatures take mutable references
  dispatch(
      op, group_name, in,
      [&](comm::ShmGroup& g) {
        g.all_gather(in.data_ptr(), in.nbytes(), out.data_ptr(), collective_timeout());
      },
      [&] { return pg._allgather_base(out, src); });
}

void reduce_scatter_base(at::Tensor& out, const at::Tensor& in, const std::string& group_name,
                         c10d::ProcessGroup& pg, const char* op) {
  at::Tensor src = in;
  dispatch(
      op, group_name, in,
      [&](comm::ShmGroup& g) {
        g.reduce_scatter(in.data_ptr(), out.nbytes(), out.data_ptr(), out.element_size(),
                         aten_add(out.scalar_type()), collective_timeout());
      },
      [&] { return pg._reduce_scatter_base(out, src); });
}

void all_to_all_base(at::Tensor& out, const at::Tensor& in, const std::string& group_name,
                     c10d::ProcessGroup& pg, const char* op) {
  at::Tensor src = in;
  std::vector<std::int64_t> splits;  // equal splits
  dispatch(
      op, group_name, in,
      [&](comm::ShmGroup& g) {
        g.all_to_all(in.data_ptr(), in.nbytes() / g.world(), out.data_ptr(), collective_timeout());
      },
      [&] { return pg.alltoall_base(out, src, splits, splits); });
}

std::string node_identity() {
  auto read = [](const char* path) {
    std::ifstream f(path);
    std::string v;
    return (f && std::getline(f, v)) ? v : std::string("?");
  };
  auto inode = [](const char* path) {
    struct stat st {};
    return ::stat(path, &st) == 0 ? std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino)
                                  : std::string("?");
  };
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  return std::string(host) + "|" + read("/proc/sys/kernel/random/boot_id") + "|" +
         inode("/dev/shm") + "|" + inode("/proc/self/ns/net");
}

namespace {
std::string as_string(const std::vector<std::uint8_t>& v) { return {v.begin(), v.end()}; }
std::vector<std::uint8_t> as_bytes(const std::string& s) { return {s.begin(), s.end()}; }
}  // namespace

std::shared_ptr<comm::ShmGroup> rendezvous_shm(c10d::Store& store, const std::string& key, int me,
                                               int size, const std::string& label) {
  if (size <= 1) return nullptr;
  const std::string identity = node_identity();
  store.set(key + "node/" + std::to_string(me), as_bytes(identity));
  std::vector<std::string> nodes;
  for (int i = 0; i < size; ++i) nodes.push_back(key + "node/" + std::to_string(i));
  store.wait(nodes);
  for (const auto& k : nodes)
    if (as_string(store.get(k)) != identity) return nullptr;  // spans nodes: the backend
  const auto slot = static_cast<std::size_t>(tunable_int("MAPP_SHM_SLOT_BYTES"));
  std::shared_ptr<comm::ShmGroup> group;
  std::string err;
  if (me == 0) {
    const std::string name =
        "/mapp-" + std::to_string(::getpid()) + "-" +
        std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000007);
    try {
      group = comm::ShmGroup::create(name, me, size, slot);
      store.set(key + "name", as_bytes(name));
    } catch (const std::exception& e) {
      store.set(key + "name", as_bytes(std::string("!") + e.what()));
    }
  }
  store.wait({key + "name"});
  const std::string name = as_string(store.get(key + "name"));
  const bool created = name.rfind('!', 0) != 0;
  if (!created) {
    err = name.substr(1);
  } else if (me != 0) {
    try {
      group = comm::ShmGroup::open(name, me, size, slot);
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  store.set(key + "ok/" + std::to_string(me), as_bytes(err.empty() ? "1" : err));
  std::vector<std::string> oks;
  for (int i = 0; i < size; ++i) oks.push_back(key + "ok/" + std::to_string(i));
  store.wait(oks);  // every member has opened (or failed)
  std::string first_error;
  for (const auto& k : oks) {
    const std::string v = as_string(store.get(k));
    if (v != "1" && first_error.empty()) first_error = v;
  }
  if (me == 0 && group) group->unlink();
  if (!first_error.empty()) {
    if (me == 0)
      std::cerr << "[megatronapp] " << label
                << " stays on Gloo: shared memory failed: " << first_error << std::endl;
    return nullptr;
  }
  return group;
}

void shm_register(const std::string& group_name, std::shared_ptr<comm::ShmGroup> group) {
  std::lock_guard<std::mutex> lock(shm_mu());
  shm_groups()[group_name] = std::move(group);
}

}  // namespace internal

namespace {

using internal::all_gather_base;
using internal::all_reduce_base;
using internal::reduce_scatter_base;

// Gloo cannot reduce bfloat16; CPU half-precision tensors travel as float32.
bool needs_upcast(const at::Tensor& t) {
  return t.device().is_cpu() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
}

std::int64_t normalize_dim(const at::Tensor& t, std::int64_t dim, const char* op) {
  const std::int64_t nd = t.dim();
  MAPP_CHECK(nd >= 1, op, ": expected a tensor with at least one dimension, got a scalar");
  MAPP_CHECK(dim >= -nd && dim < nd, op, ": dim ", dim, " is out of range for a ", nd, "-d tensor");
  return dim < 0 ? dim + nd : dim;
}

using internal::resolve;
using internal::shm_groups;
using internal::shm_mu;

}  // namespace

std::int64_t group_size(const std::string& group_name) { return resolve(group_name)->getSize(); }

std::int64_t group_rank(const std::string& group_name) { return resolve(group_name)->getRank(); }

at::Tensor& all_reduce_sum_(at::Tensor& tensor, const std::string& group_name) {
  auto pg = resolve(group_name);
  if (pg->getSize() == 1) return tensor;
  // Gloo cannot reduce bfloat16/float16 (shared memory can).
  const bool upcast = !internal::has_shm(tensor, group_name) && needs_upcast(tensor);
  at::Tensor buf = tensor.is_contiguous() && !upcast
                       ? tensor
                       : tensor.to(upcast ? at::kFloat : tensor.scalar_type()).contiguous();
  all_reduce_base(buf, group_name, *pg, "all_reduce");
  if (!buf.is_same(tensor)) tensor.copy_(buf);
  return tensor;
}

void coalesced_all_reduce_(const std::vector<at::Tensor>& tensors, const std::string& group_name,
                           std::optional<double> scale) {
  if (tensors.empty()) return;
  at::NoGradGuard no_grad;
  if (group_size(group_name) == 1) {
    if (scale) at::_foreach_mul_(tensors, *scale);
    return;
  }
  // Same-dtype runs in order of first appearance, each cut into flat buffers.
  std::vector<std::pair<at::ScalarType, std::vector<at::Tensor>>> by_dtype;
  for (const auto& t : tensors) {
    auto it = std::find_if(by_dtype.begin(), by_dtype.end(),
                           [&](const auto& d) { return d.first == t.scalar_type(); });
    if (it == by_dtype.end()) it = by_dtype.insert(by_dtype.end(), {t.scalar_type(), {}});
    it->second.push_back(t);
  }
  for (const auto& [dtype, same] : by_dtype) {
    std::vector<at::Tensor> bucket;
    std::int64_t bytes = 0;
    for (std::size_t i = 0; i <= same.size(); ++i) {
      if (i < same.size()) {
        bucket.push_back(same[i]);
        bytes += same[i].numel() * same[i].element_size();
      }
      if (bucket.empty() || (i < same.size() && bytes < kCoalesceBucketBytes)) continue;
      std::vector<at::Tensor> flat_parts;
      for (const auto& t : bucket) flat_parts.push_back(t.reshape(-1));
      at::Tensor flat = at::cat(flat_parts);
      all_reduce_sum_(flat, group_name);
      if (scale) flat.mul_(*scale);
      std::int64_t off = 0;
      for (const auto& t : bucket) {
        t.copy_(flat.slice(0, off, off + t.numel()).view(t.sizes()));
        off += t.numel();
      }
      bucket.clear();
      bytes = 0;
    }
  }
}

at::Tensor all_gather(const at::Tensor& tensor, std::int64_t dim, const std::string& group_name) {
  dim = normalize_dim(tensor, dim, "all_gather");
  auto pg = resolve(group_name);
  const std::int64_t world = pg->getSize();
  if (world == 1) return tensor.clone();
  const bool upcast = !internal::has_shm(tensor, group_name) && needs_upcast(tensor);
  at::Tensor in = (upcast ? tensor.to(at::kFloat) : tensor).contiguous();
  // Gathered along dim 0: out is [world * n0, ...], member r at rows r*n0...
  std::vector<std::int64_t> shape = in.sizes().vec();
  shape[0] *= world;
  at::Tensor out = at::empty(shape, in.options());
  all_gather_base(out, in, group_name, *pg, "all_gather");
  at::Tensor gathered = dim == 0 ? out : at::cat(out.chunk(world, 0), dim);
  return upcast ? gathered.to(tensor.scalar_type()) : gathered;
}

at::Tensor reduce_scatter_sum(const at::Tensor& tensor, std::int64_t dim,
                              const std::string& group_name) {
  dim = normalize_dim(tensor, dim, "reduce_scatter");
  auto pg = resolve(group_name);
  const std::int64_t world = pg->getSize();
  MAPP_CHECK(tensor.size(dim) % world == 0, "reduce_scatter: size ", tensor.size(dim), " of dim ",
             dim, " is not divisible by the group size ", world,
             "; pad the tensor or choose a divisible shape");
  if (world == 1) return tensor.clone();
  const bool upcast = !internal::has_shm(tensor, group_name) && needs_upcast(tensor);
  at::Tensor src = upcast ? tensor.to(at::kFloat) : tensor;
  // Lay the members' chunks out contiguously in group-rank order.
  at::Tensor in = dim == 0 ? src.contiguous() : at::stack(src.chunk(world, dim)).flatten(0, 1);
  std::vector<std::int64_t> out_shape = src.sizes().vec();
  out_shape[dim] /= world;
  at::Tensor out = at::empty(out_shape, in.options());
  reduce_scatter_base(out, in, group_name, *pg, "reduce_scatter");
  return upcast ? out.to(tensor.scalar_type()) : out;
}

namespace {

// Checks of the asynchronous dim-0 collectives: same dtype and device,
// contiguous, `out` of shape `expect`.
void check_async(const char* op, const at::Tensor& out, const at::Tensor& in,
                 const std::vector<std::int64_t>& expect) {
  MAPP_CHECK(in.dim() >= 1, op, ": expected a tensor with at least one dimension, got a scalar");
  MAPP_CHECK(in.is_contiguous() && out.is_contiguous(), op,
             ": needs contiguous tensors (call .contiguous() first)");
  MAPP_CHECK(in.scalar_type() == out.scalar_type() && in.device() == out.device(), op,
             ": out (", out.scalar_type(), " on ", out.device(), ") must match the input (",
             in.scalar_type(), " on ", in.device(), ")");
  MAPP_CHECK(out.sizes().vec() == expect, op, ": out has shape ", out.sizes(), ", expected ",
             c10::IntArrayRef(expect));
}

CommStats sent(std::int64_t world, std::int64_t chunk_bytes) {
  CommStats st;
  st.raw_bytes = st.sent_bytes = (world - 1) * chunk_bytes;
  return st;
}

}  // namespace

c10::intrusive_ptr<CommWork> all_gather_async(at::Tensor out, at::Tensor in,
                                              const std::string& group_name) {
  auto pg = resolve(group_name);
  const std::int64_t world = pg->getSize();
  std::vector<std::int64_t> expect = in.sizes().vec();
  if (!expect.empty()) expect[0] *= world;
  check_async("all_gather_async", out, in, expect);
  return submit("tp all-gather", group_name, {out, in}, [=]() mutable {
    if (world == 1) {
      out.copy_(in);
    } else if (!internal::has_shm(in, group_name) && needs_upcast(in)) {
      out.copy_(all_gather(in, 0, group_name));  // Gloo has no 16-bit floats
    } else {
      all_gather_base(out, in, group_name, *pg, "all_gather");
    }
    return sent(world, in.nbytes());
  });
}

c10::intrusive_ptr<CommWork> reduce_scatter_async(at::Tensor out, at::Tensor in,
                                                  const std::string& group_name) {
  auto pg = resolve(group_name);
  const std::int64_t world = pg->getSize();
  MAPP_CHECK(in.dim() >= 1 && in.size(0) % world == 0, "reduce_scatter_async: size ",
             in.dim() ? in.size(0) : 0, " of dim 0 is not divisible by the group size ", world,
             "; pad the tensor or choose a divisible shape");
  std::vector<std::int64_t> expect = in.sizes().vec();
  expect[0] /= world;
  check_async("reduce_scatter_async", out, in, expect);
  return submit("tp reduce-scatter", group_name, {out, in}, [=]() mutable {
    if (world == 1) {
      out.copy_(in);
    } else if (!internal::has_shm(in, group_name) && needs_upcast(in)) {
      out.copy_(reduce_scatter_sum(in, 0, group_name));
    } else {
      reduce_scatter_base(out, in, group_name, *pg, "reduce_scatter");
    }
    return sent(world, out.nbytes());
  });
}

bool shm_attach(const std::string& group_name, const std::string& shm_name, bool create) {
  auto pg = resolve(group_name);
  const int rank = static_cast<int>(pg->getRank());
  const int world = static_cast<int>(pg->getSize());
  const auto slot = static_cast<std::size_t>(tunable_int("MAPP_SHM_SLOT_BYTES"));
  std::shared_ptr<comm::ShmGroup> g = create ? comm::ShmGroup::create(shm_name, rank, world, slot)
                                             : comm::ShmGroup::open(shm_name, rank, world, slot);
  std::lock_guard<std::mutex> lock(shm_mu());
  shm_groups()[group_name] = std::move(g);
  return true;
}

void shm_unlink(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(shm_mu());
  auto it = shm_groups().find(group_name);
  if (it != shm_groups().end()) it->second->unlink();
}

void shm_detach(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(shm_mu());
  shm_groups().erase(group_name);
}

bool shm_attached(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(shm_mu());
  return shm_groups().count(group_name) != 0;
}

}  // namespace mapp::torch_ext
