#include "mapp/common/tunables.h"

#include <cstdlib>
#include <sstream>

#include "mapp/common/check.h"

namespace mapp {

// The table. Add a row here (and nowhere else) to introduce a variable.
const std::vector<Tunable>& tunables() {
  static const std::vector<Tunable> table = {
      {"MAPP_LOG_LEVEL", "info", "threshold of library log lines: debug, info, warn, error, off"},
      {"MAPP_COLLECTIVE_TIMEOUT_S", "300",
       "seconds a blocking collective of ours may wait before it fails with an "
       "error naming the operation and group"},
      {"MAPP_SHM_COLLECTIVES", "1",
       "1: our CPU collectives on a group whose ranks share a node (tensor, data, model, "
       "embedding groups) move through shared memory "
       "(megatronapp.parallel_state.enable_shared_memory); 0: through the group's backend "
       "(Gloo)"},
      {"MAPP_SHM_SLOT_BYTES", "2097152",
       "bytes each rank owns per area of a shared-memory group (two areas); larger tensors "
       "move in pieces of this size"},
      {"MAPP_SHM_P2P", "0",
       "1: the pipeline's send/recv between stages on one node moves through shared memory "
       "(with MAPP_SHM_COLLECTIVES=1); 0 (default): through the pipeline group's backend "
       "(Gloo); opt-in because it measured no gain and it moves a message only while the "
       "receiver is inside a p2p call"},
      {"MAPP_SHM_P2P_SLOT_BYTES", "524288",
       "bytes per slot of the shared-memory pipeline send/recv rings (one ring per ordered "
       "pair of pipeline ranks on a node); larger messages move in pieces of this size"},
      {"MAPP_SHM_P2P_SLOTS", "4",
       "slots per ring of the shared-memory pipeline send/recv transport; the pipeline "
       "sends a message through shared memory only when slots x slot bytes hold it whole"},
      // Fault injection (python/megatronapp/resilience/faults.py parses the values).
      {"MAPP_INJECT_SLOWDOWN", "",
       "fault injection: 'rank=R[+R...],factor=F[,phase=forward|backward|all][,start=K]' makes rank "
       "R's (each named rank's) transformer layers F times slower (from iteration K on)"},
      {"MAPP_INJECT_KILL", "",
       "fault injection: 'rank=R,iteration=I' SIGKILLs rank R at the start of iteration I"},
      {"MAPP_INJECT_LINK_DELAY", "",
       "fault injection: 'rank=R,peer=P,ms=M' delays every pipeline message R->P by M ms"},
      {"MAPP_INJECT_EXPERT_SKEW", "",
       "fault injection: 'expert=E,boost=B' adds B to every MoE router's logit of expert E "
       "(overloads the rank holding it)"},
  };
  return table;
}

namespace {

const Tunable& find(const std::string& name) {
  for (const auto& t : tunables()) {
    if (name == t.name) return t;
  }
  MAPP_CHECK(false, "unknown tunable '", name,
             "'; every MAPP_* variable must be declared in src/common/tunables.cc");
}

}  // namespace

std::string tunable_string(const std::string& name) {
  const Tunable& t = find(name);
  const char* env = std::getenv(t.name);
  return (env != nullptr && *env != '\0') ? std::string(env) : std::string(t.default_value);
}

std::int64_t tunable_int(const std::string& name) {
  const std::string value = tunable_string(name);
  char* end = nullptr;
  const long long parsed = std::strtoll(value.c_str(), &end, 10);
  MAPP_CHECK(end != value.c_str() && *end == '\0', name, "='", value,
             "' is not an integer; unset it or give a whole number");
  return parsed;
}

std::string describe_tunables() {
  std::ostringstream os;
  for (const auto& t : tunables()) {
    os << t.name << "=" << tunable_string(t.name) << " (default " << t.default_value
       << "): " << t.meaning << "\n";
  }
  return os.str();
}

}  // namespace mapp
