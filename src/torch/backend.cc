// The "mapp" torch.distributed backend (include/mapp/torch/backend.h).
//
// Built only with Gloo's headers (as dist.cc): the backend owns a
// ProcessGroupGloo for everything shared memory does not carry.
#include "mapp/torch/backend.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "c10d_util.h"
#include "mapp/comm/shm_group.h"
#include "mapp/common/check.h"

#ifdef MAPP_HAVE_GLOO_HEADERS
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "gloo_device.h"
#endif

namespace mapp::dist {

#ifdef MAPP_HAVE_GLOO_HEADERS
namespace {

using c10::intrusive_ptr;
using c10d::Work;

// A Work whose operation already ran (in the caller's thread): complete,
// successful, its future holding the outputs as torch's own backends' do.
class DoneWork final : public Work {
 public:
  DoneWork(std::vector<at::Tensor> outputs, c10d::OpType type)
      : Work(-1, type), outputs_(std::move(outputs)) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()));
    future_->markCompleted(c10::IValue(outputs_));
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }
  void synchronize() override {}
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

intrusive_ptr<Work> done(std::vector<at::Tensor> outputs,
                         c10d::OpType type = c10d::OpType::UNKNOWN) {
  return c10::make_intrusive<DoneWork>(std::move(outputs), type);
}

// dst (op)= src, elementwise over `bytes` of `dtype`.
comm::ShmGroup::Reduce reducer(c10d::ReduceOp::RedOpType op, at::ScalarType dtype) {
  return [op, dtype](void* dst, const void* src, std::size_t bytes) {
    const auto n = static_cast<std::int64_t>(bytes / c10::elementSize(dtype));
    const auto opts = at::TensorOptions().dtype(dtype);
    at::Tensor d = at::from_blob(dst, {n}, opts);
    at::Tensor s = at::from_blob(const_cast<void*>(src), {n}, opts);
    switch (op) {
      case c10d::ReduceOp::PRODUCT:
        d.mul_(s);
        break;
      case c10d::ReduceOp::MIN:
        at::minimum_out(d, d, s);
        break;
      case c10d::ReduceOp::MAX:
        at::maximum_out(d, d, s);
        break;
      default:  // SUM, AVG (divided afterwards)
        d.add_(s);
    }
  };
}

bool reducible(const c10d::ReduceOp& op, const at::Tensor& t) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      return t.scalar_type() != at::kBool && !t.is_complex();
    case c10d::ReduceOp::AVG:
      return t.is_floating_point();
    default:  // bitwise ops and PREMUL_SUM: Gloo
      return false;
  }
}

class MappBackend final : public c10d::Backend {
 public:
  MappBackend(const intrusive_ptr<c10d::Store>& store, int rank, int size,
              std::chrono::milliseconds timeout, const std::string& group_name)
      : Backend(rank, size), timeout_(timeout), label_("process group '" + group_name + "'") {
    auto gloo_store = c10::make_intrusive<c10d::PrefixStore>("gloo", store);
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    opts->devices.push_back(torch_ext::internal::gloo_device());  // honours GLOO_SOCKET_IFNAME
    try {
      gloo_ = c10::make_intrusive<c10d::ProcessGroupGloo>(gloo_store, rank, size, opts);
    } catch (const std::exception& e) {
      MAPP_FAIL_BACKEND("backend 'mapp': connecting ", label_, " (member ", rank, " of ", size,
                        ") failed after at most ", timeout.count(), " ms: ", e.what());
    }
    if (size > 1 && tunable_string("MAPP_SHM_COLLECTIVES") != "0")
      shm_ = torch_ext::internal::rendezvous_shm(*store, "mapp.shm/", rank, size, label_);
  }

  const std::string getBackendName() const override { return "mapp"; }
  bool uses_shared_memory() const { return shm_ != nullptr; }

  void setGroupUid(const std::string& pg_uid) override {
    Backend::setGroupUid(pg_uid);
    gloo_->setGroupUid(pg_uid);
  }

  intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                const c10d::BroadcastOptions& opts) override {
    if (!on_shm(tensors)) return gloo_->broadcast(tensors, opts);
    const auto root = static_cast<int>(opts.rootRank);
    for (auto& t : tensors)
      inplace(t, [&](at::Tensor& buf) {
        shm_->broadcast(buf.data_ptr(), buf.nbytes(), root, timeout(opts.timeout));
      });
    return done(tensors);
  }

  intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                const c10d::AllreduceOptions& opts) override {
    if (!on_shm(tensors) || !all_reducible(opts.reduceOp, tensors)) {
      if (!half_precision(tensors)) return gloo_->allreduce(tensors, opts);
      // Gloo cannot reduce bfloat16/float16: they cross it as float32.
      std::vector<at::Tensor> wide;
      for (auto& t : tensors) wide.push_back(t.to(at::kFloat));
      gloo_->allreduce(wide, opts)->wait(timeout(opts.timeout));
      for (std::size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_(wide[i]);
      return done(tensors);
    }
    for (auto& t : tensors)
      inplace(t, [&](at::Tensor& buf) { reduce_in_place(buf, opts.reduceOp, opts.timeout); });
    return done(tensors);
  }

  intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                          const c10d::AllreduceCoalescedOptions& opts) override {
    const bool shm = on_shm(tensors) && all_reducible(opts.reduceOp, tensors);
    if (!shm && same_dtype(tensors)) return gloo_->allreduce_coalesced(tensors, opts);
    // Same-dtype tensors travel as one flat buffer (one collective, not one per tensor).
    std::vector<std::vector<at::Tensor>> by_dtype;
    for (auto& t : tensors) {
      auto it = std::find_if(by_dtype.begin(), by_dtype.end(), [&](const auto& g) {
        return g.front().scalar_type() == t.scalar_type();
      });
      if (it == by_dtype.end())
        by_dtype.push_back({t});
      else
        it->push_back(t);
    }
    for (auto& same : by_dtype) {
      if (!shm) {  // Gloo coalesces only tensors of one dtype
        gloo_->allreduce_coalesced(same, opts)->wait();
        continue;
      }
      at::Tensor flat = flat_cat(same);
      reduce_in_place(flat, opts.reduceOp, opts.timeout);
      std::int64_t off = 0;
      for (auto& t : same) {
        t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
        off += t.numel();
      }
    }
    return done(tensors);
  }

  intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                std::vector<at::Tensor>& inputs,
                                const c10d::AllgatherOptions& opts) override {
    if (!on_shm(inputs) || inputs.size() != 1 || outputs.size() != 1 ||
        outputs[0].size() != static_cast<std::size_t>(size_))
      return gloo_->allgather(outputs, inputs, opts);
    at::Tensor in = inputs[0].contiguous();
    at::Tensor flat = at::empty({size_, in.numel()}, in.options());
    shm_->all_gather(in.data_ptr(), in.nbytes(), flat.data_ptr(), timeout(opts.timeout));
    for (int m = 0; m < size_; ++m) outputs[0][m].copy_(flat[m].view(outputs[0][m].sizes()));
    return done(outputs[0]);
  }

  intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                      const c10d::AllgatherOptions& opts) override {
    std::vector<at::Tensor> both{output, input};
    if (!on_shm(both)) return gloo_->_allgather_base(output, input, opts);
    gather_into(output, input, opts.timeout);
    return done({output});
  }

  intrusive_ptr<Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    MAPP_CHECK(outputs.size() == inputs.size(), "allgather_into_tensor_coalesced: ",
               outputs.size(), " outputs for ", inputs.size(), " inputs");
    const std::vector<at::Tensor> all = joined(outputs, inputs);
    if (!on_shm(all)) return gloo_->allgather_into_tensor_coalesced(outputs, inputs, opts);
    for (std::size_t i = 0; i < inputs.size(); ++i) gather_into(outputs[i], inputs[i], opts.timeout);
    return done(outputs);
  }

  intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                     std::vector<std::vector<at::Tensor>>& inputs,
                                     const c10d::ReduceScatterOptions& opts) override {
    if (!on_shm(outputs) || outputs.size() != 1 || inputs.size() != 1 ||
        inputs[0].size() != static_cast<std::size_t>(size_) ||
        !reducible(opts.reduceOp, outputs[0]))
      return gloo_->reduce_scatter(outputs, inputs, opts);
    scatter_into(outputs[0], flat_cat(inputs[0]), opts.reduceOp, opts.timeout);
    return done(outputs);
  }

  intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::ReduceScatterOptions& opts) override {
    std::vector<at::Tensor> both{output, input};
    if (!on_shm(both) || !reducible(opts.reduceOp, output))
      return gloo_->_reduce_scatter_base(output, input, opts);
    scatter_into(output, input.contiguous(), opts.reduceOp, opts.timeout);
    return done({output});
  }

  intrusive_ptr<Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    MAPP_CHECK(outputs.size() == inputs.size(), "reduce_scatter_tensor_coalesced: ",
               outputs.size(), " outputs for ", inputs.size(), " inputs");
    const std::vector<at::Tensor> all = joined(outputs, inputs);
    if (!on_shm(all) || !all_reducible(opts.reduceOp, outputs)) {
      // Gloo has no coalesced reduce-scatter: one at a time.
      for (std::size_t i = 0; i < inputs.size(); ++i)
        gloo_->_reduce_scatter_base(outputs[i], inputs[i], opts)->wait();
      return done(outputs);
    }
    for (std::size_t i = 0; i < inputs.size(); ++i)
      scatter_into(outputs[i], inputs[i].contiguous(), opts.reduceOp, opts.timeout);
    return done(outputs);
  }

  intrusive_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                    std::vector<std::int64_t>& output_splits,
                                    std::vector<std::int64_t>& input_splits,
                                    const c10d::AllToAllOptions& opts) override {
    std::vector<at::Tensor> both{output, input};
    if (!on_shm(both) || output.scalar_type() != input.scalar_type())
      return gloo_->alltoall_base(output, input, output_splits, input_splits, opts);
    at::Tensor in = input.contiguous();
    at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
    if (output_splits.empty() && input_splits.empty()) {
      MAPP_CHECK(in.numel() % size_ == 0 && in.numel() == out.numel(),
                 "all_to_all_single: input of ", in.numel(), " and output of ", out.numel(),
                 " elements cannot be split evenly over ", size_, " members; pass split sizes");
      shm_->all_to_all(in.data_ptr(), in.nbytes() / size_, out.data_ptr(), timeout(opts.timeout));
    } else {
      auto bytes = [&](const at::Tensor& t, const std::vector<std::int64_t>& splits) {
        std::vector<std::size_t> b(size_);
        const std::int64_t rows = t.dim() ? t.size(0) : 1;
        const std::size_t row = rows ? t.nbytes() / static_cast<std::size_t>(rows) : 0;
        for (int m = 0; m < size_; ++m)
          b[m] = splits.empty() ? t.nbytes() / size_ : static_cast<std::size_t>(splits[m]) * row;
        return b;
      };
      const auto send = bytes(in, input_splits), recv = bytes(out, output_splits);
      shm_->all_to_all_v(in.data_ptr(), send.data(), out.data_ptr(), recv.data(),
                         timeout(opts.timeout));
    }
    if (!out.is_same(output)) output.copy_(out);
    return done({output});
  }

  intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                               const c10d::AllToAllOptions& opts) override {
    const std::vector<at::Tensor> all = joined(outputs, inputs);
    MAPP_CHECK(inputs.size() == static_cast<std::size_t>(size_) && outputs.size() == inputs.size(),
               "all_to_all: expected ", size_, " input and output tensors (one per member), got ",
               inputs.size(), " and ", outputs.size());
    MAPP_CHECK(same_dtype(all), "all_to_all: every input and output tensor must have one dtype");
    // One flat exchange with per-member sizes (Gloo has no list all-to-all).
    std::vector<std::int64_t> send, recv;
    for (auto& t : inputs) send.push_back(t.numel());
    for (auto& t : outputs) recv.push_back(t.numel());
    at::Tensor in = flat_cat(inputs);
    at::Tensor out = at::empty({std::accumulate(recv.begin(), recv.end(), std::int64_t{0})},
                               outputs[0].options());
    alltoall_base(out, in, recv, send, opts)->wait();
    std::int64_t off = 0;
    for (auto& t : outputs) {
      t.copy_(out.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
    return done(outputs);
  }

  // Point-to-point, rooted and synchronizing operations: Gloo.
  intrusive_ptr<Work> reduce(std::vector<at::Tensor>& tensors,
                             const c10d::ReduceOptions& opts) override {
    return gloo_->reduce(tensors, opts);
  }
  intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                             std::vector<at::Tensor>& inputs,
                             const c10d::GatherOptions& opts) override {
    return gloo_->gather(outputs, inputs, opts);
  }
  intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outputs,
                              std::vector<std::vector<at::Tensor>>& inputs,
                              const c10d::ScatterOptions& opts) override {
    return gloo_->scatter(outputs, inputs, opts);
  }
  intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllgatherOptions& opts) override {
    return gloo_->allgather_coalesced(outputs, inputs, opts);
  }
  intrusive_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return gloo_->send(tensors, dst, tag);
  }
  intrusive_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return gloo_->recv(tensors, src, tag);
  }
  intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return gloo_->recvAnysource(tensors, tag);
  }
  intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override {
    return gloo_->barrier(opts);
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    gloo_->monitoredBarrier(opts, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override { gloo_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return gloo_->getSequenceNumberForGroup(); }
  void setTimeout(std::chrono::milliseconds timeout) override {
    timeout_ = timeout;
    gloo_->setTimeout(timeout);
  }

 private:
  std::chrono::milliseconds timeout(std::chrono::milliseconds requested) const {
    return requested.count() > 0 ? requested : timeout_;
  }

  // Whether these tensors move through shared memory: a segment, and dense
  // real CPU tensors (anything else goes to Gloo, which stages CUDA tensors
  // through host memory; "cpu:mapp,cuda:nccl" gives CUDA tensors NCCL).
  bool on_shm(const std::vector<at::Tensor>& tensors) const {
    if (!shm_) return false;
    return std::all_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) {
      return t.device().is_cpu() && t.layout() == at::kStrided && !t.is_complex();
    });
  }

  static std::vector<at::Tensor> joined(const std::vector<at::Tensor>& a,
                                        const std::vector<at::Tensor>& b) {
    std::vector<at::Tensor> out(a);
    out.insert(out.end(), b.begin(), b.end());
    return out;
  }

  // The tensors' elements, one after the other, in a new 1-D tensor.
  static at::Tensor flat_cat(const std::vector<at::Tensor>& tensors) {
    std::vector<at::Tensor> views;
    for (const auto& t : tensors) views.push_back(t.reshape({-1}));
    return at::cat(views);
  }

  static bool half_precision(const std::vector<at::Tensor>& tensors) {
    return std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) {
      return t.device().is_cpu() &&
             (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
    });
  }

  static bool same_dtype(const std::vector<at::Tensor>& tensors) {
    return std::all_of(tensors.begin(), tensors.end(), [&](const at::Tensor& t) {
      return t.scalar_type() == tensors.front().scalar_type();
    });
  }

  static bool all_reducible(const c10d::ReduceOp& op, const std::vector<at::Tensor>& tensors) {
    return std::all_of(tensors.begin(), tensors.end(),
                       [&](const at::Tensor& t) { return reducible(op, t); });
  }

  // Runs `body` on a contiguous buffer holding `t` and copies the result back.
  template <typename Body>
  static void inplace(at::Tensor& t, Body&& body) {
    at::Tensor buf = t.is_contiguous() ? t : t.contiguous();
    body(buf);
    if (!buf.is_same(t)) t.copy_(buf);
  }

  // In-place reduction of the contiguous `buf` over the group.
  void reduce_in_place(at::Tensor& buf, const c10d::ReduceOp& op,
                       std::chrono::milliseconds requested) {
    shm_->all_reduce(buf.data_ptr(), buf.nbytes(), buf.element_size(),
                     reducer(op.op_, buf.scalar_type()), timeout(requested));
    if (op.op_ == c10d::ReduceOp::AVG) buf.div_(size_);
  }

  void gather_into(at::Tensor& output, const at::Tensor& input,
                   std::chrono::milliseconds requested) {
    MAPP_CHECK(output.numel() == input.numel() * size_ &&
                   output.scalar_type() == input.scalar_type(),
               "all_gather_into_tensor: the output must hold ", size_, " x the input's ",
               input.numel(), " elements of ", input.scalar_type(), ", got ", output.numel(),
               " of ", output.scalar_type());
    at::Tensor in = input.contiguous();
    inplace(output, [&](at::Tensor& out) {
      shm_->all_gather(in.data_ptr(), in.nbytes(), out.data_ptr(), timeout(requested));
    });
  }

  void scatter_into(at::Tensor& output, const at::Tensor& in, const c10d::ReduceOp& op,
                    std::chrono::milliseconds requested) {
    MAPP_CHECK(in.numel() == output.numel() * size_ && output.scalar_type() == in.scalar_type(),
               "reduce_scatter_tensor: the input must hold ", size_, " x the output's ",
               output.numel(), " elements of ", output.scalar_type(), ", got ", in.numel(),
               " of ", in.scalar_type());
    inplace(output, [&](at::Tensor& out) {
      shm_->reduce_scatter(in.data_ptr(), out.nbytes(), out.data_ptr(), out.element_size(),
                           reducer(op.op_, out.scalar_type()), timeout(requested));
      if (op.op_ == c10d::ReduceOp::AVG) out.div_(size_);
    });
  }

  std::chrono::milliseconds timeout_;
  std::string label_;
  intrusive_ptr<c10d::ProcessGroupGloo> gloo_;
  std::shared_ptr<comm::ShmGroup> shm_;
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> create_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                 int rank, int size,
                                                 std::chrono::milliseconds timeout,
                                                 const std::string& group_name) {
  MAPP_CHECK(size >= 1 && rank >= 0 && rank < size, "backend 'mapp': rank ", rank,
             " is outside a group of ", size);
  MAPP_CHECK(timeout.count() > 0, "backend 'mapp': the timeout must be positive");
  return c10::make_intrusive<MappBackend>(store, rank, size, timeout, group_name);
}

bool backend_uses_shared_memory(const c10::intrusive_ptr<c10d::Backend>& backend) {
  const auto* b = dynamic_cast<const MappBackend*>(backend.get());
  return b != nullptr && b->uses_shared_memory();
}

#else

c10::intrusive_ptr<c10d::Backend> create_backend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                 std::chrono::milliseconds, const std::string&) {
  MAPP_CHECK(false,
             "backend 'mapp' needs a megatronapp built with Gloo's headers (Debian: "
             "libgloo-dev); install them and rebuild, or use backend 'gloo'");
  return {};
}

bool backend_uses_shared_memory(const c10::intrusive_ptr<c10d::Backend>&) { return false; }

#endif

}  // namespace mapp::dist
