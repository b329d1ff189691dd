// Shared pieces of the `mala` command line tool: flag parsing, exit codes, JSON and table output.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace mala {
namespace cli {

// Exit codes: 0 success, 1 the work failed (unreadable input, library error), 2 bad usage
// (including non-finite input values without --allow-nonfinite), 3 the run finished but an output
// holds NaN or Inf (a warning on stderr names it).
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNonfiniteOutput = 3;

// The version, from CMake's project(VERSION) (cli/CMakeLists.txt passes it in).
#ifndef MALA_VERSION
#define MALA_VERSION "unknown"
#endif

// A usage error (unknown flag, bad flag value): the message names the flag.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Parsed `--name value`, `--name=value` and bare `--switch` flags.
class Flags {
 public:
  // valued: flags that take a value; switches: flags that do not.  Anything else is a usage error.
  Flags(int argc, char** argv, const std::set<std::string>& valued,
        const std::set<std::string>& switches);

  bool has(const std::string& name) const { return values_.count(name) > 0; }
  bool is_set(const std::string& name) const { return switches_.count(name) > 0; }
  std::string get(const std::string& name, const std::string& fallback) const;
  int64_t get_int(const std::string& name, int64_t fallback, int64_t min_value,
                  int64_t max_value = INT64_MAX) const;
  double get_double(const std::string& name, double fallback) const;
  uint64_t get_u64(const std::string& name, uint64_t fallback) const;
  // --tau: finite, >= 0 and representable as a float, else a usage error
  // "--tau: must be finite and >= 0 (got 1e+39)".
  double get_tau(double fallback) const;

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_;
};

// Minimal JSON object writer (keys in insertion order).
class Json {
 public:
  Json& num(const std::string& key, double v);
  Json& integer(const std::string& key, int64_t v);
  Json& str(const std::string& key, const std::string& v);
  Json& boolean(const std::string& key, bool v);
  Json& object(const std::string& key, const Json& v);
  Json& raw(const std::string& key, const std::string& json);  // json: already valid JSON text
  std::string dump() const;

 private:
  std::vector<std::pair<std::string, std::string>> items_;
};

// Rewrites a library message "head_dim: must be ..." as "--d: head_dim must be ..." when the
// argument comes from a flag (flags maps library argument names to flag names).
std::string name_flag(const std::string& message, const std::map<std::string, std::string>& flags);

// Index of the first NaN/Inf in x[0, n), or -1.  count_nonfinite: how many.
int64_t first_nonfinite(const float* x, int64_t n);
int64_t count_nonfinite(const float* x, int64_t n);
// A flat C-order index as "[i,j,k]" for the given shape.
std::string index_string(int64_t flat, const std::vector<int64_t>& shape);

std::string json_escape(const std::string& s);
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Progress lines on stderr ("mala: ..."), silenced by --quiet.
void set_quiet(bool quiet);
void progress(const std::string& line);
// A step that takes a while: "mala: LABEL ..." now, " 1.23 s" appended by progress_end().
void progress_begin(const std::string& label);
void progress_end(double seconds);

int report_main(int argc, char** argv);
int run_main(int argc, char** argv);

}  // namespace cli
}  // namespace mala
