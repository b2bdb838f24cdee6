// libFuzzer target: the schedule importers must reject any input with a
// mapp::ValueError (or accept it as a valid schedule), never crash.
#include <cstddef>
#include <cstdint>
#include <string>

#include "mapp/common/check.h"
#include "mapp/pipeline/schedule.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (int fmt = 0; fmt < 2; ++fmt) {
    try {
      const auto s = fmt ? mapp::pipeline::from_json(text) : mapp::pipeline::from_csv(text);
      if (!mapp::pipeline::validate(s).empty()) __builtin_trap();  // imports are validated
      (void)mapp::pipeline::simulate(s, mapp::pipeline::Costs::uniform(s.stages));
    } catch (const mapp::ValueError&) {
    }
  }
  return 0;
}
