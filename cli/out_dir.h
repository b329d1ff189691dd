// The output directory of `mala run` (docs/cli.md, "Output directory"): every output is staged
// in a private directory (mkdtemp, mode 0700, files created with O_EXCL | O_NOFOLLOW), and the
// whole set is published at once when every file is written.
//   --out DIR does not exist: the staging directory, DIR's sibling ".NAME.mala-staging-XXXXXX",
//     is renamed to DIR (one rename: DIR appears with every file, or not at all).
//   --out DIR exists: the staging directory is DIR/.mala-staging-XXXXXX; its files are renamed into
//     DIR under an exclusive flock() on DIR, so that runs into one DIR publish one after the other
//     and DIR holds one run's complete set.
// SIGINT, SIGTERM and SIGHUP while the writer is open remove what the run created (the staging
// directory, its files, and the missing parents of DIR it made), then end the process by the same
// signal.  During the publishing renames these signals are held back, and act after them.  A
// SIGKILL leaves the staging directory (and parents created for DIR) behind: nothing else.
#pragma once

#include <string>
#include <vector>

#include "mala/mala.h"
#include "npy.h"

namespace mala {
namespace cli {

class OutputWriter {
 public:
  explicit OutputWriter(std::string dir);
  ~OutputWriter();  // not committed: removes everything the run created
  OutputWriter(const OutputWriter&) = delete;
  OutputWriter& operator=(const OutputWriter&) = delete;

  // Creates DIR's missing parents and the staging directory; installs the signal handlers.
  Status begin();
  Status put(const std::string& name, npy::Type t, const std::vector<int64_t>& shape, const void* data);
  Status commit();  // publishes the staged set
  const std::vector<std::string>& names() const { return names_; }

 private:
  void abort();
  Status publish_into_existing();

  std::string dir_, staging_;
  bool began_ = false, dir_existed_ = false, committed_ = false;
  std::vector<std::string> created_;  // DIR's parents this run made, outermost first
  std::vector<std::string> names_;    // staged files
};

}  // namespace cli
}  // namespace mala
