// mala_bench: parses the shared flags (bench.h, parse_options) and runs the requested ops.
//   mala_bench --op fwd --n 1K,32K,128K --tau 0,1 --regime random,synthetic --sharpness 1,4,16
//   mala_bench --op all
#include <cstdio>
#include <string>

#include "bench.h"

// Fallbacks while an op's bench file is missing: the real definitions (strong symbols) win.
__attribute__((weak)) int run_backward_bench(int, char**) {
  std::printf("backward bench: not built (bench/bench_backward.cu missing)\n");
  return 0;
}
__attribute__((weak)) int run_decode_bench(int, char**) {
  std::printf("decode bench: not built (bench/bench_decode.cu missing)\n");
  return 0;
}

int main(int argc, char** argv) {
  const mala_bench::Options opt = mala_bench::parse_options(argc, argv);
  if (!mala::cuda_available()) {
    std::printf("mala_bench: no CUDA device\n");
    return 0;
  }
  std::printf("mala_bench on %s\n", mala::device_name().c_str());
  mala::cuda_backend::set_kernel_override(opt.kernels);
  {
    namespace cb = mala::cuda_backend;
    const cb::KernelOverride& k = opt.kernels;
    if (k.fwd != cb::FwdVariant::automatic || k.bwd != cb::BwdVariant::automatic ||
        k.decode != cb::DecodeVariant::automatic || k.bwd_q_stages || k.bwd_head_splits)
      std::printf("kernel override: fwd %s, bwd %s, decode %s, bwd q stages %d, bwd head splits %d (0: auto)\n",
                  cb::variant_name(k.fwd), cb::variant_name(k.bwd), cb::variant_name(k.decode), k.bwd_q_stages,
                  k.bwd_head_splits);
  }
  int rc = 0;
  const bool all = opt.op == "all";
  if (all || opt.op == "fwd") rc |= mala_bench::run_forward_bench(opt);
  if (all || opt.op == "bwd") rc |= run_backward_bench(argc, argv);
  if (all || opt.op == "decode") rc |= run_decode_bench(argc, argv);
  if (!all && opt.op != "fwd" && opt.op != "bwd" && opt.op != "decode") {
    std::fprintf(stderr, "mala_bench: --op must be fwd, bwd, decode or all (got %s)\n", opt.op.c_str());
    return 2;
  }
  return rc;
}
