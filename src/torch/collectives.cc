// Collectives over c10d process groups resolved by name.
//
// Why by name: the group registry (GroupRegistry.hpp) is the one handle that
// both Python (`group.group_name`) and C++ can hold without sharing pybind11
// internals, and it survives torch.compile tracing as a plain string.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <exception>

#include "mapp/common/check.h"
#include "mapp/common/tunables.h"
#include "mapp/torch/ops.h"

namespace mapp::torch_ext {
namespace {

c10::intrusive_ptr<c10d::ProcessGroup> resolve(const std::string& group_name) {
  try {
    return c10d::resolve_process_group(group_name);
  } catch (const c10::Error&) {
    MAPP_CHECK_STATE(false, "no process group is registered under the name '", group_name,
                     "'; call torch.distributed.init_process_group (and "
                     "megatronapp.initialize_model_parallel) first and pass group.group_name");
  }
}

// Issues a collective and waits for it, turning a c10d failure or a timeout
// into a BackendError that names the operation and the group (a hang must
// become an error). `issue` returns the c10d Work.
template <typename Issue>
void run(const char* op, const std::string& group_name, Issue&& issue) {
  const auto timeout = std::chrono::milliseconds(
      1000 * tunable_int("MAPP_COLLECTIVE_TIMEOUT_S"));
  try {
    c10::intrusive_ptr<c10d::Work> work = issue();
    work->wait(timeout);
  } catch (const std::exception& e) {
    MAPP_FAIL_BACKEND(op, " on group '", group_name, "' failed: ", e.what());
  }
}

// Gloo cannot reduce bfloat16; CPU half-precision tensors travel as float32.
bool needs_upcast(const at::Tensor& t) {
  return t.device().is_cpu() &&
         (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
}

std::int64_t normalize_dim(const at::Tensor& t, std::int64_t dim, const char* op) {
  const std::int64_t nd = t.dim();
  MAPP_CHECK(nd >= 1, op, ": expected a tensor with at least one dimension, got a scalar");
  MAPP_CHECK(dim >= -nd && dim < nd, op, ": dim ", dim, " is out of range for a ", nd,
             "-d tensor");
  return dim < 0 ? dim + nd : dim;
}

}  // namespace

std::int64_t group_size(const std::string& group_name) {
  return resolve(group_name)->getSize();
}

std::int64_t group_rank(const std::string& group_name) {
  return resolve(group_name)->getRank();
}

at::Tensor& all_reduce_sum_(at::Tensor& tensor, const std::string& group_name) {
  auto pg = resolve(group_name);
  if (pg->getSize() == 1) return tensor;
  at::Tensor buf = tensor.is_contiguous() && !needs_upcast(tensor)
                       ? tensor
                       : tensor.to(needs_upcast(tensor) ? at::kFloat : tensor.scalar_type())
                             .contiguous();
  std::vector<at::Tensor> tensors{buf};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  run("all_reduce", group_name, [&] { return pg->allreduce(tensors, opts); });
  if (!buf.is_same(tensor)) tensor.copy_(buf);
  return tensor;
}

at::Tensor all_gather(const at::Tensor& tensor, std::int64_t dim,
                      const std::string& group_name) {
  dim = normalize_dim(tensor, dim, "all_gather");
  auto pg = resolve(group_name);
  const std::int64_t world = pg->getSize();
  if (world == 1) return tensor.clone();
  const bool upcast = needs_upcast(tensor);
  at::Tensor in = (upcast ? tensor.to(at::kFloat) : tensor).contiguous();
  // c10d gathers along dim 0: out is [world * n0, ...], member r at rows r*n0...
  std::vector<std::int64_t> shape = in.sizes().vec();
  shape[0] *= world;
  at::Tensor out = at::empty(shape, in.options());
  run("all_gather", group_name, [&] { return pg->_allgather_base(out, in); });
  at::Tensor gathered = dim == 0 ? out : at::cat(out.chunk(world, 0), dim);
  return upcast ? gathered.to(tensor.scalar_type()) : gathered;
}

at::Tensor reduce_scatter_sum(const at::Tensor& tensor, std::int64_t dim,
                              const std::string& group_name) {
  dim = normalize_dim(tensor, dim, "reduce_scatter");
  auto pg = resolve(group_name);
  const std::int64_t world = pg->getSize();
  MAPP_CHECK(tensor.size(dim) % world == 0, "reduce_scatter: size ", tensor.size(dim),
             " of dim ", dim, " is not divisible by the group size ", world,
             "; pad the tensor or choose a divisible shape");
  if (world == 1) return tensor.clone();
  const bool upcast = needs_upcast(tensor);
  at::Tensor src = upcast ? tensor.to(at::kFloat) : tensor;
  // Lay the members' chunks out contiguously in group-rank order.
  at::Tensor in = dim == 0 ? src.contiguous() : at::stack(src.chunk(world, dim)).flatten(0, 1);
  std::vector<std::int64_t> out_shape = src.sizes().vec();
  out_shape[dim] /= world;
  at::Tensor out = at::empty(out_shape, in.options());
  run("reduce_scatter", group_name, [&] { return pg->_reduce_scatter_base(out, in); });
  return upcast ? out.to(tensor.scalar_type()) : out;
}

}  // namespace mapp::torch_ext
