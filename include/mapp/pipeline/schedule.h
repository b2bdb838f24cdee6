// Pipeline schedules as data.
//
// A schedule is, for every pipeline stage, the ordered list of actions that
// stage runs in one training step. Compute actions name a (microbatch, chunk).
// With v model chunks per stage the placement says which virtual stage a chunk
// is: in the loop placement (Megatron's interleaved layout) chunk c of stage s
// is virtual stage c*p + s, so activations flow s -> s+1 inside a chunk and
// from stage p-1 chunk c to stage 0 chunk c+1; in the wave placement (the V of
// ZB-V) odd chunks run backwards, chunk c of stage s being c*p + p-1-s, so a
// turn from one chunk to the next stays on its stage (a local hand-off, no
// transfer) and the first and last virtual stage share stage 0. Communication actions post a
// non-blocking send or receive; a compute action waits only for the receive of
// its own input, which must have been posted earlier on the same stage.
//
// Executor semantics (what the validator proves deadlock-free and what the
// Python executor implements): each stage runs its list in order; sends and
// receives never block; a compute action blocks until its input has arrived,
// i.e. until the peer has executed the matching send. Messages are matched by
// (kind, microbatch, virtual stage), never by order.
//
// Generators return compute-only lists and then add_communication() inserts the
// transfers: a send right after the producing action, the receive one compute
// action before its consumer (so a transfer overlaps that compute).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mapp::pipeline {

enum class ActionType : std::uint8_t {
  kForward,         // F: forward of (microbatch, chunk)
  kBackward,        // B: full backward (input and weight gradients)
  kBackwardInput,   // BI: input gradient only (weight gradient deferred)
  kBackwardWeight,  // W: the deferred weight gradient
  kSendActivation,  // SEND_ACT: forward output to the next virtual stage
  kRecvActivation,  // RECV_ACT: forward input from the previous virtual stage
  kSendGrad,        // SEND_GRAD: input gradient to the previous virtual stage
  kRecvGrad,        // RECV_GRAD: output gradient from the next virtual stage
};

struct Action {
  ActionType type;
  int microbatch = 0;
  int chunk = 0;  // model chunk on this stage (0..chunks-1)
  int peer = -1;  // send/recv: the other stage; -1 for compute

  bool is_compute() const { return type <= ActionType::kBackwardWeight; }
  bool operator==(const Action& o) const {
    return type == o.type && microbatch == o.microbatch && chunk == o.chunk && peer == o.peer;
  }
};

const char* type_name(ActionType t);             // "F", "B", "BI", "W", "SEND_ACT", ...
ActionType parse_type(const std::string& name);  // inverse; ValueError if unknown
std::string to_string(const Action& a);  // "F(mb=3, chunk=0)", "SEND_ACT(mb=3, chunk=0, peer=1)"

enum class Placement : std::uint8_t {
  kLoop,  // chunk c of stage s is virtual stage c*p + s (interleaved 1F1B)
  kWave,  // even chunks c*p + s, odd chunks c*p + p-1-s (ZB-V's V shape)
};
const char* placement_name(Placement p);             // "loop", "wave"
Placement parse_placement(const std::string& name);  // inverse; ValueError if unknown

struct Schedule {
  std::string name;
  int stages = 0;
  int microbatches = 0;
  int chunks = 1;
  std::vector<std::vector<Action>> actions;  // [stage] -> ordered actions
  Placement placement = Placement::kLoop;

  int virtual_stages() const { return stages * chunks; }
  // The virtual stage of `chunk` on `stage`, and back.
  int vstage(int stage, int chunk) const;
  int stage_of(int vstage) const;
  int chunk_of(int vstage) const { return vstage / stages; }
  bool has_communication() const;
  // Peak number of (microbatch, chunk) activations held on `stage`: from the
  // start of F until the end of B, or of W when the backward is split.
  int peak_activations(int stage) const;
  std::size_t num_actions() const;
};

// ---- generators (compute-only lists + add_communication) --------------------
Schedule gpipe(int p, int m);
Schedule one_f_one_b(int p, int m);
Schedule interleaved(int p, int m, int v);  // needs m % p == 0 (Megatron's order)
Schedule zero_bubble(int p, int m);         // ZB-H1: 1F1B memory, W fills bubbles

// Per-stage costs and links of the time model (simulator and planner).
// forward/backward_input/backward_weight: seconds of one action of one chunk on
// each stage (size p). A full backward costs backward_input + backward_weight.
// p2p: seconds of one transfer over link s (stage s <-> stage (s+1) % p, both
// directions; size p). Each direction of a link carries one message at a time.
// A hand-off between two chunks of one stage (wave placement) is free.
struct Costs {
  std::vector<double> forward, backward_input, backward_weight, p2p;
  static Costs uniform(int p, double f = 1, double bi = 1, double bw = 1, double p2p = 0);
  void check(int p) const;  // ValueError when sizes or values are wrong
};

// ZB-V (Qi et al. 2024): two chunks per stage in the wave placement, backward
// split into BI and W, planned depth-first within 1F1B's activation memory
// (2p chunk activations = p microbatches of a whole stage) under `costs`
// (uniform by default), keeping the weight-gradient reserve that gives the
// shortest predicted step.
Schedule zb_v(int p, int m, const std::optional<Costs>& costs = {});

// The dynamic planner: an event-driven list scheduler that, whenever a stage is
// free, picks the next ready action by policy, with the backward split so that
// weight gradients fill what would be idle time.
//   dfc  depth-first: backward first, then forwards of the deepest chunk; at most
//        as many live activations per stage as (interleaved) 1F1B.
//   bfc  breadth-first: every microbatch through a chunk before the next chunk;
//        no memory cap.
//   auto breadth-first as far as `memory_limit` (activations per stage, in
//        units of one microbatch through one chunk) allows; by default the
//        largest per-stage peak of (interleaved) 1F1B.
//   adaptive plans dfc, auto, 1F1B/interleaved and ZB-H1 under `costs` (e.g.
//        measured) and keeps the shortest predicted makespan within the
//        memory limit, so it is never predicted slower than 1F1B.
enum class Policy { kDepthFirst, kBreadthFirst, kAuto, kAdaptive };
Policy parse_policy(const std::string& name);  // "dfc", "bfc", "auto", "adaptive"
const char* policy_name(Policy p);
Schedule dynamic(int p, int m, int v, Policy policy, std::optional<int> memory_limit = {},
                 const std::optional<Costs>& costs = {});

// A schedule by its --pipeline-schedule name (megatronapp's Schedule.by_name
// and mapp::make_schedule): gpipe, 1f1b (v > 1: interleaved), interleaved,
// zero-bubble, zb-v (v = 2), dynamic (`policy`, `memory_limit`, `costs`).
// ValueError for an unknown name or a chunk count the schedule cannot run.
Schedule by_name(const std::string& name, int p, int m, int v = 1,
                 const std::string& policy = "auto", std::optional<int> memory_limit = {},
                 const std::optional<Costs>& costs = {});
// The names by_name knows, comma-separated.
const char* schedule_names();

// Inserts sends and receives into a compute-only schedule (no-op for p == 1).
void add_communication(Schedule& s);

// ---- validation ----------------------------------------------------------------
// Checks completeness (every (microbatch, chunk) forwarded and backwarded once
// on every stage, with either B or BI+W), per-stage order (F before B/BI, BI
// before W), that every transfer has exactly one matching peer action and every
// input is received before it is used, and that the stages cannot deadlock under
// the executor semantics. Returns an empty string when valid, else the first
// violation, naming the stage, position and action.
std::string validate(const Schedule& s);
void check_valid(const Schedule& s);  // throws ValueError with validate()'s message

// ---- simulation -------------------------------------------------------------------
struct TimedAction {
  int stage;
  Action action;
  double start, end;  // compute: on the stage; transfers: on the link
};

struct SimResult {
  double makespan = 0;
  double bubble_fraction = 0;  // 1 - busy / (stages * makespan)
  std::vector<double> busy;    // per stage
  std::vector<int> peak_activations;
  std::vector<TimedAction> timeline;  // compute actions and transfers
};

SimResult simulate(const Schedule& s, const Costs& costs);

// Chrome Trace Event JSON of a simulation (one process per stage, a thread for
// compute and one per link direction); opens in Perfetto / chrome://tracing.
std::string chrome_trace(const Schedule& s, const SimResult& r);

// ---- import / export ---------------------------------------------------------------
// CSV: "# megatronapp schedule name=<n> stages=<p> microbatches=<m> chunks=<v>"
// then the header "stage,type,microbatch,chunk,peer" and one row per action in
// order. JSON: {"name", "stages", "microbatches", "chunks", "actions": [[{"type",
// "microbatch", "chunk", "peer"?}, ...] per stage]}. A compute-only import gets
// its communication inserted. Parsers reject malformed input with ValueError.
std::string to_csv(const Schedule& s);
Schedule from_csv(const std::string& text);
std::string to_json(const Schedule& s);
Schedule from_json(const std::string& text);

}  // namespace mapp::pipeline
