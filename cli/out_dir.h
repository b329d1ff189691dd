// The output directory of `mala run` (docs/cli.md, "Output directory"): every output is staged
// in a private directory (mkdtemp, mode 0700, files created with O_EXCL | O_NOFOLLOW), and the
// whole set is published at once when every file is written.
//   --out DIR does not exist: the staging directory, DIR's sibling ".NAME.mala-staging-XXXXXX",
//     is renamed to DIR (one rename: DIR appears with every file, or not at all).
//   --out DIR exists: the staging directory is DIR/.mala-staging-XXXXXX; its files are renamed into
//     DIR under an exclusive flock() on DIR, so that runs into one DIR publish one after the other
//     and DIR holds one run's complete set.  Outputs of other runs that this run does not write
//     (the names in `every_output` it did not put, e.g. dq.npy after a forward-only run) are
//     removed from DIR in the same locked step, so no older run's file sits beside the new set.
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
  // every_output: each name any run may write into DIR (those this run does not put are removed).
  OutputWriter(std::string dir, std::vector<std::string> every_output);
  ~OutputWriter();  // not committed: removes everything the run created
  OutputWriter(const OutputWriter&) = delete;
  OutputWriter& operator=(const OutputWriter&) = delete;

  // Creates DIR's missing parents and the staging directory; installs the signal handlers.
  Status begin();
  Status put(const std::string& name, npy::Type t, const std::vector<int64_t>& shape, const void* data);
  Status commit();  // publishes the staged set
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<std::string>& removed() const { return removed_; }  // by commit(), from DIR

 private:
  void abort();
  Status publish_into_existing();

  std::string dir_, staging_;
  bool began_ = false, dir_existed_ = false, committed_ = false;
  std::vector<std::string> created_;  // DIR's parents this run made, outermost first
  std::vector<std::string> names_;    // staged files
  std::vector<std::string> every_output_, removed_;
};

}  // namespace cli
}  // namespace mala
