#include "mapp/torch/comm_engine.h"

#include <deque>
#include <map>
#include <thread>
#include <utility>

#include "mapp/common/check.h"
#include "mapp/common/tunables.h"
#include "mapp/trace/tracer.h"

#ifdef MAPP_WITH_CUDA_KERNELS
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace mapp::torch_ext {

// ---- stream hand-off -------------------------------------------------------------

#ifdef MAPP_WITH_CUDA_KERNELS
#define MAPP_CUDA_CHECK(call)                                                          \
  do {                                                                                 \
    const cudaError_t mapp_err_ = (call);                                              \
    if (mapp_err_ != cudaSuccess)                                                      \
      MAPP_FAIL_BACKEND(#call, " failed: ", cudaGetErrorString(mapp_err_));            \
  } while (0)

// The events of one job on one device: `ready` on the producer's stream at
// submission, `done` on the communication stream when the job has finished.
class StreamHandoff {
 public:
  StreamHandoff(c10::Device device, std::vector<at::Tensor> tensors)
      : device_(device), tensors_(std::move(tensors)) {
    c10::cuda::CUDAGuard guard(device_);
    MAPP_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    MAPP_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    // Everything the caller queued so far (e.g. the backward that produced
    // the gradients) must finish before the worker reads the tensors.
    MAPP_CUDA_CHECK(cudaEventRecord(ready_, c10::cuda::getCurrentCUDAStream(device_.index())));
  }
  ~StreamHandoff() {
    c10::cuda::CUDAGuard guard(device_);
    cudaEventDestroy(ready_);  // destroying a pending event is allowed (deferred)
    cudaEventDestroy(done_);
  }
  StreamHandoff(const StreamHandoff&) = delete;
  StreamHandoff& operator=(const StreamHandoff&) = delete;

  // On the worker thread: runs `job` with the device set and a pool stream
  // current, after the producer's work; records `done` afterwards.
  template <typename Job>
  CommStats run(Job&& job) {
    c10::cuda::CUDAGuard device_guard(device_);
    c10::cuda::CUDAStream comm = c10::cuda::getStreamFromPool(/*isHighPriority=*/true,
                                                              device_.index());
    MAPP_CUDA_CHECK(cudaStreamWaitEvent(comm.stream(), ready_, 0));
    for (const at::Tensor& t : tensors_) {  // not reused before the comm stream is done
      if (t.defined() && t.is_cuda() && t.has_storage())
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), comm);
    }
    c10::cuda::CUDAStreamGuard stream_guard(comm);  // kernels and NCCL order on `comm`
    CommStats st = job();
    MAPP_CUDA_CHECK(cudaEventRecord(done_, comm.stream()));
    tensors_.clear();
    return st;
  }

  // On the waiting thread: its current stream on the device waits for `done`.
  void order_caller_after() {
    c10::cuda::CUDAGuard guard(device_);
    MAPP_CUDA_CHECK(
        cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_.index()).stream(), done_, 0));
  }

 private:
  c10::Device device_;
  std::vector<at::Tensor> tensors_;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
};
#else
class StreamHandoff {  // a build without CUDA: no device tensors can reach here
 public:
  template <typename Job>
  CommStats run(Job&& job) {
    return job();
  }
  void order_caller_after() {}
};
#endif

// ---- CommWork ----------------------------------------------------------------------

CommWork::CommWork(std::string description) : description_(std::move(description)) {}
CommWork::~CommWork() = default;

void CommWork::set_handoff(std::unique_ptr<StreamHandoff> h) { handoff_ = std::move(h); }

bool CommWork::is_completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void CommWork::finish(CommStats stats) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_ = stats;
    done_ = true;
  }
  cv_.notify_all();
}

void CommWork::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    done_ = true;
  }
  cv_.notify_all();
}

CommStats CommWork::wait() {
  return wait(std::chrono::milliseconds(1000 * tunable_int("MAPP_COLLECTIVE_TIMEOUT_S")));
}

CommStats CommWork::wait(std::chrono::milliseconds timeout) {
  std::exception_ptr error;
  CommStats stats;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [this] { return done_; })) {
      MAPP_FAIL_BACKEND(description_, " did not complete within ", timeout.count(),
                        " ms (a peer may be stuck or dead; raise MAPP_COLLECTIVE_TIMEOUT_S "
                        "if the job is just slow)");
    }
    error = error_;
    stats = stats_;
  }
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const ValueError&) {
      throw;
    } catch (const StateError&) {
      throw;
    } catch (const std::exception& e) {
      MAPP_FAIL_BACKEND(description_, " failed: ", e.what());
    }
  }
  if (handoff_) handoff_->order_caller_after();
  return stats;
}

// ---- the worker threads -----------------------------------------------------------

namespace {

class Engine {
 public:
  c10::intrusive_ptr<CommWork> submit(const std::string& op, const std::string& group,
                                      const std::vector<at::Tensor>& tensors,
                                      std::function<CommStats()> job) {
    std::lock_guard<std::mutex> lock(mu_);
    Worker& w = workers_[group];
    auto work = c10::make_intrusive<CommWork>(op + " on group '" + group + "' (job " +
                                              std::to_string(++w.submitted) + ")");
#ifdef MAPP_WITH_CUDA_KERNELS
    for (const at::Tensor& t : tensors) {
      if (t.defined() && t.is_cuda()) {
        for (const at::Tensor& u : tensors) {
          MAPP_CHECK(!u.defined() || !u.is_cuda() || u.device() == t.device(), op,
                     ": tensors on different devices (", t.device(), " and ", u.device(), ")");
        }
        work->set_handoff(std::make_unique<StreamHandoff>(t.device(), tensors));
        break;
      }
    }
#else
    (void)tensors;
#endif
    if (!w.started) {  // exactly one thread per group keeps its collectives in order
      w.started = true;
      std::thread([&w] { w.loop(); }).detach();  // blocked collectives must not hang exit
    }
    {
      std::lock_guard<std::mutex> wl(w.mu);
      w.queue.emplace_back(work, std::move(job));
    }
    w.cv.notify_one();
    return work;
  }

 private:
  struct Worker {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::pair<c10::intrusive_ptr<CommWork>, std::function<CommStats()>>> queue;
    bool started = false;
    std::int64_t submitted = 0;  // guarded by Engine::mu_

    void loop() {
      trace::set_thread_lane(trace::kCommLane);
      for (;;) {
        std::pair<c10::intrusive_ptr<CommWork>, std::function<CommStats()>> item;
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [this] { return !queue.empty(); });
          item = std::move(queue.front());
          queue.pop_front();
        }
        CommWork& work = *item.first;
        try {
          StreamHandoff* h = work.handoff();
          work.finish(h != nullptr ? h->run(item.second) : item.second());
        } catch (...) {
          work.fail(std::current_exception());
        }
      }
    }
  };
  std::mutex mu_;
  std::map<std::string, Worker> workers_;  // node-based: Worker addresses stay valid
};

Engine& engine() {
  static Engine* e = new Engine;  // leaked: threads may outlive statics
  return *e;
}

}  // namespace

c10::intrusive_ptr<CommWork> submit(const std::string& op, const std::string& group_name,
                                    const std::vector<at::Tensor>& tensors,
                                    std::function<CommStats()> job) {
  return engine().submit(op, group_name, tensors, std::move(job));
}

}  // namespace mapp::torch_ext
