// The test programs' JSON: a tensor's values as a list (%.9g: float32 round-trips).
#pragma once

#include <ATen/ATen.h>

#include <cstdio>
#include <sstream>
#include <string>

inline std::string json_values(const at::Tensor& t) {
  const at::Tensor f = t.detach().to(at::kDouble).contiguous().flatten();
  const double* p = f.data_ptr<double>();
  std::ostringstream os;
  os << "[";
  char buf[40];
  for (int64_t i = 0; i < f.numel(); ++i) {
    std::snprintf(buf, sizeof(buf), "%.9g", p[i]);
    os << (i ? ", " : "") << buf;
  }
  os << "]";
  return os.str();
}
