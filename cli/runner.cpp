#include "runner.h"

#include <omp.h>

#include <algorithm>
#include <chrono>

namespace mala {
namespace cli {

ForwardArgs forward_args(const Problem& p, float tau) {
  ForwardArgs a;
  a.batch = p.batch;
  a.seqlen_q = p.seqlen_q;
  a.seqlen_k = p.seqlen_k;
  a.heads_q = p.heads_q;
  a.heads_kv = p.heads_kv;
  a.head_dim = p.head_dim;
  a.causal = p.causal;
  a.softmax_scale = p.softmax_scale;
  a.tau = tau;
  a.block_q = p.block_q;
  a.block_k = p.block_k;
  return a;
}

BackwardArgs backward_args(const Problem& p, float tau) {
  BackwardArgs a;
  a.batch = p.batch;
  a.seqlen_q = p.seqlen_q;
  a.seqlen_k = p.seqlen_k;
  a.heads_q = p.heads_q;
  a.heads_kv = p.heads_kv;
  a.head_dim = p.head_dim;
  a.causal = p.causal;
  a.softmax_scale = p.softmax_scale;
  a.tau = tau;
  a.block_q = p.block_q;
  a.block_k = p.block_k;
  return a;
}

int64_t tile_mask_size(const Problem& p, Tiles t) {
  const int64_t nqt = (p.seqlen_q + t.block_q - 1) / t.block_q;
  const int64_t nkt = (p.seqlen_k + t.block_k - 1) / t.block_k;
  return p.batch * p.heads_q * nqt * nkt;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

namespace {

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

class CpuRunner : public Runner {
 public:
  int timed_calls() const override { return std::max(1, repeats_); }
  std::string device() const override { return "cpu"; }
  // Names the CPU even when a GPU is present (mala::device_name() prefers the GPU).
  std::string device_name() const override {
    return "cpu (" + std::to_string(omp_get_max_threads()) + " threads)";
  }
  std::string dtype() const override { return "float32"; }
  Problem as_seen(const Problem& p) const override { return p; }

  Status forward(const Problem& p, float tau, ForwardResult* out) override {
    warm_up();
    ForwardArgs a = forward_args(p, tau);
    a.device = Device::cpu;
    out->tiles = mala::forward_tiles(a);
    out->o.assign(p.q.size(), 0.f);
    out->lse.assign(p.rows(), 0.f);
    out->slots.assign(p.rows(), 0);
    out->tile_mask.assign(tile_mask_size(p, out->tiles), 0);
    a.q = p.q.data();
    a.k = p.k.data();
    a.v = p.v.data();
    a.o = out->o.data();
    a.lse = out->lse.data();
    a.fwd_slots = out->slots.data();
    a.tile_mask = out->tile_mask.data();
    return timed([&] { return mala::forward(a); }, &out->ms);
  }

  Status backward(const Problem& p, float tau, const ForwardResult& fwd,
                  BackwardResult* out) override {
    warm_up();
    BackwardArgs a = backward_args(p, tau);
    a.device = Device::cpu;
    out->tiles = mala::backward_tiles(a);
    out->dq.assign(p.q.size(), 0.f);
    out->dk.assign(p.k.size(), 0.f);
    out->dv.assign(p.v.size(), 0.f);
    out->slots.assign(p.rows(), 0);
    out->tile_mask.assign(tile_mask_size(p, out->tiles), 0);
    a.q = p.q.data();
    a.k = p.k.data();
    a.v = p.v.data();
    a.o = fwd.o.data();
    a.dout = p.dout.data();
    a.lse = fwd.lse.data();
    a.dq = out->dq.data();
    a.dk = out->dk.data();
    a.dv = out->dv.data();
    a.bwd_slots = out->slots.data();
    a.tile_mask = out->tile_mask.data();
    return timed([&] { return mala::backward(a); }, &out->ms);
  }

 private:
  // Runs `call` timed_calls() times; *ms = the median wall time.
  template <class Call>
  Status timed(Call call, double* ms) {
    std::vector<double> times;
    for (int i = 0; i < timed_calls(); ++i) {
      const double t0 = now_ms();
      Status s = call();
      times.push_back(now_ms() - t0);
      if (!s) return s;
    }
    *ms = median(times);
    return Status::success();
  }

  // One small call before the first timed one, so OpenMP's thread start-up is not billed to
  // whichever of tau / tau = 0 runs first.
  void warm_up() {
    if (warm_) return;
    warm_ = true;
    const int64_t n = 64, d = 16;
    std::vector<float> x(n * d, 0.5f), o(n * d);
    ForwardArgs a;
    a.q = a.k = a.v = x.data();
    a.o = o.data();
    a.seqlen_q = a.seqlen_k = n;
    a.head_dim = d;
    mala::forward(a);
  }
  bool warm_ = false;
};

}  // namespace

std::unique_ptr<Runner> make_cpu_runner() { return std::make_unique<CpuRunner>(); }

}  // namespace cli
}  // namespace mala
