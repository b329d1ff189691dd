// Runs mala's forward and backward for the CLI on host fp32 arrays, on the CPU or (built with
// MALA_CUDA) on the GPU in bf16, and hands back host fp32 results, the realized work and timings.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mala/mala.h"

namespace mala {
namespace cli {

// One attention problem in the public layouts (q/dout [B,Nq,Hq,d], k/v [B,Nk,Hkv,d]), fp32.
struct Problem {
  int64_t batch = 1, seqlen_q = 0, seqlen_k = 0, heads_q = 1, heads_kv = 1, head_dim = 0;
  bool causal = true;
  float softmax_scale = 0.f;  // 0 = 1/sqrt(d)
  int block_q = 0, block_k = 0;  // 0 = the implementation's tiles
  std::vector<float> q, k, v, dout;

  int64_t rows() const { return batch * heads_q * seqlen_q; }  // lse / slot entries
};

struct ForwardResult {
  std::vector<float> o, lse;
  std::vector<int32_t> slots;
  std::vector<uint8_t> tile_mask;
  Tiles tiles;
  double ms = 0;  // median time of the timed calls (Runner::set_repeats)
};

struct BackwardResult {
  std::vector<float> dq, dk, dv;
  std::vector<int32_t> slots;
  std::vector<uint8_t> tile_mask;
  Tiles tiles;
  double ms = 0;
};

class Runner {
 public:
  virtual ~Runner() = default;
  virtual std::string device() const = 0;       // "cpu" or "cuda"
  virtual std::string device_name() const = 0;  // "cpu (2 threads)" or the GPU's name
  virtual std::string dtype() const = 0;
  // The inputs as the device sees them, widened to fp32 (bf16-rounded on CUDA): what a reference
  // should be computed from.
  virtual Problem as_seen(const Problem& p) const = 0;
  // Timed calls per forward/backward (the median is reported); 0 = the device's default:
  // 1 on the CPU (after a small warm-up call), 5 after one warm-up call on CUDA.
  void set_repeats(int n) { repeats_ = n; }
  // The number of timed calls each forward/backward makes (what set_repeats(0) resolves to).
  virtual int timed_calls() const = 0;
  virtual Status forward(const Problem& p, float tau, ForwardResult* out) = 0;
  // Uses fwd.o and fwd.lse (the forward at the same tau) as the saved forward state.
  virtual Status backward(const Problem& p, float tau, const ForwardResult& fwd,
                          BackwardResult* out) = 0;

 protected:
  int repeats_ = 0;
};

// Median of a non-empty list of times.
double median(std::vector<double> v);

std::unique_ptr<Runner> make_cpu_runner();
// Null with *why set when the library was built without CUDA or no GPU is present.
std::unique_ptr<Runner> make_cuda_runner(std::string* why);

// The argument structs for a problem (pointers left null; sizes, flags and tiles filled in).
ForwardArgs forward_args(const Problem& p, float tau);
BackwardArgs backward_args(const Problem& p, float tau);

// Number of tile_mask entries for the given tiles.
int64_t tile_mask_size(const Problem& p, Tiles t);

}  // namespace cli
}  // namespace mala
