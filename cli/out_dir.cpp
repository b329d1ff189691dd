// `mala run`'s output directory: staging, publishing, and clean-up on a signal (cli/out_dir.h).
#include "out_dir.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mala {
namespace cli {
namespace {

namespace fs = std::filesystem;

// What a signal handler removes, in reverse order of registration: the created parents of DIR
// (outermost first), the staging directory, then its files.  Fixed storage: the handler may only
// call async-signal-safe functions (unlink, rmdir, signal, raise), so nothing is allocated there.
constexpr int kMaxCleanup = 64;
char g_cleanup[kMaxCleanup][PATH_MAX];
volatile sig_atomic_t g_cleanup_count = 0;
constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};
struct sigaction g_previous[3];

void on_signal(int sig) {
  for (int i = g_cleanup_count - 1; i >= 0; --i)
    if (::unlink(g_cleanup[i]) != 0) ::rmdir(g_cleanup[i]);
  g_cleanup_count = 0;
  ::signal(sig, SIG_DFL);
  ::raise(sig);  // the exit status says which signal ended the run (128 + n in a shell)
}

bool register_cleanup(const std::string& path) {
  if (g_cleanup_count >= kMaxCleanup || path.size() >= PATH_MAX) return false;
  std::memcpy(g_cleanup[g_cleanup_count], path.c_str(), path.size() + 1);
  g_cleanup_count = g_cleanup_count + 1;  // after the copy: the handler never sees half a path
  return true;
}

void install_handlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int s : kSignals) sigaddset(&sa.sa_mask, s);  // one clean-up at a time
  for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &sa, &g_previous[i]);
}

void restore_handlers() {
  g_cleanup_count = 0;
  for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &g_previous[i], nullptr);
}

// Holds SIGINT/SIGTERM/SIGHUP back for its lifetime (the publishing renames run to the end).
class BlockSignals {
 public:
  BlockSignals() {
    sigset_t set;
    sigemptyset(&set);
    for (int s : kSignals) sigaddset(&set, s);
    ::sigprocmask(SIG_BLOCK, &set, &old_);
  }
  ~BlockSignals() { ::sigprocmask(SIG_SETMASK, &old_, nullptr); }

 private:
  sigset_t old_;
};

// Test hooks (tests/cli_test.sh): raise a signal after the first staged file, or pause between
// the publishing renames, so that the tests can interrupt or overlap runs deterministically.
void test_hook_after_put() {
  const char* sig = std::getenv("MALA_TEST_SIGNAL_AFTER_FIRST_OUTPUT");
  if (!sig) return;
  if (std::strcmp(sig, "INT") == 0) ::raise(SIGINT);
  if (std::strcmp(sig, "TERM") == 0) ::raise(SIGTERM);
}
void test_hook_between_renames() {
  if (const char* ms = std::getenv("MALA_TEST_PUBLISH_DELAY_MS")) ::usleep(static_cast<useconds_t>(std::atoi(ms)) * 1000);
}

mode_t current_umask() {
  const mode_t m = ::umask(0);
  ::umask(m);
  return m;
}

}  // namespace

OutputWriter::OutputWriter(std::string dir, std::vector<std::string> every_output)
    : dir_(std::move(dir)), every_output_(std::move(every_output)) {}

OutputWriter::~OutputWriter() {
  if (!committed_) abort();
}

Status OutputWriter::begin() {
  began_ = true;
  std::error_code ec;
  dir_existed_ = fs::is_directory(dir_, ec);
  install_handlers();
  const fs::path dir = fs::path(dir_).lexically_normal();
  fs::path parent = dir.has_filename() ? dir.parent_path() : dir.parent_path().parent_path();
  if (parent.empty()) parent = ".";
  if (!dir_existed_) {
    std::vector<fs::path> missing;  // innermost first
    for (fs::path p = parent; !p.empty(); p = p.parent_path()) {
      if (fs::exists(p, ec)) break;
      missing.push_back(p);
      if (p.parent_path() == p) break;
    }
    for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
      if (!register_cleanup(it->string())) return Status::error("--out: path too long: " + it->string());
      if (::mkdir(it->c_str(), 0777) != 0)
        return Status::error("--out: cannot create " + it->string() + " (" + std::strerror(errno) + ")");
      created_.push_back(it->string());
    }
  }
  const std::string name = dir.has_filename() ? dir.filename().string() : dir.parent_path().filename().string();
  std::string tmpl = dir_existed_ ? (fs::path(dir_) / ".mala-staging-XXXXXX").string()
                                  : (parent / ("." + name + ".mala-staging-XXXXXX")).string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  {
    BlockSignals hold;  // the name exists from mkdtemp on: register it before a handler can run
    if (!::mkdtemp(buf.data()))
      return Status::error("--out: cannot create a staging directory " + tmpl + " (" + std::strerror(errno) + ")");
    staging_ = buf.data();
    if (!register_cleanup(staging_)) {
      ::rmdir(staging_.c_str());
      staging_.clear();
      return Status::error("--out: path too long: " + tmpl);
    }
  }
  return Status::success();
}

Status OutputWriter::put(const std::string& name, npy::Type t, const std::vector<int64_t>& shape,
                         const void* data) {
  const std::string path = (fs::path(staging_) / name).string();
  if (!register_cleanup(path)) return Status::error("--out: path too long: " + path);
  Status s = npy::write(path, t, shape, data, /*create_new=*/true);
  if (!s) {
    ::unlink(path.c_str());  // a part written before the failure
    return Status::error("--out: " + s.message);
  }
  names_.push_back(name);
  if (names_.size() == 1) test_hook_after_put();
  return s;
}

Status OutputWriter::publish_into_existing() {
  const int fd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::error("--out: cannot open " + dir_ + " (" + std::strerror(errno) + ")");
  ::flock(fd, LOCK_EX);  // released by close; runs into one DIR publish one after the other
  Status s = Status::success();
  for (size_t i = 0; i < names_.size(); ++i) {
    const std::string from = (fs::path(staging_) / names_[i]).string();
    const std::string to = (fs::path(dir_) / names_[i]).string();
    if (::rename(from.c_str(), to.c_str()) != 0) {
      s = Status::error("--out: cannot rename " + from + " to " + to + " (" + std::strerror(errno) + ")");
      break;
    }
    if (i + 1 < names_.size()) test_hook_between_renames();
  }
  // An earlier run's outputs that this run does not write (its backward's, after a forward-only
  // run): left in place they would read as this run's.  Only regular files and symlinks of those
  // names go; a directory of such a name is not an output (run.cpp refuses it for names it writes).
  for (size_t i = 0; s && i < every_output_.size(); ++i) {
    const std::string& name = every_output_[i];
    if (std::find(names_.begin(), names_.end(), name) != names_.end()) continue;
    const std::string path = (fs::path(dir_) / name).string();
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || S_ISDIR(st.st_mode)) continue;
    if (::unlink(path.c_str()) != 0) {
      s = Status::error("--out: cannot remove " + path + ", an earlier run's output (" + std::strerror(errno) + ")");
      break;
    }
    removed_.push_back(name);
  }
  ::close(fd);
  return s;
}

Status OutputWriter::commit() {
  // The staging directory was made 0700 by mkdtemp; published as DIR it gets a new directory's mode.
  ::chmod(staging_.c_str(), 0777 & ~current_umask());
  Status s = Status::success();
  {
    BlockSignals hold;
    bool merged = dir_existed_;
    if (!dir_existed_ && ::rename(staging_.c_str(), dir_.c_str()) != 0) {
      // Another run made DIR since begin(): publish into it as into any existing DIR.
      if (errno != EEXIST && errno != ENOTEMPTY)
        return Status::error("--out: cannot rename " + staging_ + " to " + dir_ + " (" + std::strerror(errno) + ")");
      merged = true;
    }
    if (merged) {
      s = publish_into_existing();
      if (!s) return s;  // the destructor removes what is still staged
      ::rmdir(staging_.c_str());
    }
    committed_ = true;
    restore_handlers();  // a signal held back now acts by its previous disposition, after the publish
  }
  return s;
}

void OutputWriter::abort() {
  if (!began_) return;
  {
    BlockSignals hold;
    for (const std::string& name : names_) ::unlink((fs::path(staging_) / name).c_str());
    if (!staging_.empty()) ::rmdir(staging_.c_str());
    for (auto it = created_.rbegin(); it != created_.rend(); ++it) ::rmdir(it->c_str());  // only if empty
    restore_handlers();
  }
  names_.clear();
  created_.clear();
}

}  // namespace cli
}  // namespace mala
