// The communication engine: asynchronous collectives on one worker thread per
// process group, returned as CommWork handles.
//
//   auto work = submit("dp bucket all-reduce", group, {buf}, [=] { return ...; });
//   work->is_completed();                       // never blocks
//   CommStats st = work->wait(std::chrono::seconds(30));   // or throws
//
// Ordering: jobs of one group run in submission order on that group's thread,
// so ranks that submit in the same order issue matching collectives.
//
// Device and stream hand-off (CUDA tensors): submit() records an event on the
// caller's current stream of the tensors' device; the worker thread sets that
// device (CUDAGuard), makes a pool stream current, waits on the event before
// touching any tensor, marks the tensors as used on its stream for the caching
// allocator, and records a completion event. wait() makes the caller's current
// stream wait on that event, so what the job wrote is safe to read on the
// caller's stream without a device-wide synchronization. CPU tensors need none
// of this: the job's completion is the hand-off.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mapp/codec/codec.h"

namespace mapp::torch_ext {

struct CommStats {
  std::int64_t raw_bytes = 0;   // bytes an uncompressed fp32 ring all-reduce would send
  std::int64_t sent_bytes = 0;  // bytes this rank actually sent
};

// What a compressed collective needs besides its tensors.
struct CompressedOptions {
  codec::Spec spec;                  // the codec (codec::Spec::parse("int8"), ...)
  std::vector<std::int64_t> layout;  // (offset, rows, cols) triples of matrices (PowerSGD)
  bool average = true;               // mean instead of sum
  std::string group_name;            // c10d group, resolved by name
};

class StreamHandoff;  // CUDA events of one job (comm_engine.cc)

// One submitted job. Thread-safe; the Python face is torch.classes.mapp.CommWork.
class CommWork : public torch::CustomClassHolder {
 public:
  explicit CommWork(std::string description);
  ~CommWork() override;

  // True once the job has finished (successfully or not); never blocks.
  bool is_completed() const;

  // Blocks until the job finishes or `timeout` elapses. Returns its statistics
  // and, for CUDA tensors, orders the caller's current stream after the job.
  // Throws the job's error, or a timeout error, naming op, group and sequence.
  // May be called more than once (later calls return the same result).
  CommStats wait(std::chrono::milliseconds timeout);

  // wait() with MAPP_COLLECTIVE_TIMEOUT_S as the timeout.
  CommStats wait();

  // "<op> on group '<name>' (job <seq>)".
  const std::string& description() const { return description_; }

  // ---- for the engine ----
  void set_handoff(std::unique_ptr<StreamHandoff> h);
  StreamHandoff* handoff() const { return handoff_.get(); }
  void finish(CommStats stats);
  void fail(std::exception_ptr error);

 private:
  const std::string description_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  CommStats stats_;
  std::exception_ptr error_;
  std::unique_ptr<StreamHandoff> handoff_;
};

// Runs `job` on the group's communication thread after the hand-off above;
// `tensors` are the device tensors the job reads or writes (CPU ones are fine).
c10::intrusive_ptr<CommWork> submit(const std::string& op, const std::string& group_name,
                                    const std::vector<at::Tensor>& tensors,
                                    std::function<CommStats()> job);

}  // namespace mapp::torch_ext
