// Built-in workloads (docs/workloads.md has the formulas and the measured retained-fraction curve).
//
// Every element is a pure function of (seed, tensor, flat index): a counter-based generator
// (splitmix64 over the element counter, Box-Muller over pairs of elements) needs no sequential
// state, so rows are generated in parallel and any slice could be regenerated alone.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "mala/mala.h"

namespace mala {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;

// Stream tags: one independent counter space per tensor / per structural draw.
enum Stream : uint64_t {
  kStreamQ = 1,
  kStreamK = 2,
  kStreamV = 3,
  kStreamDout = 4,
  kStreamPhase = 5,
  kStreamNeedle = 6,
};

// Synthetic-regime constants (score units are natural-log units of scale * q.k).
// The structured score peak is c(s) = kPeak * sqrt(s): a query scores its own position, its
// needle, and the sink key at about c(s).  The square root spreads the measured transition
// (c from about 15, everything retained, to about 30, a few tiles per row) over s = 1.5 .. 8.
constexpr double kPeak = 12.0;
// Sink channel amplitude on the query side tends to kSinkQueryMax; it sets the sink's
// mean-to-noise ratio (the noise part of q is N(0, 1) in that channel too).
constexpr double kSinkQueryMax = 4.0;
// RoPE base of the rotating frequency pairs.
constexpr double kRopeBase = 10000.0;
// One planted needle per this many positions (at least one per sequence and KV head).
constexpr int64_t kPositionsPerNeedle = 512;

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Key of one counter space: the seed and the stream tag mixed so streams never overlap.
inline uint64_t stream_key(uint64_t seed, uint64_t stream) {
  return splitmix64(splitmix64(seed) ^ (stream * 0xD1B54A32D192ED03ull));
}

// Uniform in (0, 1): 53 random bits, offset by half an ulp so log() never sees 0.
inline double uniform(uint64_t key, uint64_t counter) {
  uint64_t bits = splitmix64(key ^ splitmix64(counter)) >> 11;
  return (static_cast<double>(bits) + 0.5) * (1.0 / 9007199254740992.0);
}

// Standard normal for element `index` of a stream: elements 2j and 2j+1 are the cosine and sine
// halves of one Box-Muller draw from the uniforms at counters 2j and 2j+1.
inline double normal(uint64_t key, uint64_t index) {
  uint64_t pair = index >> 1;
  double u1 = uniform(key, 2 * pair);
  double u2 = uniform(key, 2 * pair + 1);
  double r = std::sqrt(-2.0 * std::log(u1));
  double a = kTwoPi * u2;
  return (index & 1) ? r * std::sin(a) : r * std::cos(a);
}

// Fills `count` consecutive normals starting at `first` (one Box-Muller draw per pair).
void fill_normals(uint64_t key, uint64_t first, int64_t count, float* out) {
  int64_t i = 0;
  if (first & 1) {
    out[i++] = static_cast<float>(normal(key, first));
  }
  for (; i + 1 < count; i += 2) {
    uint64_t pair = (first + i) >> 1;
    double u1 = uniform(key, 2 * pair);
    double u2 = uniform(key, 2 * pair + 1);
    double r = std::sqrt(-2.0 * std::log(u1));
    double a = kTwoPi * u2;
    out[i] = static_cast<float>(r * std::cos(a));
    out[i + 1] = static_cast<float>(r * std::sin(a));
  }
  if (i < count) out[i] = static_cast<float>(normal(key, first + i));
}

void fill_random(uint64_t seed, uint64_t stream, int64_t n, float* out) {
  const uint64_t key = stream_key(seed, stream);
  const int64_t chunk = 4096;
  const int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t first = c * chunk;
    int64_t count = first + chunk <= n ? chunk : n - first;
    fill_normals(key, static_cast<uint64_t>(first), count, out + first);
  }
}

Status validate(const WorkloadSpec& s, const float* q, const float* k, const float* v) {
  if (s.regime != "random" && s.regime != "synthetic")
    return Status::error("regime: must be \"random\" or \"synthetic\" (got \"" + s.regime + "\")");
  if (s.batch < 1) return Status::error("batch: must be >= 1 (got " + std::to_string(s.batch) + ")");
  if (s.seqlen < 1)
    return Status::error("seqlen: must be >= 1 (got " + std::to_string(s.seqlen) + ")");
  if (s.heads_q < 1)
    return Status::error("heads_q: must be >= 1 (got " + std::to_string(s.heads_q) + ")");
  if (s.heads_kv < 1)
    return Status::error("heads_kv: must be >= 1 (got " + std::to_string(s.heads_kv) + ")");
  if (s.heads_q % s.heads_kv != 0)
    return Status::error("heads_kv: must divide heads_q (got heads_q=" + std::to_string(s.heads_q) +
                         ", heads_kv=" + std::to_string(s.heads_kv) + ")");
  if (s.head_dim < 1)
    return Status::error("head_dim: must be >= 1 (got " + std::to_string(s.head_dim) + ")");
  if (!(s.sharpness >= 0) || !std::isfinite(s.sharpness))
    return Status::error("sharpness: must be a finite number >= 0 (got " +
                         std::to_string(s.sharpness) + ")");
  if (!q) return Status::error("q: null pointer");
  if (!k) return Status::error("k: null pointer");
  if (!v) return Status::error("v: null pointer");
  return Status::success();
}

// The synthetic regime's structure, drawn once per call from the seed.
struct Synthetic {
  int64_t B, N, Hq, Hkv, d, group;
  int64_t pairs;        // rotating frequency pairs on dims [0, 2*pairs)
  int64_t sink_dim;     // reserved channel for the sink (-1 when d < 3)
  double rope_amp;      // a: amplitude of each rotating pair
  double sink_q;        // b: every query's sink channel offset
  double sink_k;        // beta: key 0's sink channel offset
  std::vector<double> omega;   // [pairs]
  std::vector<double> phase;   // [B, Hkv, pairs]
  std::vector<int64_t> key_pos;  // [B, Hkv, N]: position whose rotation key row u carries

  Synthetic(const WorkloadSpec& s) {
    B = s.batch, N = s.seqlen, Hq = s.heads_q, Hkv = s.heads_kv, d = s.head_dim;
    group = Hq / Hkv;
    const double peak = kPeak * std::sqrt(s.sharpness);
    // With d >= 3 the last channel is the sink's; the rotating pairs take the rest.
    sink_dim = d >= 3 ? d - 1 : -1;
    pairs = (sink_dim >= 0 ? d - 1 : d) / 2;
    const double sqrt_d = std::sqrt(static_cast<double>(d));
    // Structured score of a query and a key at distance D: a^2 * sum_f cos(omega_f D) / sqrt(d)
    // = c(s) * mean_f cos(omega_f D)  (c(s) at D = 0).
    rope_amp = pairs > 0 ? std::sqrt(peak * sqrt_d / static_cast<double>(pairs)) : 0;
    // Sink score b * beta / sqrt(d) = c(s); b grows from 0 to kSinkQueryMax.
    sink_q = kSinkQueryMax * std::sqrt(s.sharpness / (1.0 + s.sharpness));
    sink_k = sink_q > 0 ? peak * sqrt_d / sink_q : 0;
    if (sink_dim < 0) sink_q = sink_k = 0;

    omega.resize(pairs);
    for (int64_t f = 0; f < pairs; ++f)
      omega[f] = std::pow(kRopeBase, -static_cast<double>(f) / static_cast<double>(pairs));
    phase.resize(B * Hkv * pairs);
    const uint64_t phase_key = stream_key(s.seed, kStreamPhase);
    for (int64_t i = 0; i < B * Hkv * pairs; ++i) phase[i] = kTwoPi * uniform(phase_key, i);

    // Needles: key u carries the rotation of a later position t, so the queries around t score
    // it as strongly as their own neighbourhood (a far tile a few query tiles must retain).
    key_pos.resize(B * Hkv * N);
    for (int64_t i = 0; i < B * Hkv; ++i)
      for (int64_t u = 0; u < N; ++u) key_pos[i * N + u] = u;
    const uint64_t needle_key = stream_key(s.seed, kStreamNeedle);
    const int64_t needles = N >= 3 ? (N + kPositionsPerNeedle - 1) / kPositionsPerNeedle : 0;
    for (int64_t i = 0; i < B * Hkv; ++i) {
      for (int64_t n = 0; n < needles; ++n) {
        uint64_t c = 2 * static_cast<uint64_t>(i * needles + n);
        // Key position in [1, N-2] (0 is the sink), target in (u, N-1].
        int64_t u = 1 + static_cast<int64_t>(uniform(needle_key, c) * static_cast<double>(N - 2));
        int64_t t = u + 1 + static_cast<int64_t>(uniform(needle_key, c + 1) *
                                                 static_cast<double>(N - 1 - u));
        key_pos[i * N + u] = t;
      }
    }
  }

  // Adds the structured part of one row at position `pos` (its rotation angle) for KV group g.
  void add_rotation(float* row, int64_t b, int64_t g, int64_t pos) const {
    const double* ph = &phase[(b * Hkv + g) * pairs];
    for (int64_t f = 0; f < pairs; ++f) {
      double a = omega[f] * static_cast<double>(pos) + ph[f];
      row[2 * f] += static_cast<float>(rope_amp * std::cos(a));
      row[2 * f + 1] += static_cast<float>(rope_amp * std::sin(a));
    }
  }
};

void fill_synthetic_q(const Synthetic& sy, uint64_t seed, float* q) {
  const uint64_t key = stream_key(seed, kStreamQ);
  const int64_t rows = sy.B * sy.N * sy.Hq;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = r % sy.Hq, t = (r / sy.Hq) % sy.N, b = r / (sy.Hq * sy.N);
    float* row = q + r * sy.d;
    fill_normals(key, static_cast<uint64_t>(r * sy.d), sy.d, row);
    sy.add_rotation(row, b, h / sy.group, t);
    if (sy.sink_dim >= 0) row[sy.sink_dim] += static_cast<float>(sy.sink_q);
  }
}

void fill_synthetic_k(const Synthetic& sy, uint64_t seed, float* k) {
  const uint64_t key = stream_key(seed, kStreamK);
  const int64_t rows = sy.B * sy.N * sy.Hkv;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = r % sy.Hkv, u = (r / sy.Hkv) % sy.N, b = r / (sy.Hkv * sy.N);
    float* row = k + r * sy.d;
    fill_normals(key, static_cast<uint64_t>(r * sy.d), sy.d, row);
    sy.add_rotation(row, b, g, sy.key_pos[(b * sy.Hkv + g) * sy.N + u]);
    if (u == 0 && sy.sink_dim >= 0) row[sy.sink_dim] += static_cast<float>(sy.sink_k);
  }
}

}  // namespace

Status make_workload(const WorkloadSpec& spec, float* q, float* k, float* v, float* dout) {
  Status st = validate(spec, q, k, v);
  if (!st) return st;
  const int64_t nq = spec.batch * spec.seqlen * spec.heads_q * spec.head_dim;
  const int64_t nk = spec.batch * spec.seqlen * spec.heads_kv * spec.head_dim;
  if (spec.regime == "random" || spec.sharpness == 0) {
    // Sharpness 0 is the random regime exactly (same streams, same values).
    fill_random(spec.seed, kStreamQ, nq, q);
    fill_random(spec.seed, kStreamK, nk, k);
  } else {
    Synthetic sy(spec);
    fill_synthetic_q(sy, spec.seed, q);
    fill_synthetic_k(sy, spec.seed, k);
  }
  // Values and output gradients carry no structure in either regime.
  fill_random(spec.seed, kStreamV, nk, v);
  if (dout) fill_random(spec.seed, kStreamDout, nq, dout);
  return Status::success();
}

}  // namespace mala
