// megatronapp._C: a thin pybind11 module (torch's bundled pybind11) exposing the
// torch-free core. Tensor operators are not bound here: they are torch
// operators (torch.ops.mapp.*) registered by libmegatronapp_torch, which this
// module links so that importing it registers them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "mapp/common/check.h"
#include "mapp/common/log.h"
#include "mapp/common/tunables.h"
#include "mapp/topology/rank_grid.h"
#include "mapp/torch/ops.h"

namespace py = pybind11;

namespace {

void register_common(py::module_& m) {
  py::register_exception<mapp::StateError>(m, "StateError", PyExc_RuntimeError);
  py::register_exception<mapp::BackendError>(m, "BackendError", PyExc_RuntimeError);
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
      .def(py::init<int, int, int, int, int>(), py::arg("world_size"), py::arg("tp") = 1,
           py::arg("pp") = 1, py::arg("dp") = 0, py::arg("cp") = 1)
      .def_property_readonly("world_size", &mapp::RankGrid::world_size)
      .def_property_readonly("tp", &mapp::RankGrid::tp)
      .def_property_readonly("cp", &mapp::RankGrid::cp)
      .def_property_readonly("dp", &mapp::RankGrid::dp)
      .def_property_readonly("pp", &mapp::RankGrid::pp)
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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "MegatronApp native core (topology, tunables, logging); tensor ops are "
            "torch.ops.mapp.*";
  register_common(m);
  register_topology(m);
}
