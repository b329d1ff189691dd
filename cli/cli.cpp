#include "cli.h"

#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdlib>
#include <limits>
#include <algorithm>

namespace mala {
namespace cli {

Flags::Flags(int argc, char** argv, const std::set<std::string>& valued,
             const std::set<std::string>& switches) {
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" && switches.count("help")) arg = "--help";
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0)
      throw UsageError("unexpected argument '" + arg + "' (flags look like --name value)");
    std::string name = arg.substr(2), value;
    bool inline_value = false;
    size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    if ((switches.count(name) || valued.count(name)) && (switches_.count(name) || values_.count(name)))
      throw UsageError("--" + name + ": given more than once");
    if (switches.count(name)) {
      if (inline_value) throw UsageError("--" + name + ": takes no value");
      switches_.insert(name);
    } else if (valued.count(name)) {
      if (!inline_value) {
        if (i + 1 >= argc) throw UsageError("--" + name + ": missing value");
        value = argv[++i];
      }
      values_[name] = value;
    } else {
      throw UsageError("unknown flag --" + name + " (see --help)");
    }
  }
}

std::string Flags::get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

int64_t Flags::get_int(const std::string& name, int64_t fallback, int64_t min_value,
                       int64_t max_value) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  const std::string& s = it->second;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || errno == ERANGE)
    throw UsageError("--" + name + ": expected an integer (got '" + s + "')");
  if (v < min_value)
    throw UsageError("--" + name + ": must be >= " + std::to_string(min_value) + " (got " + s + ")");
  if (v > max_value)
    throw UsageError("--" + name + ": must be <= " + std::to_string(max_value) + " (got " + s + ")");
  return v;
}

uint64_t Flags::get_u64(const std::string& name, uint64_t fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  const std::string& s = it->second;
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (s.empty() || s[0] == '-' || *end != '\0' || errno == ERANGE)
    throw UsageError("--" + name + ": expected a non-negative integer (got '" + s + "')");
  return v;
}

double Flags::get_double(const std::string& name, double fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  const std::string& s = it->second;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || !std::isfinite(v))
    throw UsageError("--" + name + ": expected a finite number (got '" + s + "')");
  return v;
}

std::string name_flag(const std::string& message, const std::map<std::string, std::string>& flags) {
  const size_t colon = message.find(':');
  if (colon == std::string::npos) return message;
  auto it = flags.find(message.substr(0, colon));
  if (it == flags.end()) return message;
  // "tau: must be ..." becomes "--tau: must be ...", not "--tau: tau must be ...".
  if (it->second == "--" + it->first) return it->second + message.substr(colon);
  return it->second + ": " + it->first + message.substr(colon + 1);
}

double Flags::get_tau(double fallback) const {
  const double tau = get_double("tau", fallback);
  // The library takes tau as a float: anything that does not fit is out of range, as is < 0.
  if (!(tau >= 0) || tau > std::numeric_limits<float>::max())
    throw UsageError(format("--tau: must be finite and >= 0 (got %g)", tau));
  return tau;
}

int64_t first_nonfinite(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return i;
  return -1;
}

int64_t count_nonfinite(const float* x, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += !std::isfinite(x[i]);
  return c;
}

std::string index_string(int64_t flat, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    const int64_t s = std::max<int64_t>(shape[d], 1);
    idx[d] = flat % s;
    flat /= s;
  }
  std::string out = "[";
  for (size_t d = 0; d < idx.size(); ++d) out += (d ? "," : "") + std::to_string(idx[d]);
  return out + "]";
}

std::string json_escape(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20)
          out += format("\\u%04x", c);
        else
          out += c;
    }
  }
  return out + "\"";
}

Json& Json::num(const std::string& key, double v) {
  // JSON has no inf/nan: write null.
  items_.emplace_back(key, std::isfinite(v) ? format("%.9g", v) : "null");
  return *this;
}
Json& Json::integer(const std::string& key, int64_t v) {
  items_.emplace_back(key, std::to_string(v));
  return *this;
}
Json& Json::str(const std::string& key, const std::string& v) {
  items_.emplace_back(key, json_escape(v));
  return *this;
}
Json& Json::boolean(const std::string& key, bool v) {
  items_.emplace_back(key, v ? "true" : "false");
  return *this;
}
Json& Json::object(const std::string& key, const Json& v) {
  items_.emplace_back(key, v.dump());
  return *this;
}
Json& Json::raw(const std::string& key, const std::string& json) {
  items_.emplace_back(key, json);
  return *this;
}
std::string Json::dump() const {
  std::string out = "{";
  for (size_t i = 0; i < items_.size(); ++i) {
    if (i) out += ", ";
    out += json_escape(items_[i].first) + ": " + items_[i].second;
  }
  return out + "}";
}

std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

namespace {
bool g_quiet = false;
}
void set_quiet(bool quiet) { g_quiet = quiet; }
void progress(const std::string& line) {
  if (g_quiet) return;
  std::fprintf(stderr, "mala: %s\n", line.c_str());
  std::fflush(stderr);
}

void progress_begin(const std::string& label) {
  if (g_quiet) return;
  std::fprintf(stderr, "mala: %s ...", label.c_str());
  std::fflush(stderr);
}
void progress_end(double seconds) {
  if (g_quiet) return;
  std::fprintf(stderr, " %.2f s\n", seconds);
  std::fflush(stderr);
}

}  // namespace cli
}  // namespace mala
