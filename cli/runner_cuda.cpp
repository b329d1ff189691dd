// The CLI's GPU path: bf16 copies of the inputs on the device, mala's Device::cuda entry points,
// CUDA-event timing (median of several calls after a warm-up), results copied back as fp32.
// Compiled into the tool only when the library is built with MALA_CUDA (MALA_WITH_CUDA=1).
#include "runner.h"

#if defined(MALA_WITH_CUDA)

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

namespace mala {
namespace cli {
namespace {

constexpr int kDefaultTimedCalls = 5;

uint16_t to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // nan
  x += 0x7fffu + ((x >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(x >> 16);
}

float from_bf16(uint16_t h) {
  uint32_t x = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

std::vector<float> round_bf16(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_bf16(to_bf16(v[i]));
  return out;
}

Status cuda_error(cudaError_t e, const char* what) {
  return Status::error(std::string("device: ") + what + ": " + cudaGetErrorString(e));
}

// A device allocation freed on scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  Status alloc(size_t n) {
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    bytes = n;
    cudaError_t e = cudaMalloc(&ptr, n ? n : 1);
    if (e != cudaSuccess) return cuda_error(e, "cudaMalloc");
    // Zeroed, so entries a kernel does not write (illegal tiles of a tile_mask) read as 0.
    e = cudaMemset(ptr, 0, n ? n : 1);
    return e == cudaSuccess ? Status::success() : cuda_error(e, "cudaMemset");
  }
  Status upload_bf16(const std::vector<float>& host) {
    std::vector<uint16_t> h(host.size());
    for (size_t i = 0; i < host.size(); ++i) h[i] = to_bf16(host[i]);
    Status s = alloc(h.size() * 2);
    if (!s) return s;
    cudaError_t e = cudaMemcpy(ptr, h.data(), h.size() * 2, cudaMemcpyHostToDevice);
    return e == cudaSuccess ? Status::success() : cuda_error(e, "cudaMemcpy");
  }
  Status upload(const void* host, size_t n) {
    Status s = alloc(n);
    if (!s) return s;
    cudaError_t e = cudaMemcpy(ptr, host, n, cudaMemcpyHostToDevice);
    return e == cudaSuccess ? Status::success() : cuda_error(e, "cudaMemcpy");
  }
  Status download(void* host, size_t n) const {
    cudaError_t e = cudaMemcpy(host, ptr, n, cudaMemcpyDeviceToHost);
    return e == cudaSuccess ? Status::success() : cuda_error(e, "cudaMemcpy");
  }
  Status download_bf16(std::vector<float>* host, size_t count) const {
    std::vector<uint16_t> h(count);
    Status s = download(h.data(), count * 2);
    if (!s) return s;
    host->resize(count);
    for (size_t i = 0; i < count; ++i) (*host)[i] = from_bf16(h[i]);
    return Status::success();
  }
};

// Times `call` with CUDA events: one warm-up, then the median of `repeats` calls.
template <class Call>
Status time_calls(Call call, int repeats, double* ms) {
  Status s = call();
  if (!s) return s;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> times;
  for (int i = 0; i < repeats && s; ++i) {
    cudaEventRecord(start);
    s = call();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    times.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!s) return s;
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) return cuda_error(e, "kernel");
  *ms = median(times);
  return Status::success();
}

class CudaRunner : public Runner {
 public:
  int timed_calls() const override { return repeats_ > 0 ? repeats_ : kDefaultTimedCalls; }
  std::string device() const override { return "cuda"; }
  std::string device_name() const override { return mala::device_name(); }
  std::string dtype() const override { return "bfloat16"; }

  Problem as_seen(const Problem& p) const override {
    Problem r = p;
    r.q = round_bf16(p.q);
    r.k = round_bf16(p.k);
    r.v = round_bf16(p.v);
    r.dout = round_bf16(p.dout);
    return r;
  }

  Status forward(const Problem& p, float tau, ForwardResult* out) override {
    Status s = upload_inputs(p);
    if (!s) return s;
    ForwardArgs a = forward_args(p, tau);
    a.device = Device::cuda;
    a.dtype = DType::bf16;
    out->tiles = mala::forward_tiles(a);
    const size_t mask_n = tile_mask_size(p, out->tiles);
    DeviceBuffer o, lse, slots, mask;
    if (!(s = o.alloc(p.q.size() * 2)) || !(s = lse.alloc(p.rows() * 4)) ||
        !(s = slots.alloc(p.rows() * 4)) || !(s = mask.alloc(mask_n)))
      return s;
    a.q = q_.ptr;
    a.k = k_.ptr;
    a.v = v_.ptr;
    a.o = o.ptr;
    a.lse = static_cast<float*>(lse.ptr);
    a.fwd_slots = static_cast<int32_t*>(slots.ptr);
    a.tile_mask = static_cast<uint8_t*>(mask.ptr);
    s = time_calls([&] { return mala::forward(a); }, timed_calls(), &out->ms);
    if (!s) return s;
    out->lse.resize(p.rows());
    out->slots.resize(p.rows());
    out->tile_mask.resize(mask_n);
    if (!(s = o.download_bf16(&out->o, p.q.size())) ||
        !(s = lse.download(out->lse.data(), p.rows() * 4)) ||
        !(s = slots.download(out->slots.data(), p.rows() * 4)) ||
        !(s = mask.download(out->tile_mask.data(), mask_n)))
      return s;
    return Status::success();
  }

  Status backward(const Problem& p, float tau, const ForwardResult& fwd,
                  BackwardResult* out) override {
    Status s = upload_inputs(p);
    if (!s) return s;
    BackwardArgs a = backward_args(p, tau);
    a.device = Device::cuda;
    a.dtype = DType::bf16;
    out->tiles = mala::backward_tiles(a);
    const size_t mask_n = tile_mask_size(p, out->tiles);
    DeviceBuffer o, lse, dq, dk, dv, slots, mask, work;
    // fwd.o holds the device's bf16 output widened to fp32: converting back is exact.
    if (!(s = o.upload_bf16(fwd.o)) || !(s = lse.upload(fwd.lse.data(), fwd.lse.size() * 4)) ||
        !(s = dq.alloc(p.q.size() * 2)) || !(s = dk.alloc(p.k.size() * 2)) ||
        !(s = dv.alloc(p.v.size() * 2)) || !(s = slots.alloc(p.rows() * 4)) ||
        !(s = mask.alloc(mask_n)))
      return s;
    a.q = q_.ptr;
    a.k = k_.ptr;
    a.v = v_.ptr;
    a.o = o.ptr;
    a.dout = dout_.ptr;
    a.lse = static_cast<const float*>(lse.ptr);
    a.dq = dq.ptr;
    a.dk = dk.ptr;
    a.dv = dv.ptr;
    a.bwd_slots = static_cast<int32_t*>(slots.ptr);
    a.tile_mask = static_cast<uint8_t*>(mask.ptr);
    // Preallocated scratch keeps allocation out of the timed calls.
    const size_t ws = mala::backward_workspace_size(a);
    if (ws) {
      if (!(s = work.alloc(ws))) return s;
      a.workspace = work.ptr;
      a.workspace_bytes = ws;
    }
    s = time_calls([&] { return mala::backward(a); }, timed_calls(), &out->ms);
    if (!s) return s;
    out->slots.resize(p.rows());
    out->tile_mask.resize(mask_n);
    if (!(s = dq.download_bf16(&out->dq, p.q.size())) ||
        !(s = dk.download_bf16(&out->dk, p.k.size())) ||
        !(s = dv.download_bf16(&out->dv, p.v.size())) ||
        !(s = slots.download(out->slots.data(), p.rows() * 4)) ||
        !(s = mask.download(out->tile_mask.data(), mask_n)))
      return s;
    return Status::success();
  }

 private:
  // Inputs are uploaded once per problem (the report calls forward/backward several times).
  Status upload_inputs(const Problem& p) {
    if (uploaded_ == &p) return Status::success();
    Status s;
    if (!(s = q_.upload_bf16(p.q)) || !(s = k_.upload_bf16(p.k)) || !(s = v_.upload_bf16(p.v)) ||
        !(s = dout_.upload_bf16(p.dout.empty() ? std::vector<float>(p.q.size(), 0.f) : p.dout)))
      return s;
    uploaded_ = &p;
    return Status::success();
  }

  DeviceBuffer q_, k_, v_, dout_;
  const Problem* uploaded_ = nullptr;
};

}  // namespace

std::unique_ptr<Runner> make_cuda_runner(std::string* why) {
  if (!mala::cuda_available()) {
    *why = "no CUDA device found";
    return nullptr;
  }
  return std::make_unique<CudaRunner>();
}

}  // namespace cli
}  // namespace mala

#else  // built without CUDA

namespace mala {
namespace cli {

std::unique_ptr<Runner> make_cuda_runner(std::string* why) {
  *why = "this mala was built without CUDA (MALA_CUDA=OFF)";
  return nullptr;
}

}  // namespace cli
}  // namespace mala

#endif
