// megatronapp._C: a thin pybind11 module (torch's bundled pybind11) exposing the
// torch-free core. Tensor operators are not bound here: they are torch
// operators (torch.ops.mapp.*) registered by libmegatronapp_torch, which this
// module links so that importing it registers them.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>     // python_error: a Python exception inside autograd
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>  // c10::intrusive_ptr as a holder (c10d types)

#include <string_view>

#include "mapp/common/check.h"
#include "mapp/common/log.h"
#include "mapp/common/tunables.h"
#include "mapp/data/gpt_index.h"
#include "mapp/memory/pool.h"
#include "mapp/memory/trace.h"
#include "mapp/pipeline/schedule.h"
#include "mapp/topology/rank_grid.h"
#include "mapp/trace/tracer.h"
#include "mapp/torch/backend.h"
#include "mapp/torch/checkpoint_engine.h"
#include "mapp/torch/ddp.h"
#include "mapp/torch/gpu_trace.h"
#include "mapp/torch/memory.h"
#include "mapp/torch/nn.h"
#include "mapp/torch/faults.h"
#include "mapp/torch/ops.h"
#include "mapp/torch/pipeline.h"

namespace py = pybind11;

namespace {

void register_common(py::module_& m) {
  py::register_exception<mapp::StateError>(m, "StateError", PyExc_RuntimeError);
  py::register_exception<mapp::BackendError>(m, "BackendError", PyExc_RuntimeError);
  // A Python exception raised inside autograd (a custom Function's backward)
  // that crossed C++ (the pipeline executor): re-raised as itself.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (python_error& e) {
      e.restore();
    }
  });
  m.def("log", [](const std::string& level, const std::string& msg) {
    mapp::log(mapp::parse_log_level(level), msg);
  }, py::arg("level"), py::arg("message"));
  m.def("set_log_level", [](const std::string& level) {
    mapp::set_log_level(mapp::parse_log_level(level));
  });
  m.def("tunables", [] {
    py::list out;
    for (const auto& t : mapp::tunables()) {
      out.append(py::make_tuple(t.name, mapp::tunable_string(t.name), t.default_value,
                                t.meaning));
    }
    return out;
  }, "[(name, value, default, meaning)] for every MAPP_* variable");
  m.def("describe_tunables", &mapp::describe_tunables);
  m.def("tunable", &mapp::tunable_string, py::arg("name"),
        "value of a declared MAPP_* variable: the environment if set and non-empty, else "
        "its default (an unknown name is an error)");
  m.def("registered_ops", &mapp::torch_ext::registered_ops);
  m.def("built_with_cuda", &mapp::torch_ext::built_with_cuda);
}

void register_topology(py::module_& m) {
  py::enum_<mapp::Axis>(m, "Axis")
      .value("TENSOR", mapp::Axis::kTensor)
      .value("CONTEXT", mapp::Axis::kContext)
      .value("DATA", mapp::Axis::kData)
      .value("PIPELINE", mapp::Axis::kPipeline);
  py::class_<mapp::Coord>(m, "Coord")
      .def(py::init<>())
      .def(py::init([](int tp, int cp, int dp, int pp) { return mapp::Coord{tp, cp, dp, pp}; }),
           py::arg("tp"), py::arg("cp"), py::arg("dp"), py::arg("pp"))
      .def_readwrite("tp", &mapp::Coord::tp)
      .def_readwrite("cp", &mapp::Coord::cp)
      .def_readwrite("dp", &mapp::Coord::dp)
      .def_readwrite("pp", &mapp::Coord::pp)
      .def("__eq__", &mapp::Coord::operator==)
      .def("__repr__", [](const mapp::Coord& c) {
        return "Coord(tp=" + std::to_string(c.tp) + ", cp=" + std::to_string(c.cp) +
               ", dp=" + std::to_string(c.dp) + ", pp=" + std::to_string(c.pp) + ")";
      });
  auto to_axes = [](const std::vector<std::string>& names) {
    std::vector<mapp::Axis> axes;
    for (const auto& n : names) axes.push_back(mapp::parse_axis(n));
    return axes;
  };
  py::class_<mapp::RankGrid>(m, "RankGrid")
      .def(py::init<int, int, int, int, int, int, int>(), py::arg("world_size"),
           py::arg("tp") = 1, py::arg("pp") = 1, py::arg("dp") = 0, py::arg("cp") = 1,
           py::arg("ep") = 1, py::arg("etp") = 0)
      .def_property_readonly("world_size", &mapp::RankGrid::world_size)
      .def_property_readonly("tp", &mapp::RankGrid::tp)
      .def_property_readonly("cp", &mapp::RankGrid::cp)
      .def_property_readonly("dp", &mapp::RankGrid::dp)
      .def_property_readonly("pp", &mapp::RankGrid::pp)
      .def_property_readonly("ep", &mapp::RankGrid::ep)
      .def_property_readonly("edp", &mapp::RankGrid::edp)
      .def_property_readonly("etp", &mapp::RankGrid::etp)
      .def("etp_rank", &mapp::RankGrid::etp_rank, py::arg("rank"))
      .def("ep_rank", &mapp::RankGrid::ep_rank, py::arg("rank"))
      .def("edp_rank", &mapp::RankGrid::edp_rank, py::arg("rank"))
      .def("expert_group", &mapp::RankGrid::expert_group, py::arg("rank"),
           "ranks sharding the experts with `rank` (size ep)")
      .def("expert_data_group", &mapp::RankGrid::expert_data_group, py::arg("rank"),
           "ranks holding the same experts as `rank` (size edp)")
      .def("expert_groups", &mapp::RankGrid::expert_groups)
      .def("expert_data_groups", &mapp::RankGrid::expert_data_groups)
      .def("expert_tensor_group", &mapp::RankGrid::expert_tensor_group, py::arg("rank"),
           "ranks holding the other shards of `rank`'s experts (size etp)")
      .def("expert_token_group", &mapp::RankGrid::expert_token_group, py::arg("rank"),
           "tensor ranks routing the other slices of `rank`'s tokens (size tp / etp)")
      .def("expert_tensor_groups", &mapp::RankGrid::expert_tensor_groups)
      .def("expert_token_groups", &mapp::RankGrid::expert_token_groups)
      .def("coord", &mapp::RankGrid::coord, py::arg("rank"))
      .def("rank", &mapp::RankGrid::rank, py::arg("coord"))
      .def("group", [to_axes](const mapp::RankGrid& g, int rank,
                              const std::vector<std::string>& axes) {
        return g.group(rank, to_axes(axes));
      }, py::arg("rank"), py::arg("axes"), "ranks sharing all coordinates but `axes`")
      .def("groups", [to_axes](const mapp::RankGrid& g, const std::vector<std::string>& axes) {
        return g.groups(to_axes(axes));
      }, py::arg("axes"), "every group along `axes`; they partition the world")
      .def("embedding_group", &mapp::RankGrid::embedding_group, py::arg("rank"))
      .def("__repr__", &mapp::RankGrid::describe);
}

// thread_cache_bytes < 0: the policy's default (ours: PoolOptions::
// kDefaultThreadCacheBytes, torch-like: none, as torch has none).
mapp::PoolOptions policy_options(const std::string& policy, bool expandable, double gc,
                                 long long thread_cache_bytes = 0) {
  mapp::PoolOptions o;
  if (policy == "torch-like") {
    o = mapp::PoolOptions::torch_like();
    if (thread_cache_bytes < 0) thread_cache_bytes = 0;
  } else if (policy == "ours") {
    o.expandable_segments = expandable;
    o.name = expandable ? "ours" : "ours-plain";
    if (thread_cache_bytes < 0) thread_cache_bytes = mapp::PoolOptions::kDefaultThreadCacheBytes;
  } else {
    throw mapp::ValueError("unknown pool policy '" + policy + "'; use 'ours' or 'torch-like'");
  }
  o.gc_threshold = gc;
  o.thread_cache_bytes = static_cast<std::size_t>(thread_cache_bytes);
  return o;
}

std::string replay_json(const std::string& path, const std::string& policy, bool expandable,
                        std::size_t capacity_bytes, long long thread_cache_bytes) {
  mapp::PoolOptions o = policy_options(policy, expandable, 0.0,  // bad policy: fail first
                                       thread_cache_bytes);
  const mapp::AllocTrace trace = mapp::AllocTrace::load(path);
  mapp::HostDevice::Options d;
  d.capacity_bytes = capacity_bytes;
  mapp::HostDevice device(d);
  o.va_bytes = capacity_bytes;
  const mapp::ReplayResult r = mapp::replay(trace, device, o);
  const mapp::PoolStats& st = r.stats;
  return "{\"policy\":\"" + o.name + "\",\"operations\":" + std::to_string(r.operations) +
         ",\"ns_per_op\":" + std::to_string(r.ns_per_op()) +
         ",\"peak_allocated_bytes\":" + std::to_string(st.peak_allocated_bytes) +
         ",\"peak_reserved_bytes\":" + std::to_string(st.peak_reserved_bytes) +
         ",\"utilization\":" + std::to_string(r.utilization()) +
         ",\"fragmentation\":" + std::to_string(st.fragmentation()) +
         ",\"num_device_allocs\":" + std::to_string(st.num_device_allocs) +
         ",\"num_oom_retries\":" + std::to_string(st.num_oom_retries) + "}";
}

void register_memory(py::module_& m) {
  py::register_exception<mapp::OutOfMemoryError>(m, "OutOfMemoryError", PyExc_MemoryError);
  m.def("memory_install_cpu_pool", [](const std::string& policy, bool expandable, double gc,
                                      long long thread_cache_bytes) {
    mapp::torch_ext::install_cpu_pool(policy_options(policy, expandable, gc, thread_cache_bytes));
  }, py::arg("policy") = "ours", py::arg("expandable_segments") = true,
     py::arg("gc_threshold") = 0.0, py::arg("thread_cache_bytes") = -1);
  m.def("memory_restore_cpu_allocator", &mapp::torch_ext::restore_cpu_allocator);
  m.def("memory_cpu_pool_installed", [] { return mapp::torch_ext::cpu_pool() != nullptr; });
  auto pool = [] {
    mapp::CachingPool* p = mapp::torch_ext::cpu_pool();
    if (p == nullptr) {
      throw mapp::StateError("the CPU memory pool is not installed; call "
                             "megatronapp.memory.use_pool('cpu') first");
    }
    return p;
  };
  m.def("memory_cpu_stats_json", [pool] { return pool()->stats_json(); });
  m.def("memory_cpu_summary", [pool] { return pool()->summary(); });
  m.def("memory_cpu_release_cached", [pool] { pool()->release_cached(); });
  m.def("memory_cpu_reset_peak_stats", [pool] { pool()->reset_peak_stats(); });
  m.def("memory_cpu_is_valid", [pool] {
    std::string why;
    const bool ok = pool()->is_valid(&why);
    return py::make_tuple(ok, why);
  });
  m.def("memory_staging_stats_json", [] { return mapp::torch_ext::staging_pool().stats_json(); });
  m.def("memory_load_trace", [](const std::string& path) {
    const mapp::AllocTrace t = mapp::AllocTrace::load(path);
    py::list out;
    for (const auto& e : t.events) {
      out.append(py::make_tuple(static_cast<int>(e.op), e.id, e.size, e.stream));
    }
    return out;
  }, py::arg("path"), "[(op, id, size, stream)]: op 1 alloc, 2 free, 3 record_stream, 4 release");
  m.def("memory_start_cpu_trace", &mapp::torch_ext::start_cpu_trace);
  m.def("memory_stop_cpu_trace", &mapp::torch_ext::stop_cpu_trace, py::arg("path"));
  m.def("memory_replay", &replay_json, py::arg("path"), py::arg("policy") = "ours",
        py::arg("expandable_segments") = true, py::arg("capacity_bytes") = std::size_t(1) << 40,
        py::arg("thread_cache_bytes") = 0, py::call_guard<py::gil_scoped_release>());
#ifdef MAPP_WITH_CUDA_KERNELS
  m.def("memory_configure_cuda", [](const std::string& policy, bool expandable, double gc) {
    mapp::PoolOptions o = policy_options(policy, expandable, gc);
    o.name = "cuda";
    mapp::torch_ext::configure_cuda_pools(o);
  });
  m.def("memory_cuda_stats_json", [](int device) -> py::object {
    mapp::CachingPool* p = mapp::torch_ext::cuda_pool(device);
    if (p == nullptr) return py::none();
    return py::str(p->stats_json());
  });
  m.def("memory_cuda_summary", [](int device) -> std::string {
    mapp::CachingPool* p = mapp::torch_ext::cuda_pool(device);
    return p ? p->summary() : std::string("no CUDA pool on this device yet\n");
  });
  m.def("memory_cuda_reset_peak", [](int device) {
    if (mapp::CachingPool* p = mapp::torch_ext::cuda_pool(device)) p->reset_peak_stats();
  });
  m.def("memory_cuda_release_cached", [](int device) {
    if (mapp::CachingPool* p = mapp::torch_ext::cuda_pool(device)) p->release_cached();
  });
#endif
}

// A Python callable kept by C++ that may be dropped without the GIL.
std::shared_ptr<py::object> gil_held(py::object f) {
  return std::shared_ptr<py::object>(new py::object(std::move(f)), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  });
}

// What a pipeline chunk's callables return (the error for anything else).
constexpr const char* kChunkResult =
    "forward_backward: a model chunk returned {} where a tensor was expected (the output sent "
    "to the next stage, or the loss on the last)";

// A callable's result as a tensor; None -> an undefined tensor. `what`: the
// error, with {} for the type returned instead.
at::Tensor tensor_or_undefined(const py::object& r, std::string_view what) {
  if (r.is_none()) return {};
  if (!THPVariable_Check(r.ptr())) {
    const std::string type = py::str(py::type::of(r).attr("__name__"));
    const std::size_t at = what.find("{}");
    MAPP_CHECK(false, what.substr(0, at), type, what.substr(at + 2));
  }
  return r.cast<at::Tensor>();
}

// A Python callable as a C++ one (none for None): called with the GIL, kept
// and dropped safely without it; a tensor result may be None (undefined).
template <typename R, typename... A>
std::function<R(A...)> from_python(py::object f, std::string_view what = kChunkResult) {
  static_assert(std::is_void_v<R> || std::is_same_v<R, at::Tensor>, "a tensor or nothing");
  if (f.is_none()) return {};
  auto held = gil_held(std::move(f));
  return [held, what](A... args) -> R {
    py::gil_scoped_acquire gil;
    py::object r = (*held)(args...);
    if constexpr (std::is_same_v<R, at::Tensor>) return tensor_or_undefined(r, what);
  };
}

void register_pipeline(py::module_& parent) {
  namespace pl = mapp::pipeline;
  auto m = parent.def_submodule("pipeline", "Pipeline schedules (C++ core)");
  py::class_<pl::Action>(m, "Action")
      .def(py::init([](const std::string& type, int mb, int chunk, int peer) {
             return pl::Action{pl::parse_type(type), mb, chunk, peer};
           }),
           py::arg("type"), py::arg("microbatch"), py::arg("chunk") = 0, py::arg("peer") = -1)
      .def_property_readonly("type", [](const pl::Action& a) { return pl::type_name(a.type); })
      .def_readonly("microbatch", &pl::Action::microbatch)
      .def_readonly("chunk", &pl::Action::chunk)
      .def_readonly("peer", &pl::Action::peer)
      .def_property_readonly("is_compute", &pl::Action::is_compute)
      .def("__eq__", &pl::Action::operator==)
      .def("__hash__", [](const pl::Action& a) {
        return py::hash(py::make_tuple(static_cast<int>(a.type), a.microbatch, a.chunk, a.peer));
      })
      .def("__repr__", [](const pl::Action& a) { return pl::to_string(a); });
  py::class_<pl::Schedule>(m, "Schedule")
      .def(py::init([](const std::string& name, int stages, int microbatches, int chunks,
                       std::vector<std::vector<pl::Action>> actions,
                       const std::string& placement) {
             pl::Schedule s{name, stages, microbatches, chunks, std::move(actions),
                            pl::parse_placement(placement)};
             pl::add_communication(s);
             pl::check_valid(s);
             return s;
           }),
           py::arg("name"), py::arg("stages"), py::arg("microbatches"), py::arg("chunks"),
           py::arg("actions"), py::arg("placement") = "loop")
      .def_readonly("name", &pl::Schedule::name)
      .def_readonly("stages", &pl::Schedule::stages)
      .def_readonly("microbatches", &pl::Schedule::microbatches)
      .def_readonly("chunks", &pl::Schedule::chunks)
      .def_property_readonly("placement",
                             [](const pl::Schedule& s) { return pl::placement_name(s.placement); })
      .def("vstage", [](const pl::Schedule& s, int stage, int chunk) {
        MAPP_CHECK(stage >= 0 && stage < s.stages && chunk >= 0 && chunk < s.chunks, "stage ",
                   stage, " / chunk ", chunk, " out of range (", s.stages, " stages, ", s.chunks,
                   " chunks)");
        return s.vstage(stage, chunk);
      }, py::arg("stage"), py::arg("chunk"))
      .def("stage_of", [](const pl::Schedule& s, int vs) {
        MAPP_CHECK(vs >= 0 && vs < s.virtual_stages(), "virtual stage ", vs, " out of range [0, ",
                   s.virtual_stages(), ")");
        return s.stage_of(vs);
      }, py::arg("vstage"))
      .def("actions", [](const pl::Schedule& s, int stage) {
        MAPP_CHECK(stage >= 0 && stage < s.stages, "stage ", stage, " out of range [0, ",
                   s.stages, ")");
        return s.actions[stage];
      }, py::arg("stage"))
      .def("peak_activations", &pl::Schedule::peak_activations, py::arg("stage"))
      .def("validate", [](const pl::Schedule& s) { return pl::validate(s); })
      .def("to_csv", &pl::to_csv)
      .def("to_json", &pl::to_json);
  m.def("from_csv", &pl::from_csv);
  m.def("from_json", &pl::from_json);
  m.def("gpipe", &pl::gpipe, py::arg("p"), py::arg("m"));
  m.def("one_f_one_b", &pl::one_f_one_b, py::arg("p"), py::arg("m"));
  m.def("interleaved", &pl::interleaved, py::arg("p"), py::arg("m"), py::arg("v"));
  m.def("zero_bubble", &pl::zero_bubble, py::arg("p"), py::arg("m"));
  py::class_<pl::Costs>(m, "Costs")
      .def(py::init([](std::vector<double> f, std::vector<double> bi, std::vector<double> bw,
                       std::vector<double> p2p) {
             return pl::Costs{std::move(f), std::move(bi), std::move(bw), std::move(p2p)};
           }),
           py::arg("forward"), py::arg("backward_input"), py::arg("backward_weight"),
           py::arg("p2p"))
      .def_readonly("forward", &pl::Costs::forward)
      .def_readonly("backward_input", &pl::Costs::backward_input)
      .def_readonly("backward_weight", &pl::Costs::backward_weight)
      .def_readonly("p2p", &pl::Costs::p2p);
  m.def("by_name", &pl::by_name, py::arg("name"), py::arg("p"), py::arg("m"), py::arg("v") = 1,
        py::arg("policy") = "auto", py::arg("memory_limit") = std::nullopt,
        py::arg("costs") = std::nullopt);
  m.def("zb_v", &pl::zb_v, py::arg("p"), py::arg("m"), py::arg("costs") = std::nullopt);
  m.def("dynamic", [](int p, int mb, int v, const std::string& policy,
                      std::optional<int> memory_limit, std::optional<pl::Costs> costs) {
    return pl::dynamic(p, mb, v, pl::parse_policy(policy), memory_limit, costs);
  }, py::arg("p"), py::arg("m"), py::arg("v"), py::arg("policy"), py::arg("memory_limit"),
     py::arg("costs"));
  py::class_<pl::SimResult>(m, "SimResult")
      .def_readonly("makespan", &pl::SimResult::makespan)
      .def_readonly("bubble_fraction", &pl::SimResult::bubble_fraction)
      .def_readonly("busy", &pl::SimResult::busy)
      .def_readonly("peak_activations", &pl::SimResult::peak_activations)
      .def_property_readonly("timeline", [](const pl::SimResult& r) {
        py::list out;
        for (const auto& e : r.timeline) out.append(py::make_tuple(e.stage, e.action, e.start, e.end));
        return out;
      });
  m.def("simulate", &pl::simulate, py::arg("schedule"), py::arg("costs"));
  m.def("chrome_trace", &pl::chrome_trace, py::arg("schedule"), py::arg("result"));
  // The pipeline executor (mapp/torch/pipeline.h) under
  // megatronapp.pipeline.forward_backward: the chunks, the first stage's
  // inputs and the gradient synchronizers are Python callables, called with
  // the GIL; everything else (waits, autograd, the reducers) runs without it.
  m.def("forward_backward", [](const pl::Schedule& schedule, std::vector<py::object> forwards,
                               std::vector<std::optional<mapp::GradReducer*>> reducers,
                               std::vector<py::object> set_syncs,
                               std::vector<py::object> finish_syncs, py::object inputs,
                               mapp::PipelineGroups groups, std::vector<std::int64_t> tensor_shape,
                               at::ScalarType dtype, c10::Device device, bool forward_only,
                               bool scatter_gather, bool trace_actions, bool gpu_busy_time) {
    const std::size_t v = forwards.size();
    MAPP_CHECK(reducers.size() == v && set_syncs.size() == v && finish_syncs.size() == v,
               "forward_backward: one reducer / set_sync / finish_sync entry per chunk");
    std::vector<mapp::PipelineChunk> chunks(v);
    for (std::size_t c = 0; c < v; ++c) {
      chunks[c].forward_microbatch =
          from_python<at::Tensor, const at::Tensor&, int>(std::move(forwards[c]));
      chunks[c].reducer = reducers[c].value_or(nullptr);
      chunks[c].set_sync = from_python<void, bool>(std::move(set_syncs[c]));
      chunks[c].finish_sync = from_python<void>(std::move(finish_syncs[c]));
    }
    const auto first = from_python<at::Tensor, int>(std::move(inputs));
    mapp::PipelineOptions options;
    options.tensor_shape = std::move(tensor_shape);
    options.dtype = dtype;
    options.device = device;
    options.forward_only = forward_only;
    options.scatter_gather = scatter_gather;
    options.inject_slowdown = false;  // the Python trainer slows its layers (faults.apply_slowdown)
    options.trace_actions = trace_actions;
    options.gpu_busy_time = gpu_busy_time;
    mapp::PipelineResult r;
    {
      py::gil_scoped_release nogil;
      r = mapp::forward_backward(schedule, chunks, first, {}, groups, options);
      chunks.clear();  // the callables go with the GIL (their deleters take it)
    }
    py::dict out;
    out["losses"] = r.losses;
    out["peak_activations"] = r.peak_activations;
    out["compute_time"] = r.compute_time;
    out["recv_wait_time"] = r.recv_wait_seconds;
    out["sent_bytes"] = r.sent_bytes;
    out["step_time"] = r.step_seconds;
    out["shared_memory"] = r.shared_memory;
    return out;
  }, py::arg("schedule"), py::arg("forwards"), py::arg("reducers"), py::arg("set_syncs"),
     py::arg("finish_syncs"), py::arg("inputs"), py::arg("groups"), py::arg("tensor_shape"),
     py::arg("dtype"), py::arg("device"), py::arg("forward_only"), py::arg("scatter_gather"),
     py::arg("trace_actions"), py::arg("gpu_busy_time"));
  py::class_<mapp::PipelineGroups>(m, "PipelineGroups")
      .def(py::init([](std::string pipeline, int stage, std::vector<int> stage_ranks,
                       std::string tensor, int tp_rank, int tp_size) {
             MAPP_CHECK(stage >= 0 && stage < static_cast<int>(stage_ranks.size()),
                        "PipelineGroups: stage ", stage, " out of range for ",
                        stage_ranks.size(), " stages");
             return mapp::PipelineGroups{std::move(pipeline), stage, std::move(stage_ranks),
                                         std::move(tensor), tp_rank, tp_size};
           }),
           py::arg("pipeline"), py::arg("stage"), py::arg("stage_ranks"), py::arg("tensor"),
           py::arg("tp_rank"), py::arg("tp_size"))
      .def_readonly("stage", &mapp::PipelineGroups::stage)
      .def_readonly("stage_ranks", &mapp::PipelineGroups::stage_ranks);
  py::class_<mapp::AdaptiveSchedule>(m, "AdaptiveSchedule")
      .def(py::init<int, int, int, int, int, mapp::PipelineGroups, std::string>(), py::arg("p"),
           py::arg("m"), py::arg("v"), py::arg("memory_limit"), py::arg("interval"),
           py::arg("groups"), py::arg("world_group"))
      // copies: a re-plan replaces the engine's schedule, not the caller's
      .def_property_readonly("schedule",
                             [](const mapp::AdaptiveSchedule& a) { return a.schedule(); })
      .def_property_readonly("replans", &mapp::AdaptiveSchedule::replans)
      .def_property_readonly("costs", [](const mapp::AdaptiveSchedule& a) { return a.costs(); })
      .def("observe", [](mapp::AdaptiveSchedule& a, std::map<std::string, double> compute_time,
                         std::vector<std::int64_t> tensor_shape, at::ScalarType dtype,
                         c10::Device device) {
        mapp::PipelineResult r;
        r.compute_time = std::move(compute_time);
        r.tensor_shape = std::move(tensor_shape);
        r.dtype = dtype;
        r.device = device;
        return a.observe(r);
      }, py::arg("compute_time"), py::arg("tensor_shape"), py::arg("dtype"), py::arg("device"),
         py::call_guard<py::gil_scoped_release>());
  m.def("injected_slowdown", [] {
    const auto s = mapp::faults::injected_slowdown();
    if (!s) return py::object(py::none());
    py::object rank = s->ranks.size() == 1 ? py::object(py::int_(s->ranks.front()))
                                           : py::object(py::tuple(py::cast(s->ranks)));
    const char* phase = s->forward && s->backward ? "all" : s->forward ? "forward" : "backward";
    return py::object(py::dict(py::arg("rank") = rank, py::arg("factor") = s->factor,
                               py::arg("phase") = phase, py::arg("start") = s->start));
  }, "the parsed MAPP_INJECT_SLOWDOWN ({rank (an int, or a tuple for rank=0+2), factor, "
     "phase, start}) or None");
  m.def("injected_link_delay", [] {
    const auto d = mapp::faults::injected_link_delay();
    return d ? py::object(py::dict(py::arg("rank") = d->rank, py::arg("peer") = d->peer,
                                   py::arg("ms") = d->ms))
             : py::object(py::none());
  }, "the parsed MAPP_INJECT_LINK_DELAY ({rank, peer, ms}) or None");
}

mapp::trace::Event make_event(const std::string& name, const std::string& category, int lane,
                              std::int64_t start_ns, std::int64_t end_ns, int microbatch,
                              int chunk) {
  mapp::trace::Event e;
  e.set_name(name);
  e.category = mapp::trace::parse_category(category);
  e.lane = static_cast<std::uint8_t>(lane);
  e.start_ns = start_ns;
  e.end_ns = end_ns;
  e.microbatch = microbatch;
  e.chunk = chunk;
  return e;
}

void register_trace(py::module_& parent) {
  namespace tr = mapp::trace;
  auto m = parent.def_submodule("trace", "Tracer (C++ core)");
  m.def("start", [](int rank, const std::string& path, std::size_t capacity,
                    int flush_interval_ms, bool enabled) {
    tr::TracerOptions o;
    o.capacity = capacity;
    o.flush_interval_ms = flush_interval_ms;
    o.enabled = enabled;
    tr::install(std::make_unique<tr::Tracer>(rank, path, o));
  }, py::arg("rank"), py::arg("path"), py::arg("capacity") = 1 << 16,
     py::arg("flush_interval_ms") = 200, py::arg("enabled") = true);
  m.def("stop", [] {
    py::gil_scoped_release release;
    tr::uninstall();
  });
  m.def("active", [] { return tr::global() != nullptr; });
  m.def("enabled", [] { return tr::global() != nullptr && tr::global()->enabled(); });
  m.def("set_enabled", [](bool on) {
    if (tr::global()) tr::global()->set_enabled(on);
  });
  m.def("set_iteration", [](int it) {
    if (tr::global()) tr::global()->set_iteration(it);
  });
  m.def("flush", [] {
    py::gil_scoped_release release;
    if (tr::global()) tr::global()->flush();
  });
  m.def("stats", [] {
    py::dict d;
    if (tr::Tracer* t = tr::global()) {
      d["recorded"] = t->recorded();
      d["dropped"] = t->dropped();
      d["bytes_written"] = t->bytes_written();
      d["path"] = t->path();
    }
    return d;
  });
  m.def("gpu_available", &mapp::torch_ext::gpu_timers_available);
  m.def("gpu_begin", &mapp::torch_ext::gpu_timer_begin);
  m.def("gpu_end", [](std::int64_t handle, const std::string& name, const std::string& category,
                      int lane, std::int64_t start_ns, std::int64_t end_ns, int microbatch,
                      int chunk) {
    tr::Event e = make_event(name, category, lane, start_ns, end_ns, microbatch, chunk);
    if (tr::global()) e.iteration = tr::global()->iteration();
    mapp::torch_ext::gpu_timer_end(handle, e);
  });
  m.def("gpu_resolve", &mapp::torch_ext::resolve_gpu_timers,
        "records completed GPU timers; returns how many are pending");
  m.def("next_seq", &tr::next_seq, py::arg("group"));
  m.def("in_flight", &tr::in_flight, "the C++ collective in flight, or ''");
  m.def("reset_seqs", &tr::reset_seqs);
  // One call per finished scope (times from time.monotonic_ns, the same clock).
  m.def("record", [](const std::string& name, const std::string& category, int lane,
                     std::int64_t start_ns, std::int64_t end_ns, int microbatch, int chunk,
                     int peer, std::int64_t bytes, const std::string& group, std::int64_t seq,
                     std::int64_t busy_ns) {
    tr::Tracer* t = tr::global();
    if (t == nullptr || !t->enabled()) return;
    tr::Event e = make_event(name, category, lane, start_ns, end_ns, microbatch, chunk);
    e.peer = peer;
    e.bytes = bytes;
    e.set_group(group);
    e.seq = seq;
    e.busy_ns = busy_ns;
    t->record(e);
  }, py::arg("name"), py::arg("category"), py::arg("lane"), py::arg("start_ns"),
     py::arg("end_ns"), py::arg("microbatch") = -1, py::arg("chunk") = -1, py::arg("peer") = -1,
     py::arg("bytes") = -1, py::arg("group") = "", py::arg("seq") = -1,
     py::arg("busy_ns") = -1);
}

}  // namespace

// The GPT data pipeline's index arithmetic (mapp/data/gpt_index.h) on numpy arrays.
void register_data(py::module_& m) {
  using I32 = py::array_t<std::int32_t, py::array::c_style | py::array::forcecast>;
  m.def(
      "build_sample_index",
      [](const I32& sizes, const I32& document_index, std::int32_t seq_length, std::int64_t tokens,
         bool drop_last, int extra) {
        std::vector<std::int64_t> rows;
        {
          py::gil_scoped_release nogil;
          rows = mapp::data::build_sample_index(
              sizes.data(), static_cast<std::size_t>(sizes.size()), document_index.data(),
              static_cast<std::size_t>(document_index.size()), seq_length, tokens, drop_last,
              extra);
        }
        py::array_t<std::int64_t> out({static_cast<py::ssize_t>(rows.size() / 2), py::ssize_t{2}});
        std::copy(rows.begin(), rows.end(), out.mutable_data());
        return out;
      },
      py::arg("sizes"), py::arg("document_index"), py::arg("seq_length"), py::arg("tokens"),
      py::arg("drop_last") = true, py::arg("extra") = 1,
      "[(document_index position, offset)] of every sample start, plus the end (int64)");
  m.def(
      "build_blend_index",
      [](const py::array_t<double, py::array::c_style | py::array::forcecast>& weights,
         std::int64_t size) {
        py::array_t<std::int16_t> which(size);
        py::array_t<std::int64_t> nth(size);
        auto* w = which.mutable_data();
        auto* s = nth.mutable_data();
        {
          py::gil_scoped_release nogil;
          mapp::data::build_blend_index(weights.data(), static_cast<int>(weights.size()), size, w,
                                        s);
        }
        return py::make_tuple(which, nth);
      },
      py::arg("weights"), py::arg("size"),
      "(dataset of each sample: int16, its sample number in that dataset: int64)");
}

// The "mapp" torch.distributed backend (megatronapp.distributed.backend
// registers its creator with torch.distributed.Backend.register_backend).
void register_backend(py::module_& m) {
  m.def(
      "create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeout_s,
         const std::string& group_name) {
        py::gil_scoped_release nogil;  // connecting waits for the other members
        return mapp::dist::create_backend(
            store, rank, size,
            std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000)), group_name);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"),
      py::arg("group_name"));
  m.def("backend_uses_shared_memory", [](const c10::intrusive_ptr<c10d::Backend>& backend) {
    return mapp::dist::backend_uses_shared_memory(backend);
  });
}

// The checkpoint file engine (checkpoint_engine.h): megatronapp.checkpoint's
// format and stream modules are thin wrappers over these.
void register_checkpoint(py::module_& m) {
  using Range = std::optional<std::pair<std::int64_t, std::int64_t>>;
  m.attr("checkpoint_format") = mapp::kCheckpointFormat;
  m.def("crc32", [](const py::bytes& data, std::uint32_t crc) {
    const std::string_view v = data;
    return mapp::crc32(v.data(), v.size(), crc);
  }, py::arg("data"), py::arg("crc") = 0);
  m.def("checkpoint_write_safetensors", &mapp::write_safetensors, py::arg("path"),
        py::arg("tensors"), py::arg("metadata"), py::call_guard<py::gil_scoped_release>());
  m.def("checkpoint_name", &mapp::checkpoint_name, py::arg("iteration"));
  m.def("checkpoint_begin", &mapp::begin_checkpoint, py::arg("directory"), py::arg("name"));
  m.def("checkpoint_write_rank_files", &mapp::write_rank_files, py::arg("directory"),
        py::arg("name"), py::arg("rank"),
        py::arg("tensors"), py::arg("pieces_json"), py::arg("ddp_json"), py::arg("metadata"),
        py::call_guard<py::gil_scoped_release>());
  m.def("checkpoint_commit", &mapp::commit_checkpoint, py::arg("directory"), py::arg("name"),
        py::arg("meta_json"), py::arg("world"), py::call_guard<py::gil_scoped_release>());
  // A rank's save as one job (checkpoint_engine.h): written, the ranks
  // meeting through the store, rank 0 committing; inline or on a thread.
  py::class_<mapp::AsyncCheckpointSave, std::shared_ptr<mapp::AsyncCheckpointSave>>(
      m, "AsyncCheckpointSave")
      .def("wait", &mapp::AsyncCheckpointSave::wait, py::call_guard<py::gil_scoped_release>())
      .def("done", &mapp::AsyncCheckpointSave::done);
  m.def("checkpoint_save", [](std::string directory, std::string name, int rank, int world,
                              std::vector<std::pair<std::string, at::Tensor>> tensors,
                              std::string pieces_json, std::string ddp_json,
                              std::vector<std::pair<std::string, std::string>> metadata,
                              std::string meta_json, const c10::intrusive_ptr<c10d::Store>& store,
                              const std::string& prefix, bool async_save) -> py::object {
    mapp::SaveJob job{std::move(directory), std::move(name),     rank,
                      world,                std::move(tensors),  std::move(pieces_json),
                      std::move(ddp_json),  std::move(metadata), std::move(meta_json)};
    if (async_save) {
      // Python keeps its own pending save (megatronapp.checkpoint.wait_pending).
      return py::cast(std::make_shared<mapp::AsyncCheckpointSave>(std::move(job), store, prefix));
    }
    std::string path;
    {
      py::gil_scoped_release nogil;
      path = mapp::run_save_job(std::move(job), store, prefix);
    }
    return py::str(path);
  }, py::arg("directory"), py::arg("name"), py::arg("rank"), py::arg("world"), py::arg("tensors"),
     py::arg("pieces_json"), py::arg("ddp_json"), py::arg("metadata"), py::arg("meta_json"),
     py::arg("store"), py::arg("prefix"), py::arg("async_save"));
  m.def("checkpoint_latest", &mapp::latest_checkpoint, py::arg("directory"));
  m.def("checkpoint_read_metadata", &mapp::read_checkpoint_metadata, py::arg("directory_or_path"));
  py::class_<mapp::TensorFile>(m, "CheckpointTensorFile")
      .def(py::init<std::string>(), py::arg("path"))
      .def_property_readonly("path", &mapp::TensorFile::path)
      .def_property_readonly("metadata", &mapp::TensorFile::metadata)
      .def("keys", &mapp::TensorFile::keys)
      .def("entry", [](const mapp::TensorFile& f, const std::string& key) {
        const auto& e = f.entry(key);
        return py::make_tuple(e.dtype, e.shape, e.offset, e.nbytes);  // dtype: a torch.dtype
      }, py::arg("key"))
      .def("tensor", &mapp::TensorFile::tensor, py::arg("key"), py::arg("verify") = true,
           py::call_guard<py::gil_scoped_release>());
  py::class_<mapp::CheckpointLoader>(m, "CheckpointLoader")
      .def(py::init([](std::string path, const std::string& meta, bool verify,
                       std::int64_t budget, int threads) {
        return std::make_unique<mapp::CheckpointLoader>(
            std::move(path), meta, mapp::LoaderOptions{verify, budget, threads});
      }), py::arg("path"), py::arg("metadata_json"), py::arg("verify") = true,
           py::arg("budget") = 64LL << 20, py::arg("threads") = 0)
      .def("has", &mapp::CheckpointLoader::has, py::arg("name"), py::arg("kind"))
      .def("kinds", &mapp::CheckpointLoader::kinds, py::arg("name"))
      .def("scalar", &mapp::CheckpointLoader::scalar, py::arg("name"), py::arg("kind"),
           py::call_guard<py::gil_scoped_release>())
      .def("into", [](mapp::CheckpointLoader& ld, const std::string& name,
                      const std::string& kind, const at::Tensor& dest,
                      const std::optional<std::vector<std::int64_t>>& tp,
                      const std::vector<std::int64_t>& shape, const Range& flat) {
        std::optional<mapp::TpSlice> sl;
        if (tp) {
          MAPP_CHECK(tp->size() == 3, "tp_slice is (dim, start, end), got ", tp->size(), " numbers");
          sl = mapp::TpSlice{(*tp)[0], (*tp)[1], (*tp)[2]};
        }
        ld.into(name, kind, dest, sl, shape, flat);
      }, py::arg("name"), py::arg("kind"), py::arg("dest"), py::arg("tp_slice"),
           py::arg("global_shape"), py::arg("flat") = py::none())
      .def("wait", &mapp::CheckpointLoader::wait, py::call_guard<py::gil_scoped_release>())
      .def("done", &mapp::CheckpointLoader::done)
      .def_property("budget", &mapp::CheckpointLoader::budget, &mapp::CheckpointLoader::set_budget)
      .def_property_readonly("verify", &mapp::CheckpointLoader::verify);
}

// The deferred weight gradients of zero-bubble schedules (nn.h): the store,
// the process-wide active store and the deferral of a Python closure (custom
// autograd functions' weight gradients), all kept by the C++ engine.
void register_weight_grads(py::module_& m) {
  namespace nn = mapp::nn;
  py::class_<nn::WeightGradStore, std::shared_ptr<nn::WeightGradStore>>(m, "WeightGradStore")
      .def(py::init<>())
      .def("__len__", &nn::WeightGradStore::size);
  // Returns nothing: the Python front-end keeps the previous store alive.
  m.def("set_active_weight_grad_store",
        [](nn::WeightGradStore* store) { nn::set_active_weight_grad_store(store); },
        py::arg("store").none(true));
  // The closure may be called, and is destroyed, on a thread without the GIL;
  // it returns None once it added the gradient into .grad in place.
  m.def("defer_weight_grad", [](const at::Tensor& param, py::function wgrad) {
    return nn::defer(param, from_python<at::Tensor>(
                                std::move(wgrad), "a deferred weight gradient's closure returned "
                                                  "{} where a tensor or None was expected"));
  }, py::arg("param"), py::arg("wgrad"));
  // dy^T x, or None once added into weight.grad by the GEMM (gradient-
  // accumulation fusion): the custom linears' weight gradient, as linear()'s.
  m.def("linear_weight_grad",
        [](const at::Tensor& weight, const at::Tensor& dy, const at::Tensor& x, bool may_fuse) {
          const at::Tensor g = nn::linear_weight_grad(weight, dy, x, may_fuse);
          return g.defined() ? std::optional<at::Tensor>(g) : std::nullopt;
        },
        py::arg("weight"), py::arg("dy"), py::arg("x"), py::arg("may_fuse") = true,
        py::call_guard<py::gil_scoped_release>());
  m.def("is_weight_grad_deferred", &nn::is_deferred, py::arg("param"));
  // Autograd's engine must be entered without the GIL.
  m.def("run_weight_grads", &nn::run_weight_grads, py::arg("store"),
        py::call_guard<py::gil_scoped_release>());
}

// The gradient reducer (ddp.h), under megatronapp.distributed.DistributedDataParallel.
void register_reducer(py::module_& m) {
  using mapp::GradBucket;
  using mapp::GradReducer;
  auto opt = [](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  py::class_<GradBucket>(m, "GradBucket")
      .def_readonly("index", &GradBucket::index)
      .def_readonly("params", &GradBucket::params)
      .def_readonly("offsets", &GradBucket::offsets)
      .def_readonly("numel", &GradBucket::numel)
      .def_readonly("dtype", &GradBucket::dtype)  // a torch.dtype
      .def_readonly("grad_data", &GradBucket::grad_data)
      .def_readonly("main_grads", &GradBucket::main_grads)
      .def_property_readonly("param_data", [opt](const GradBucket& b) { return opt(b.param_data); })
      .def_property_readonly("shard", [opt](const GradBucket& b) { return opt(b.shard); })
      .def_readonly("layout", &GradBucket::layout)
      .def_readonly("state", &GradBucket::state)
      .def_readonly("exact", &GradBucket::exact)
      .def_readonly("expert", &GradBucket::expert)
      .def_readonly("group_name", &GradBucket::group)
      .def_property_readonly("raw_bytes", [](const GradBucket& b) { return b.stats.raw_bytes; })
      .def_property_readonly("sent_bytes", [](const GradBucket& b) { return b.stats.sent_bytes; })
      .def_property_readonly("gather_in_flight", [](const GradBucket& b) { return bool(b.gather); });
  py::class_<GradReducer>(m, "GradReducer")
      .def(py::init([](std::vector<at::Tensor> params, const std::vector<bool>& exact,
                       const std::vector<bool>& expert, const std::vector<bool>& own_bucket,
                       mapp::ReducerOptions options) {
             MAPP_CHECK(exact.size() == params.size() && expert.size() == params.size() &&
                            own_bucket.size() == params.size(),
                        "GradReducer: one exact/expert/own_bucket flag per parameter");
             std::vector<mapp::ReducerParam> ps;
             for (std::size_t i = 0; i < params.size(); ++i)
               ps.push_back({std::move(params[i]), exact[i], expert[i], own_bucket[i]});
             return std::make_unique<GradReducer>(std::move(ps), std::move(options));
           }),
           py::arg("params"), py::arg("exact"), py::arg("expert"), py::arg("own_bucket"),
           py::arg("options"))
      .def("prepare_forward", &GradReducer::prepare_forward,
           py::call_guard<py::gil_scoped_release>())
      .def_property("sync", &GradReducer::sync, &GradReducer::set_sync)
      .def_property("finish_at_backward_end", &GradReducer::finish_at_backward_end,
                    &GradReducer::set_finish_at_backward_end)
      .def("finish_grad_sync", &GradReducer::finish_grad_sync,
           py::call_guard<py::gil_scoped_release>())
      .def("zero_grad_buffer", &GradReducer::zero_grad_buffer)
      .def("enable_distributed_optimizer", &GradReducer::enable_distributed_optimizer)
      .def_property_readonly("uses_distributed_optimizer",
                             &GradReducer::uses_distributed_optimizer)
      .def("start_param_sync", &GradReducer::start_param_sync,
           py::call_guard<py::gil_scoped_release>())
      .def("finish_param_sync", &GradReducer::finish_param_sync, py::arg("buckets") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("gathers_pending", &GradReducer::gathers_pending)
      .def_property_readonly("buckets", [](GradReducer& r) {
        std::vector<GradBucket*> out;
        for (auto& b : r.buckets()) out.push_back(&b);
        return out;
      }, py::return_value_policy::reference_internal)
      .def("pieces", [](const GradReducer& r, bool sharded) {
        std::vector<py::tuple> out;
        for (const auto& pc : r.pieces(sharded))
          out.push_back(py::make_tuple(pc.bucket, pc.slot, pc.lo, pc.hi, pc.shard_lo, pc.param_lo));
        return out;
      }, py::arg("sharded"))
      .def("chunk_range", [](GradReducer& r, int bucket, bool sharded) {
        MAPP_CHECK(bucket >= 0 && bucket < static_cast<int>(r.buckets().size()),
                   "chunk_range: bucket ", bucket, " out of range");
        return r.chunk_range(r.buckets()[bucket], sharded);
      }, py::arg("bucket"), py::arg("sharded"))
      .def("main_params", &GradReducer::main_params, py::arg("sharded"))
      .def("main_grads", &GradReducer::main_grads, py::arg("sharded"))
      .def("write_back", &GradReducer::write_back, py::arg("mains"), py::arg("sharded"))
      .def("all_gather_params", &GradReducer::all_gather_params,
           py::call_guard<py::gil_scoped_release>())
      .def("spec", &GradReducer::spec)
      .def_property_readonly("synchronized_steps", &GradReducer::synchronized_steps)
      .def("last_step_stats", [](const GradReducer& r) {
        const auto st = r.last_step_stats();
        return py::make_tuple(st.raw_bytes, st.sent_bytes);
      })
      .def("codec_state", &GradReducer::codec_state)
      .def("load_codec_state", &GradReducer::load_codec_state, py::arg("tensors"),
           py::arg("synchronized_steps"));
  py::class_<mapp::LossScaler>(m, "LossScaler")
      .def(py::init<double>(), py::arg("scale"))
      .def(py::init([](double initial, double min_scale, double growth, double backoff,
                       int interval, int hysteresis) {
             return std::make_unique<mapp::LossScaler>(
                 mapp::LossScalerOptions{initial, min_scale, growth, backoff, interval, hysteresis});
           }),
           py::arg("initial_scale"), py::arg("min_scale"), py::arg("growth_factor"),
           py::arg("backoff_factor"), py::arg("growth_interval"), py::arg("hysteresis"))
      .def_property_readonly("scale", &mapp::LossScaler::scale)
      .def_property_readonly("inv_scale", &mapp::LossScaler::inv_scale)
      .def_property_readonly("min_scale", [](const mapp::LossScaler& l) { return l.options().min_scale; })
      .def_property_readonly("growth_factor",
                             [](const mapp::LossScaler& l) { return l.options().growth_factor; })
      .def_property_readonly("backoff_factor",
                             [](const mapp::LossScaler& l) { return l.options().backoff_factor; })
      .def_property_readonly("growth_interval",
                             [](const mapp::LossScaler& l) { return l.options().growth_interval; })
      .def_property_readonly("hysteresis",
                             [](const mapp::LossScaler& l) { return l.options().hysteresis; })
      .def_property_readonly("growth_tracker", &mapp::LossScaler::growth_tracker)
      .def_property_readonly("hysteresis_tracker", &mapp::LossScaler::hysteresis_tracker)
      .def("update", &mapp::LossScaler::update, py::arg("found_inf"))
      .def("load", &mapp::LossScaler::load, py::arg("scale"), py::arg("growth_tracker"),
           py::arg("hysteresis_tracker"));
  py::class_<mapp::ReducerOptions>(m, "ReducerOptions")
      .def(py::init<>())
      .def_readwrite("bucket_bytes", &mapp::ReducerOptions::bucket_bytes)
      .def_readwrite("compression", &mapp::ReducerOptions::compression)
      .def_readwrite("compression_start_iter", &mapp::ReducerOptions::compression_start_iter)
      .def_readwrite("overlap_grad_reduce", &mapp::ReducerOptions::overlap_grad_reduce)
      .def_readwrite("gradient_accumulation_fusion",
                     &mapp::ReducerOptions::gradient_accumulation_fusion)
      .def_readwrite("grad_reduce_in_fp32", &mapp::ReducerOptions::grad_reduce_in_fp32)
      .def_readwrite("group", &mapp::ReducerOptions::group)
      .def_readwrite("expert_group", &mapp::ReducerOptions::expert_group)
      .def_readwrite("expert_scale", &mapp::ReducerOptions::expert_scale);
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "MegatronApp native core (topology, tunables, logging); tensor ops are "
            "torch.ops.mapp.*";
  register_common(m);
  register_topology(m);
  register_memory(m);
  register_pipeline(m);
  register_trace(m);
  register_data(m);
  register_backend(m);
  register_checkpoint(m);
  register_weight_grads(m);
  register_reducer(m);
}
