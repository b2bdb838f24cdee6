// libFuzzer target: allocation-trace decoding rejects malformed bytes with a
// ValueError, never crashes; a decoded trace re-encodes to the same events.
#include <cstddef>
#include <cstdint>
#include <string>

#include "mapp/common/check.h"
#include "mapp/memory/trace.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    const auto t = mapp::AllocTrace::decode(bytes);
    const auto again = mapp::AllocTrace::decode(t.encode());
    if (again.events.size() != t.events.size()) __builtin_trap();
  } catch (const mapp::ValueError&) {
  }
  return 0;
}
