// `mala`: the command line tool (docs/cli.md).
#include <cstdio>
#include <cstring>
#include <exception>

#include "cli.h"
#include "mala/mala.h"

namespace {

const char* kHelp =
    "usage: mala <command> [flags]\n"
    "\n"
    "MALA (MassAlloc Attention): causal softmax attention that computes every QK tile but\n"
    "skips the post-score work of tiles whose largest probability is below tau / L_q.\n"
    "\n"
    "commands:\n"
    "  report   forward + backward on a built-in workload; prints realized work, omitted\n"
    "           mass, errors against dense attention and time against tau = 0\n"
    "  run      forward (+ backward) on .npy inputs; writes .npy outputs\n"
    "  help     this text (also --help, -h); `mala <command> --help` for a command's flags\n"
    "  version  the version (also --version)\n"
    "\n"
    "Exit status: 0 ok, 1 failure (bad input file, failed run), 2 usage error (also NaN/Inf\n"
    "in the inputs), 3 the run finished but an output holds NaN/Inf.\n";

}  // namespace

int main(int argc, char** argv) {
  using namespace mala::cli;
  if (argc < 2) {
    std::fputs(kHelp, stderr);
    return kExitUsage;
  }
  const std::string cmd = argv[1];
  try {
    if (cmd == "--help" || cmd == "-h" || cmd == "help") {
      std::fputs(kHelp, stdout);
      return 0;
    }
    if (cmd == "--version" || cmd == "version") {
      std::printf("mala %s\n", MALA_VERSION);
      return 0;
    }
    if (cmd == "report") return report_main(argc - 2, argv + 2);
    if (cmd == "run") return run_main(argc - 2, argv + 2);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "mala %s: out of memory\n", cmd.c_str());
    return kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mala %s: %s\n", cmd.c_str(), e.what());
    return kExitFailure;
  }
  std::fprintf(stderr, "mala: unknown command '%s' (commands: report, run; see mala --help)\n",
               cmd.c_str());
  return kExitUsage;
}
