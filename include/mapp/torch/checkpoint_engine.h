// The checkpoint file engine: the one implementation of the files of a
// megatronapp checkpoint (docs/checkpoint.md). Python's
// megatronapp.checkpoint and C++'s save_checkpoint/load_checkpoint
// (checkpoint.h) only collect what to save and where to load it; everything
// that touches the files is here:
//
//  * tensor files: safetensors with a CRC-32 per tensor in the header
//    metadata, written straight from the tensors' memory and fsynced;
//  * the commit: each rank writes rank<R>.safetensors and its index into
//    <dir>/.tmp.iter_N; rank 0 merges the indices into metadata.json, fsyncs,
//    renames the directory to iter_N and replaces <dir>/latest by rename;
//  * a rank's save as one job (SaveJob): its files written, the ranks meeting
//    through the c10d store (no collective), rank 0 committing — run inline
//    or on a background thread (AsyncCheckpointSave: async save);
//  * streamed, resharding reads: each destination (this rank's tensor-
//    parallel region of a global tensor, or a flat range of it) is filled
//    from the byte ranges of the stored pieces that overlap it, on a thread
//    pool, never assembling a global tensor; CRC-32 per stored piece.
//
//   CheckpointLoader ld(path, metadata_json, {.verify = true});
//   ld.into("layers.0.mlp.fc1.weight", "param", p, TpSlice{0, 0, 128}, {256, 64});
//   ld.wait();  // throws ValueError naming the file and tensor
#pragma once

#include <ATen/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace mapp {

constexpr int kCheckpointFormat = 1;

// CRC-32 (zlib's polynomial and result), continuing from `crc`.
std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc = 0);

// ---- tensor files ----------------------------------------------------------------------------

// Writes `tensors` (any device, any layout: copied to contiguous host memory
// one at a time when they are not already) as safetensors with a CRC-32 per
// tensor (metadata "crc32", a JSON object) plus `metadata`, and fsyncs the
// file. Returns the bytes written. Throws ValueError naming the file.
std::int64_t write_safetensors(const std::string& path,
                               const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                               const std::vector<std::pair<std::string, std::string>>& metadata);

// A safetensors file opened for positioned reads; the header is checked here
// (offsets inside the file, sizes matching shapes, known dtypes, CRC table).
class TensorFile {
 public:
  struct Entry {
    at::ScalarType dtype;
    std::vector<std::int64_t> shape;
    std::int64_t offset;  // of the data, from the start of the file
    std::int64_t nbytes;
  };
  explicit TensorFile(std::string path);
  ~TensorFile();
  TensorFile(const TensorFile&) = delete;
  TensorFile& operator=(const TensorFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<std::string>& keys() const { return keys_; }  // in file order
  const Entry& entry(const std::string& key) const;
  // The tensor `key`, checked against its CRC when `verify`.
  at::Tensor tensor(const std::string& key, bool verify = true) const;
  // Fills `nbytes` at `dst` with the file's bytes at `offset`.
  void read(void* dst, std::int64_t nbytes, std::int64_t offset) const;
  // Throws when `crc` is not the stored CRC of `key` (keys without one pass).
  void check(const std::string& key, std::uint32_t crc) const;
  // The CRC of `key`'s bytes, read in chunks of at most `budget` bytes.
  std::uint32_t crc_streamed(const std::string& key, std::int64_t budget) const;

 private:
  std::string path_;
  int fd_ = -1;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> keys_;
  std::map<std::string, std::uint32_t> crcs_;
};

// Every tensor of `path` (or only `names`), checked. Throws ValueError.
std::vector<std::pair<std::string, at::Tensor>> read_safetensors(
    const std::string& path, const std::optional<std::vector<std::string>>& names = std::nullopt);

// ---- the commit ------------------------------------------------------------------------------

// "iter_0000100"
std::string checkpoint_name(std::int64_t iteration);
// Rank 0, before any rank writes: <dir> exists and <dir>/.tmp.<name> is new
// and empty. Returns the temporary directory.
std::string begin_checkpoint(const std::string& dir, const std::string& name);
// Any rank, after begin_checkpoint: writes rank<R>.safetensors (the tensors,
// with `metadata`) and index.rank<R>.json {"rank", "pieces", "ddp", "bytes"}
// into <dir>/.tmp.<name>, both fsynced. `pieces_json` / `ddp_json` are JSON
// arrays. Returns the bytes of the tensor file.
std::int64_t write_rank_files(const std::string& dir, const std::string& name, int rank,
                              const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::string& pieces_json, const std::string& ddp_json,
                              const std::vector<std::pair<std::string, std::string>>& metadata);
// Rank 0, once every rank's files are written: metadata.json is `meta_json`
// (an object) plus "pieces" (concatenated) and "ddp" ({rank: entries}) from
// the index files of ranks 0..world-1 (world = 0: `meta_json` holds them
// already); then fsyncs, renames <dir>/.tmp.<name> to <dir>/<name> (to
// <name>.1, .2, ... if that exists: a committed checkpoint is never
// replaced), fsyncs <dir> and replaces <dir>/latest. Returns the final path.
std::string commit_checkpoint(const std::string& dir, const std::string& name,
                              const std::string& meta_json, int world);
// Everything one rank saves (a front-end collects it) and the commit's
// metadata (used by rank 0).
struct SaveJob {
  std::string dir, name;  // name: checkpoint_name(iteration)
  int rank = 0, world = 1;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::string pieces_json = "[]", ddp_json = "[]";               // write_rank_files
  std::vector<std::pair<std::string, std::string>> metadata;    // of the tensor file
  std::string meta_json = "{}";                                  // commit_checkpoint (rank 0)
};
// After rank 0's begin_checkpoint: writes this rank's files, then meets the
// other ranks through `store` under `prefix` (set/wait, no collective, so it
// may run on another thread beside training): rank 0 commits once every rank
// has written, and every rank returns once the commit is done, with the
// committed path. A failure on any rank surfaces there; the others wait for
// the store's timeout.
std::string run_save_job(SaveJob job, const c10::intrusive_ptr<c10d::Store>& store,
                         const std::string& prefix);

// A save running on a background thread (async save: the caller gave host
// copies of its tensors). wait() returns the committed path or rethrows the
// failure; the destructor waits (dropping a failure nobody asked about).
class AsyncCheckpointSave {
 public:
  AsyncCheckpointSave(SaveJob job, c10::intrusive_ptr<c10d::Store> store, std::string prefix);
  ~AsyncCheckpointSave();
  AsyncCheckpointSave(const AsyncCheckpointSave&) = delete;
  AsyncCheckpointSave& operator=(const AsyncCheckpointSave&) = delete;
  std::string wait();
  bool done() const { return done_.load(); }

 private:
  std::thread thread_;
  std::atomic<bool> done_{false};
  std::string path_;
  std::exception_ptr error_;
};

// The process's save in flight (one at a time, as Megatron's async save): a
// new save first waits for it. set_pending_save replaces it (waiting for the
// previous one); wait_pending_save returns its path ("" when none) and clears it.
void set_pending_save(std::shared_ptr<AsyncCheckpointSave> save);
std::string wait_pending_save();

// The c10d store dist::init joined (null before; C++ trainers' checkpoints
// meet through it).
c10::intrusive_ptr<c10d::Store> rendezvous_store();
void set_rendezvous_store(c10::intrusive_ptr<c10d::Store> store);

// The checkpoint <dir>/latest names; nullopt without `latest`. Throws
// ValueError for a pointer that names nothing valid.
std::optional<std::string> latest_checkpoint(const std::string& dir);
// (path, metadata.json text) of an iter_* directory, or of the one
// <dir>/latest names; nullopt when the directory has none. The metadata is
// checked (format, required keys).
std::optional<std::pair<std::string, std::string>> read_checkpoint_metadata(
    const std::string& dir_or_path);

// ---- streamed reads --------------------------------------------------------------------------

struct TpSlice {  // the tensor-parallel region: [lo, hi) of dimension dim
  std::int64_t dim, lo, hi;
};

struct LoaderOptions {
  bool verify = true;                // CRC-32 of every stored piece read
  std::int64_t budget = 64LL << 20;  // largest read buffer of one worker
  int threads = 0;                   // 0: min(8, hardware threads)
};

class CheckpointLoader {
 public:
  // `path`: the directory of the files the pieces name; `metadata_json`: an
  // object with "pieces" (metadata.json's entries).
  CheckpointLoader(std::string path, const std::string& metadata_json, LoaderOptions options = {});
  ~CheckpointLoader();  // waits for queued reads (their errors are dropped)
  CheckpointLoader(const CheckpointLoader&) = delete;
  CheckpointLoader& operator=(const CheckpointLoader&) = delete;

  bool has(const std::string& name, const std::string& kind) const;
  // Every kind stored for `name` (param, main, exp_avg, ...).
  std::vector<std::string> kinds(const std::string& name) const;
  // A piece stored whole (a scalar such as an optimizer's step), checked.
  at::Tensor scalar(const std::string& name, const std::string& kind);
  // Queues filling `dest` (contiguous; this rank's `tp` region of the global
  // tensor `name` of shape `global_shape`, or the flat range `flat` of that
  // region) from the stored pieces. Shapes, coverage and piece sizes are
  // checked here; the reads start at once on the pool. A device `dest` is
  // written on the stream current here (the workers set device and stream),
  // so work the caller queues on that stream after wait() sees the values.
  void into(const std::string& name, const std::string& kind, const at::Tensor& dest,
            const std::optional<TpSlice>& tp, const std::vector<std::int64_t>& global_shape,
            const std::optional<std::pair<std::int64_t, std::int64_t>>& flat = std::nullopt);
  // Blocks until every queued read and check is done; throws the first error.
  void wait();
  bool done() const;
  void set_budget(std::int64_t bytes) { options_.budget = bytes; }
  std::int64_t budget() const { return options_.budget; }
  bool verify() const { return options_.verify; }

 private:
  struct Job;
  const TensorFile& file(const std::string& name);
  void submit(std::function<void()> work);
  void worker();
  void run_job(const Job& job);
  void copy_box(const TensorFile& f, std::int64_t box_off, at::ScalarType dtype,
                const std::vector<std::int64_t>& strides, std::vector<std::int64_t> start,
                std::vector<std::int64_t> size, at::Tensor dview);

  std::string path_;
  LoaderOptions options_;
  std::map<std::pair<std::string, std::string>, std::vector<std::size_t>> by_key_;
  struct Piece {
    std::string name, kind, file, key;
    std::vector<std::int64_t> global_shape;
    std::optional<TpSlice> tp;
    std::int64_t lo = 0, hi = -1;  // hi < 0: the whole region
  };
  std::vector<Piece> pieces_;
  std::mutex files_mu_;
  std::map<std::string, std::unique_ptr<TensorFile>> files_;
  std::mutex checked_mu_;
  std::set<std::pair<std::string, std::string>> checked_;
  // the pool
  mutable std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::function<void()>> finished_;  // destroyed by wait() / the destructor
  std::vector<std::thread> threads_;
  std::size_t running_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace mapp
