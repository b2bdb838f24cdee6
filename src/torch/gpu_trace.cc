// Pooled CUDA-event timers for trace events (see gpu_trace.h).
#include "mapp/torch/gpu_trace.h"

#include <mutex>
#include <unordered_map>
#include <vector>

#include "mapp/common/check.h"

#ifdef MAPP_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace mapp::torch_ext {

#ifdef MAPP_WITH_CUDA_KERNELS
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) MAPP_FAIL_BACKEND("GPU trace timer: ", what, ": ", cudaGetErrorString(err));
}

struct Timer {
  cudaEvent_t start = nullptr, end = nullptr;
  trace::Event event;
  bool ended = false;
};

class TimerPool {
 public:
  std::int64_t begin() {
    std::lock_guard<std::mutex> lock(mu_);
    Timer t;
    t.start = take();
    t.end = take();
    check(cudaEventRecord(t.start, c10::cuda::getCurrentCUDAStream().stream()),
          "cudaEventRecord(start)");
    const std::int64_t h = next_++;
    timers_.emplace(h, t);
    return h;
  }

  void end(std::int64_t h, const trace::Event& e) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = timers_.find(h);
    MAPP_CHECK(it != timers_.end() && !it->second.ended, "gpu_timer_end: unknown or ended handle ",
               h);
    check(cudaEventRecord(it->second.end, c10::cuda::getCurrentCUDAStream().stream()),
          "cudaEventRecord(end)");
    it->second.event = e;
    it->second.ended = true;
  }

  std::int64_t resolve() {
    std::lock_guard<std::mutex> lock(mu_);
    trace::Tracer* tracer = trace::global();
    for (auto it = timers_.begin(); it != timers_.end();) {
      Timer& t = it->second;
      if (!t.ended) {
        ++it;
        continue;
      }
      const cudaError_t q = cudaEventQuery(t.end);  // non-blocking
      if (q == cudaErrorNotReady) {
        ++it;
        continue;
      }
      check(q, "cudaEventQuery");
      float ms = 0.0f;
      check(cudaEventElapsedTime(&ms, t.start, t.end), "cudaEventElapsedTime");
      t.event.busy_ns = static_cast<std::int64_t>(static_cast<double>(ms) * 1e6);
      if (tracer != nullptr) tracer->record(t.event);
      free_.push_back(t.start);
      free_.push_back(t.end);
      it = timers_.erase(it);
    }
    return static_cast<std::int64_t>(timers_.size());
  }

 private:
  cudaEvent_t take() {
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDefault), "cudaEventCreate");
    return e;
  }

  std::mutex mu_;
  std::int64_t next_ = 1;
  std::unordered_map<std::int64_t, Timer> timers_;
  std::vector<cudaEvent_t> free_;
};

TimerPool& pool() {
  static TimerPool* p = new TimerPool;  // leaked: CUDA may be torn down before statics
  return *p;
}

}  // namespace

bool gpu_timers_available() { return true; }
std::int64_t gpu_timer_begin() { return pool().begin(); }
void gpu_timer_end(std::int64_t h, const trace::Event& e) { pool().end(h, e); }
std::int64_t resolve_gpu_timers() { return pool().resolve(); }

#else

bool gpu_timers_available() { return false; }
std::int64_t gpu_timer_begin() {
  MAPP_CHECK_STATE(false, "GPU trace timers need a CUDA build of megatronapp");
  return 0;
}
void gpu_timer_end(std::int64_t, const trace::Event&) {
  MAPP_CHECK_STATE(false, "GPU trace timers need a CUDA build of megatronapp");
}
std::int64_t resolve_gpu_timers() { return 0; }

#endif

}  // namespace mapp::torch_ext
