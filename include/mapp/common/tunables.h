// Every MAPP_* environment variable the library reads, declared once in
// src/common/tunables.cc with its default and meaning (as NCCL_PARAM and
// mimalloc's options table do). Read them through these functions only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mapp {

struct Tunable {
  const char* name;           // environment variable, e.g. "MAPP_LOG_LEVEL"
  const char* default_value;  // used when the variable is unset or empty
  const char* meaning;        // one line for docs and the startup dump
};

// The whole table, in declaration order.
const std::vector<Tunable>& tunables();

// Value of a declared tunable: the environment if set and non-empty, else its
// default. Throws ValueError for names not in the table (typos fail loudly).
std::string tunable_string(const std::string& name);
// Same, parsed as an integer; throws ValueError naming the variable if the
// environment holds something that is not an integer.
std::int64_t tunable_int(const std::string& name);

// "NAME=value (default D): meaning" per line, for a startup dump.
std::string describe_tunables();

}  // namespace mapp
