// Errors that keep context. Every failure in the library is a typed C++
// exception carrying file:line and a message that says what was wrong and how to
// fix it; the Python binding maps the types onto Python exceptions:
//   ValueError    -> ValueError   (bad argument or configuration)
//   StateError    -> RuntimeError (called in the wrong state, e.g. before init)
//   BackendError  -> RuntimeError (CUDA / NCCL / c10d reported a failure)
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace mapp {

// Bad input: shapes, sizes, configuration. Derives from std::invalid_argument
// so pybind11 translates it to Python's ValueError without extra glue.
class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// An API used in the wrong state (e.g. layers before initialize_model_parallel).
class StateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A failure reported by an outside system (CUDA, NCCL, c10d).
class BackendError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace internal {

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <typename E, typename... Args>
[[noreturn]] void fail(const char* file, int line, const Args&... args) {
  throw E(concat(args..., " [", file, ":", line, "]"));
}

}  // namespace internal
}  // namespace mapp

// MAPP_CHECK(cond, msg...): throws mapp::ValueError with the message (streamed
// pieces) and the source location when `cond` is false.
#define MAPP_CHECK(cond, ...)                                                \
  do {                                                                       \
    if (!(cond)) {                                                           \
      ::mapp::internal::fail<::mapp::ValueError>(__FILE__, __LINE__,         \
                                                 __VA_ARGS__);               \
    }                                                                        \
  } while (0)

// MAPP_CHECK_STATE(cond, msg...): same, for calls made in the wrong state.
#define MAPP_CHECK_STATE(cond, ...)                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      ::mapp::internal::fail<::mapp::StateError>(__FILE__, __LINE__,         \
                                                 __VA_ARGS__);               \
    }                                                                        \
  } while (0)

// MAPP_FAIL_BACKEND(msg...): an outside system failed.
#define MAPP_FAIL_BACKEND(...) \
  ::mapp::internal::fail<::mapp::BackendError>(__FILE__, __LINE__, __VA_ARGS__)
