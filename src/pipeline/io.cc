// Schedule import/export: CSV and JSON. Parsers treat their input as hostile:
// every malformed field is a ValueError naming the line or element.
#include <charconv>
#include <nlohmann/json.hpp>
#include <sstream>

#include "mapp/common/check.h"
#include "mapp/pipeline/schedule.h"

namespace mapp::pipeline {

namespace {

constexpr int kMaxDim = 1 << 16;  // stages, microbatches, chunks

void check_dims(const Schedule& s, const char* fmt) {
  auto ok = [](int x) { return x >= 1 && x <= kMaxDim; };
  MAPP_CHECK(ok(s.stages) && ok(s.microbatches) && ok(s.chunks), fmt,
             " schedule: stages, microbatches and chunks must lie in [1, ", kMaxDim, "], got ",
             s.stages, ", ", s.microbatches, ", ", s.chunks);
}

int parse_int(const std::string& field, const char* what, int line) {
  int value = 0;
  const char* begin = field.data();
  const char* end = begin + field.size();
  auto [ptr, ec] = std::from_chars(begin, end, value);
  MAPP_CHECK(ec == std::errc() && ptr == end, "schedule CSV line ", line, ": ", what,
             " must be an integer, got '", field, "'");
  return value;
}

std::vector<std::string> split(const std::string& line, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : line) {
    if (ch == sep) {
      out.push_back(cur);
      cur.clear();
    } else if (ch != '\r' && ch != ' ') {
      cur.push_back(ch);
    }
  }
  out.push_back(cur);
  return out;
}

void finish_import(Schedule& s) {
  add_communication(s);
  check_valid(s);
}

}  // namespace

std::string to_csv(const Schedule& s) {
  std::ostringstream os;
  os << "# megatronapp schedule name=" << s.name << " stages=" << s.stages
     << " microbatches=" << s.microbatches << " chunks=" << s.chunks;
  if (s.placement != Placement::kLoop) os << " placement=" << placement_name(s.placement);
  os << "\n";
  os << "stage,type,microbatch,chunk,peer\n";
  for (int st = 0; st < s.stages; ++st) {
    for (const auto& a : s.actions[st]) {
      os << st << "," << type_name(a.type) << "," << a.microbatch << "," << a.chunk << "," << a.peer
         << "\n";
    }
  }
  return os.str();
}

Schedule from_csv(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  Schedule s;
  s.stages = s.microbatches = s.chunks = 0;
  int lineno = 0;
  bool header = false;
  while (std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::istringstream words(line.substr(1));
      std::string w;
      while (words >> w) {
        const auto eq = w.find('=');
        if (eq == std::string::npos) continue;
        const std::string key = w.substr(0, eq), val = w.substr(eq + 1);
        if (key == "name") s.name = val;
        if (key == "stages") s.stages = parse_int(val, "stages", lineno);
        if (key == "microbatches") s.microbatches = parse_int(val, "microbatches", lineno);
        if (key == "chunks") s.chunks = parse_int(val, "chunks", lineno);
        if (key == "placement") s.placement = parse_placement(val);
      }
      continue;
    }
    if (!header) {
      MAPP_CHECK(line.rfind("stage,type,microbatch,chunk", 0) == 0, "schedule CSV line ", lineno,
                 ": expected the header 'stage,type,microbatch,chunk,peer', got '", line, "'");
      header = true;
      check_dims(s, "CSV (the '# megatronapp schedule stages=.. microbatches=.. chunks=..' line)");
      s.actions.assign(s.stages, {});
      continue;
    }
    const auto f = split(line, ',');
    MAPP_CHECK(f.size() == 4 || f.size() == 5, "schedule CSV line ", lineno,
               ": expected 4 or 5 fields (stage,type,microbatch,chunk[,peer]), got ", f.size());
    const int st = parse_int(f[0], "stage", lineno);
    MAPP_CHECK(st >= 0 && st < s.stages, "schedule CSV line ", lineno, ": stage ", st,
               " out of range [0, ", s.stages, ")");
    Action a{parse_type(f[1]), parse_int(f[2], "microbatch", lineno),
             parse_int(f[3], "chunk", lineno),
             f.size() == 5 && !f[4].empty() ? parse_int(f[4], "peer", lineno) : -1};
    s.actions[st].push_back(a);
  }
  MAPP_CHECK(header, "schedule CSV: no header line 'stage,type,microbatch,chunk,peer' found");
  finish_import(s);
  return s;
}

std::string to_json(const Schedule& s) {
  nlohmann::json j;
  j["name"] = s.name;
  j["stages"] = s.stages;
  j["microbatches"] = s.microbatches;
  j["chunks"] = s.chunks;
  if (s.placement != Placement::kLoop) j["placement"] = placement_name(s.placement);
  auto& stages = j["actions"] = nlohmann::json::array();
  for (const auto& list : s.actions) {
    auto arr = nlohmann::json::array();
    for (const auto& a : list) {
      nlohmann::json e = {
          {"type", type_name(a.type)}, {"microbatch", a.microbatch}, {"chunk", a.chunk}};
      if (!a.is_compute()) e["peer"] = a.peer;
      arr.push_back(std::move(e));
    }
    stages.push_back(std::move(arr));
  }
  return j.dump(1);
}

Schedule from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    MAPP_CHECK(false, "schedule JSON does not parse: ", e.what());
  }
  auto get_int = [](const nlohmann::json& o, const char* key, const std::string& ctx,
                    std::optional<int> dflt = {}) {
    if (!o.contains(key)) {
      MAPP_CHECK(dflt.has_value(), "schedule JSON ", ctx, ": missing integer field '", key, "'");
      return *dflt;
    }
    const auto& v = o.at(key);
    MAPP_CHECK(v.is_number_integer(), "schedule JSON ", ctx, ": field '", key,
               "' must be an integer, got ", v.dump());
    const auto x = v.get<long long>();
    MAPP_CHECK(x >= -1 && x <= (1LL << 30), "schedule JSON ", ctx, ": field '", key,
               "' out of range: ", x);
    return static_cast<int>(x);
  };
  MAPP_CHECK(j.is_object(), "schedule JSON: the top level must be an object");
  Schedule s;
  s.name = j.contains("name") && j["name"].is_string() ? j["name"].get<std::string>() : "custom";
  s.stages = get_int(j, "stages", "(top level)");
  s.microbatches = get_int(j, "microbatches", "(top level)");
  s.chunks = get_int(j, "chunks", "(top level)", 1);
  if (j.contains("placement")) {
    MAPP_CHECK(j["placement"].is_string(), "schedule JSON: 'placement' must be \"loop\" or \"wave\"");
    s.placement = parse_placement(j["placement"].get<std::string>());
  }
  check_dims(s, "JSON");
  MAPP_CHECK(j.contains("actions") && j["actions"].is_array() &&
                 static_cast<int>(j["actions"].size()) == s.stages,
             "schedule JSON: 'actions' must be an array with one list per stage (", s.stages, ")");
  s.actions.assign(s.stages, {});
  for (int st = 0; st < s.stages; ++st) {
    const auto& list = j["actions"][st];
    MAPP_CHECK(list.is_array(), "schedule JSON: actions[", st, "] must be an array");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const auto& e = list[i];
      const std::string ctx = "actions[" + std::to_string(st) + "][" + std::to_string(i) + "]";
      MAPP_CHECK(e.is_object() && e.contains("type") && e["type"].is_string(), "schedule JSON ",
                 ctx, ": expected an object with a string 'type'");
      s.actions[st].push_back({parse_type(e["type"].get<std::string>()),
                               get_int(e, "microbatch", ctx), get_int(e, "chunk", ctx, 0),
                               get_int(e, "peer", ctx, -1)});
    }
  }
  finish_import(s);
  return s;
}

}  // namespace mapp::pipeline
