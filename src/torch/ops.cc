// Operator registration: schemas in the `mapp` namespace and their CPU /
// device-generic kernels. CUDA kernels register in cuda_ops.cc.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

#include "mapp/common/check.h"
#include "mapp/tp/cross_entropy.h"
#include "mapp/torch/ops.h"

namespace mapp::torch_ext {
namespace {

at::Tensor all_reduce_op(at::Tensor self, const std::string& group_name) {
  all_reduce_sum_(self, group_name);
  return self;
}

at::Tensor vocab_ce_local_stats_cpu(const at::Tensor& logits, const at::Tensor& target,
                                    std::int64_t vocab_start) {
  const bool f64 = logits.scalar_type() == at::kDouble;
  at::Tensor x = logits.to(f64 ? at::kDouble : at::kFloat).contiguous();
  const std::int64_t vocab = x.size(-1);
  at::Tensor t = target.to(at::kLong).contiguous();
  const std::int64_t rows = vocab == 0 ? 0 : x.numel() / vocab;
  auto shape = logits.sizes().vec();
  shape.back() = kVocabCeStatsPerRow;
  at::Tensor stats = at::empty(shape, x.options());
  if (f64) {
    ::mapp::vocab_ce_local_stats(x.data_ptr<double>(), t.data_ptr<std::int64_t>(), rows, vocab,
                         vocab_start, stats.data_ptr<double>());
  } else {
    ::mapp::vocab_ce_local_stats(x.data_ptr<float>(), t.data_ptr<std::int64_t>(), rows, vocab,
                         vocab_start, stats.data_ptr<float>());
  }
  return stats;
}

}  // namespace

void check_ce_shapes(const at::Tensor& logits, const at::Tensor& target) {
  MAPP_CHECK(logits.dim() >= 1, "vocab_ce_local_stats: logits must have a vocabulary dim");
  MAPP_CHECK(target.numel() * logits.size(-1) == logits.numel(),
             "vocab_ce_local_stats: target has ", target.numel(),
             " elements but logits ", logits.sizes(), " have ",
             logits.size(-1) == 0 ? 0 : logits.numel() / logits.size(-1),
             " rows; target must have the shape of logits without the last dim");
  MAPP_CHECK(!at::isFloatingType(target.scalar_type()),
             "vocab_ce_local_stats: target must hold integer class ids, got ",
             target.scalar_type());
}

at::Tensor vocab_ce_local_stats(const at::Tensor& logits, const at::Tensor& target,
                                std::int64_t vocab_start) {
  check_ce_shapes(logits, target);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mapp::vocab_ce_local_stats", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, std::int64_t)>();
  return op.call(logits, target, vocab_start);
}

at::Tensor vocab_ce_local_stats_cpu_checked(const at::Tensor& logits, const at::Tensor& target,
                                            std::int64_t vocab_start) {
  check_ce_shapes(logits, target);
  return vocab_ce_local_stats_cpu(logits, target, vocab_start);
}

std::vector<std::string> registered_ops() {
  std::vector<std::string> names;
  for (const c10::OperatorName& op : c10::Dispatcher::singleton().getAllOpNames()) {
    if (op.name.rfind("mapp::", 0) == 0) names.push_back(op.name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

bool built_with_cuda() {
#ifdef MAPP_WITH_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

}  // namespace mapp::torch_ext

TORCH_LIBRARY(mapp, m) {
  m.def("all_reduce_(Tensor(a!) self, str group_name) -> Tensor(a!)");
  m.def("all_gather(Tensor self, int dim, str group_name) -> Tensor");
  m.def("reduce_scatter(Tensor self, int dim, str group_name) -> Tensor");
  m.def("group_size(str group_name) -> int", &mapp::torch_ext::group_size);
  m.def("vocab_ce_local_stats(Tensor logits, Tensor target, int vocab_start) -> Tensor");
}

// Collectives are device-generic: c10d picks the backend from the tensor.
TORCH_LIBRARY_IMPL(mapp, CompositeExplicitAutograd, m) {
  m.impl("all_reduce_", &mapp::torch_ext::all_reduce_op);
  m.impl("all_gather", &mapp::torch_ext::all_gather);
  m.impl("reduce_scatter", &mapp::torch_ext::reduce_scatter_sum);
}

TORCH_LIBRARY_IMPL(mapp, CPU, m) {
  m.impl("vocab_ce_local_stats", &mapp::torch_ext::vocab_ce_local_stats_cpu_checked);
}
