// `mala report`: forward + backward on a built-in workload; realized work, fidelity and time of
// mala at tau next to its own tau = 0 (dense) path.
#include <chrono>
#include <cmath>
#include <algorithm>
#include <cstdio>

#include "cli.h"
#include "runner.h"
#include "validate.h"

namespace mala {
namespace cli {
namespace {

// The report's default sharpness: at N = 4K it retains about half the legal tiles at tau = 1
// (about 1,200 key slots per query), near what the paper reports for a 14B model around 4K-8K
// (docs/workloads.md has the measured curve).
constexpr double kDefaultSharpness = 3.0;
// Up to this many score entries (B * Hq * Nq * Nk) the exact dense reference (double accumulation)
// is used; above it the reference is mala's own tau = 0 path.
constexpr double kDenseReferenceEntries = 67108864.0;  // 2^26

const char* kReportHelp =
    "usage: mala report [flags]\n"
    "\n"
    "Runs MALA forward + backward on a built-in workload and prints the realized work\n"
    "(post-score key slots per query, retained tiles), the omitted softmax mass next to its\n"
    "bound tau/(1+tau), relative L2 errors of O, dQ, dK, dV against dense attention, and the\n"
    "wall time of mala at tau against its tau = 0 (dense) path.\n"
    "\n"
    "workload:\n"
    "  --regime R        synthetic | random                        (default synthetic)\n"
    "  --sharpness S     synthetic sharpness, >= 0; 0 = random     (default 3)\n"
    "  --seed N          workload seed                             (default 0)\n"
    "  --batch B         sequences                                 (default 1)\n"
    "  --n N             sequence length (queries = keys)          (default 4096)\n"
    "  --heads H         query heads                               (default 8)\n"
    "  --kv-heads H      key/value heads, divides --heads          (default 1)\n"
    "  --d D             head dimension                            (default 128)\n"
    "attention:\n"
    "  --tau T           tolerance, >= 0; 0 = dense                (default 1)\n"
    "  --bq N, --bk N    query / key tile rows; 0 = the device's   (default 0: 128 on the CPU)\n"
    "  --causal, --no-causal                                       (default causal)\n"
    "run:\n"
    "  --device D        cpu | cuda | auto (cuda when a GPU is present)  (default cpu)\n"
    "  --ref R           auto | dense | tau0: reference for the errors and omitted mass;\n"
    "                    dense = exact double-accumulated reference (slow), tau0 = mala at\n"
    "                    tau = 0; auto = dense up to B*H*N^2 = 2^26 score entries (default auto)\n"
    "  --repeat R        timed calls per measurement, median reported; 0 = 1 on the\n"
    "                    CPU, 5 on CUDA (each after a warm-up call)    (default 0)\n"
    "  --json            print one JSON object instead of the table\n"
    "  --allow-nonfinite go on when the generated inputs hold NaN/Inf (else exit 2)\n"
    "  --quiet           no progress lines on stderr\n"
    "  --help            this text\n"
    "\n"
    "Exit status: 0 ok, 1 a failed run, 2 bad flags, 3 an output holds NaN/Inf (warned).\n";

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Json dist_json(const Distribution& d) {
  Json j;
  j.num("mean", d.mean).num("p95", d.p95).num("max", d.max).integer("count", d.count);
  return j;
}

}  // namespace

int report_main(int argc, char** argv) {
  WorkloadSpec spec;
  Problem p;
  float tau;
  std::string device_flag, ref_flag;
  bool json, allow_nonfinite;
  int repeat;
  try {
    Flags f(argc, argv,
            {"n", "heads", "kv-heads", "d", "tau", "bq", "bk", "seed", "regime", "sharpness",
             "batch", "device", "ref", "repeat"},
            {"json", "quiet", "help", "causal", "no-causal", "allow-nonfinite"});
    if (f.is_set("help")) {
      std::fputs(kReportHelp, stdout);
      return 0;
    }
    spec.regime = f.get("regime", "synthetic");
    if (spec.regime != "synthetic" && spec.regime != "random")
      throw UsageError("--regime: must be synthetic or random (got '" + spec.regime + "')");
    spec.sharpness = f.get_double("sharpness", kDefaultSharpness);
    if (spec.sharpness < 0)
      throw UsageError("--sharpness: must be >= 0 (got " + f.get("sharpness", "") + ")");
    spec.seed = f.get_u64("seed", 0);
    // Upper bounds keep element counts far from int64 overflow (the library indexes rows as int).
    spec.batch = f.get_int("batch", 1, 1, 1 << 16);
    spec.seqlen = f.get_int("n", 4096, 1, INT32_MAX);
    spec.heads_q = f.get_int("heads", 8, 1, 1 << 16);
    spec.heads_kv = f.get_int("kv-heads", 1, 1, 1 << 16);
    spec.head_dim = f.get_int("d", 128, 1, 1 << 16);
    if (spec.heads_q % spec.heads_kv != 0)
      throw UsageError("--kv-heads: must divide --heads (got --heads " +
                       std::to_string(spec.heads_q) + ", --kv-heads " +
                       std::to_string(spec.heads_kv) + ")");
    tau = static_cast<float>(f.get_tau(1.0));
    p.block_q = static_cast<int>(f.get_int("bq", 0, 0, 1 << 20));
    p.block_k = static_cast<int>(f.get_int("bk", 0, 0, 1 << 20));
    if (f.is_set("causal") && f.is_set("no-causal"))
      throw UsageError("--causal and --no-causal: give one of them");
    p.causal = !f.is_set("no-causal");
    device_flag = f.get("device", "cpu");
    if (device_flag != "cpu" && device_flag != "cuda" && device_flag != "auto")
      throw UsageError("--device: must be cpu, cuda or auto (got '" + device_flag + "')");
    ref_flag = f.get("ref", "auto");
    if (ref_flag != "auto" && ref_flag != "dense" && ref_flag != "tau0")
      throw UsageError("--ref: must be auto, dense or tau0 (got '" + ref_flag + "')");
    repeat = static_cast<int>(f.get_int("repeat", 0, 0, 1000));
    json = f.is_set("json");
    allow_nonfinite = f.is_set("allow-nonfinite");
    set_quiet(f.is_set("quiet"));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "mala report: %s\n", e.what());
    return kExitUsage;
  }

  // Device.
  std::unique_ptr<Runner> runner;
  std::string device_note;
  if (device_flag == "cpu") {
    runner = make_cpu_runner();
  } else {
    std::string why;
    runner = make_cuda_runner(&why);
    if (!runner) {
      if (device_flag == "cuda") {
        std::fprintf(stderr, "mala report: --device cuda: %s\n", why.c_str());
        return kExitFailure;
      }
      device_note = "--device auto: " + why + "; running on the CPU";
      progress(device_note);
      runner = make_cpu_runner();
    }
  }
  runner->set_repeats(repeat);
  const std::string device_name = runner->device_name();

  // Workload.
  p.batch = spec.batch;
  p.seqlen_q = p.seqlen_k = spec.seqlen;
  p.heads_q = spec.heads_q;
  p.heads_kv = spec.heads_kv;
  p.head_dim = spec.head_dim;
  if (runner->device() == "cpu") {
    // The library's argument checks (e.g. the CPU's largest head_dim) before any allocation;
    // they read no memory, so placeholders stand in for the tensors (hence without the overlap
    // test of mala::check(), which the runner's calls make).
    float placeholder = 0;
    ForwardArgs fa = forward_args(p, tau);
    fa.q = fa.k = fa.v = fa.o = &placeholder;
    Status st = internal::check_arguments(fa);
    if (!st) {
      std::fprintf(stderr, "mala report: %s\n",
                   name_flag(st.message, {{"head_dim", "--d"}, {"block_q", "--bq"}, {"block_k", "--bk"},
                                          {"seqlen_q", "--n"}, {"seqlen_k", "--n"}, {"heads_q", "--heads"},
                                          {"heads_kv", "--kv-heads"}, {"batch", "--batch"}, {"tau", "--tau"}})
                       .c_str());
      return kExitUsage;
    }
  }
  const int64_t nq = spec.batch * spec.seqlen * spec.heads_q * spec.head_dim;
  const int64_t nk = spec.batch * spec.seqlen * spec.heads_kv * spec.head_dim;
  auto t_gen = std::chrono::steady_clock::now();
  progress(format("generating %s workload (B=%lld N=%lld Hq=%lld Hkv=%lld d=%lld)",
                  spec.regime.c_str(), (long long)spec.batch, (long long)spec.seqlen,
                  (long long)spec.heads_q, (long long)spec.heads_kv, (long long)spec.head_dim));
  try {
    p.q.resize(nq);
    p.dout.resize(nq);
    p.k.resize(nk);
    p.v.resize(nk);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "mala report: out of memory allocating the workload\n");
    return kExitFailure;
  }
  Status s = make_workload(spec, p.q.data(), p.k.data(), p.v.data(), p.dout.data());
  if (!s) {
    std::fprintf(stderr, "mala report: %s\n", s.message.c_str());
    return kExitUsage;
  }
  const double gen_s = seconds_since(t_gen);
  // The library does not scan for NaN/Inf; the CLI does (docs/cli.md, "Non-finite values").
  if (!allow_nonfinite) {
    const std::vector<int64_t> q_shape = {p.batch, p.seqlen_q, p.heads_q, p.head_dim};
    const std::vector<int64_t> k_shape = {p.batch, p.seqlen_k, p.heads_kv, p.head_dim};
    const struct {
      const char* name;
      const std::vector<float>* x;
      const std::vector<int64_t>* shape;
    } ins[] = {{"q", &p.q, &q_shape}, {"k", &p.k, &k_shape}, {"v", &p.v, &k_shape}, {"dout", &p.dout, &q_shape}};
    for (const auto& in : ins) {
      const int64_t i = first_nonfinite(in.x->data(), static_cast<int64_t>(in.x->size()));
      if (i >= 0) {
        std::fprintf(stderr, "mala report: %s: the generated workload holds a non-finite value %g at index %s; "
                     "--allow-nonfinite runs anyway\n", in.name, (*in.x)[i], index_string(i, *in.shape).c_str());
        return kExitUsage;
      }
    }
  }

  // mala at tau and at tau = 0, forward then backward.
  auto fail = [](const char* step, const Status& st) {
    std::fprintf(stderr, "mala report: %s: %s\n", step, st.message.c_str());
    return kExitFailure;
  };
  ForwardResult fwd, fwd0;
  BackwardResult bwd, bwd0;
  progress("running on " + device_name);
  progress_begin(format("[1/4] forward, tau = %g", tau));
  if (!(s = runner->forward(p, tau, &fwd))) return fail("forward", s);
  progress_end(fwd.ms / 1e3);
  progress_begin("[2/4] forward, tau = 0");
  if (!(s = runner->forward(p, 0.f, &fwd0))) return fail("forward (tau = 0)", s);
  progress_end(fwd0.ms / 1e3);
  progress_begin(format("[3/4] backward, tau = %g", tau));
  if (!(s = runner->backward(p, tau, fwd, &bwd))) return fail("backward", s);
  progress_end(bwd.ms / 1e3);
  progress_begin("[4/4] backward, tau = 0");
  if (!(s = runner->backward(p, 0.f, fwd0, &bwd0))) return fail("backward (tau = 0)", s);
  progress_end(bwd0.ms / 1e3);

  // Reference.
  const double entries = static_cast<double>(p.batch) * p.heads_q * p.seqlen_q * p.seqlen_k;
  const bool dense_ref = ref_flag == "dense" || (ref_flag == "auto" && entries <= kDenseReferenceEntries);
  const std::vector<float>*ref_o = &fwd0.o, *ref_lse = &fwd0.lse, *ref_dq = &bwd0.dq,
                          *ref_dk = &bwd0.dk, *ref_dv = &bwd0.dv;
  std::vector<float> d_o, d_lse, d_dq, d_dk, d_dv;
  std::string ref_name = "mala tau=0 path (" + runner->device() + ")";
  if (dense_ref) {
    progress_begin("exact dense reference (double accumulation)");
    auto t_ref = std::chrono::steady_clock::now();
    const Problem seen = runner->as_seen(p);
    ForwardArgs fa = forward_args(seen, 0.f);
    d_o.assign(nq, 0.f);
    d_lse.assign(p.rows(), 0.f);
    fa.q = seen.q.data();
    fa.k = seen.k.data();
    fa.v = seen.v.data();
    fa.o = d_o.data();
    fa.lse = d_lse.data();
    if (!(s = reference::dense_forward(fa))) return fail("dense reference forward", s);
    BackwardArgs ba = backward_args(seen, 0.f);
    d_dq.assign(nq, 0.f);
    d_dk.assign(nk, 0.f);
    d_dv.assign(nk, 0.f);
    ba.q = seen.q.data();
    ba.k = seen.k.data();
    ba.v = seen.v.data();
    ba.o = d_o.data();
    ba.dout = seen.dout.data();
    ba.lse = d_lse.data();
    ba.dq = d_dq.data();
    ba.dk = d_dk.data();
    ba.dv = d_dv.data();
    if (!(s = reference::dense_backward(ba))) return fail("dense reference backward", s);
    progress_end(seconds_since(t_ref));
    ref_o = &d_o, ref_lse = &d_lse, ref_dq = &d_dq, ref_dk = &d_dk, ref_dv = &d_dv;
    ref_name = "exact dense (mala::reference, double accumulation)";
  }

  // Statistics.
  const Distribution fs = slot_stats(fwd.slots.data(), p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, p.causal);
  const Distribution bs = slot_stats(bwd.slots.data(), p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, p.causal);
  const Distribution fs0 = slot_stats(fwd0.slots.data(), p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, p.causal);
  const Distribution bs0 = slot_stats(bwd0.slots.data(), p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, p.causal);
  const double fr = retained_fraction(fwd.tile_mask.data(), fwd.tile_mask.size());
  const double br = retained_fraction(bwd.tile_mask.data(), bwd.tile_mask.size());
  const Distribution om = omitted_mass(fwd.lse.data(), ref_lse->data(), p.rows());
  const double bound = tau / (1.0 + tau);
  const double e_o = relative_l2(fwd.o.data(), ref_o->data(), nq);
  const double e_dq = relative_l2(bwd.dq.data(), ref_dq->data(), nq);
  const double e_dk = relative_l2(bwd.dk.data(), ref_dk->data(), nk);
  const double e_dv = relative_l2(bwd.dv.data(), ref_dv->data(), nk);
  const double e_o0 = dense_ref ? relative_l2(fwd0.o.data(), ref_o->data(), nq) : 0.0;
  const double e_dq0 = dense_ref ? relative_l2(bwd0.dq.data(), ref_dq->data(), nq) : 0.0;
  const double e_dk0 = dense_ref ? relative_l2(bwd0.dk.data(), ref_dk->data(), nk) : 0.0;
  const double e_dv0 = dense_ref ? relative_l2(bwd0.dv.data(), ref_dv->data(), nk) : 0.0;
  // Non-finite outputs: reported all the same, flagged, exit status 3.
  std::vector<std::string> nonfinite;
  {
    const struct {
      const char* name;
      const std::vector<float>* x;
    } outs[] = {{"o", &fwd.o}, {"dq", &bwd.dq}, {"dk", &bwd.dk}, {"dv", &bwd.dv},
                {"o (tau = 0)", &fwd0.o}, {"dq (tau = 0)", &bwd0.dq}, {"dk (tau = 0)", &bwd0.dk},
                {"dv (tau = 0)", &bwd0.dv}};
    for (const auto& o : outs) {
      const int64_t n = count_nonfinite(o.x->data(), static_cast<int64_t>(o.x->size()));
      if (n == 0) continue;
      nonfinite.push_back(o.name);
      std::fprintf(stderr, "mala report: warning: %s: %lld non-finite values\n", o.name, (long long)n);
    }
  }
  const int status = nonfinite.empty() ? 0 : kExitNonfiniteOutput;
  const std::string workload =
      spec.regime == "synthetic" ? format("synthetic (sharpness %g)", spec.sharpness) : "random";

  if (json) {
    Json shape;
    shape.integer("batch", p.batch).integer("seqlen", spec.seqlen).integer("heads_q", p.heads_q)
        .integer("heads_kv", p.heads_kv).integer("head_dim", p.head_dim).boolean("causal", p.causal);
    Json slots;
    slots.object("fwd", dist_json(fs)).object("bwd", dist_json(bs))
        .object("fwd_tau0", dist_json(fs0)).object("bwd_tau0", dist_json(bs0));
    Json err;
    err.num("o", e_o).num("dq", e_dq).num("dk", e_dk).num("dv", e_dv);
    Json time;
    time.num("fwd_ms", fwd.ms).num("fwd_tau0_ms", fwd0.ms).num("fwd_ratio", fwd.ms / fwd0.ms)
        .num("bwd_ms", bwd.ms).num("bwd_tau0_ms", bwd0.ms).num("bwd_ratio", bwd.ms / bwd0.ms)
        .num("workload_s", gen_s).integer("timed_calls", runner->timed_calls());
    Json j;
    j.str("device", runner->device()).str("device_name", device_name).str("dtype", runner->dtype());
    if (!device_note.empty()) j.str("device_note", device_note);
    j.str("regime", spec.regime).num("sharpness", spec.regime == "synthetic" ? spec.sharpness : 0.0)
        .integer("seed", static_cast<int64_t>(spec.seed)).object("shape", shape).num("tau", tau)
        .integer("fwd_block_q", fwd.tiles.block_q).integer("fwd_block_k", fwd.tiles.block_k)
        .integer("bwd_block_q", bwd.tiles.block_q).integer("bwd_block_k", bwd.tiles.block_k)
        .object("slots_per_query", slots).num("retained_fraction_fwd", fr)
        .num("retained_fraction_bwd", br).object("omitted_mass", dist_json(om))
        .num("omitted_mass_bound", bound).str("reference", dense_ref ? "dense" : "tau0")
        .object("rel_l2_error", err);
    if (dense_ref) {
      Json err0;
      err0.num("o", e_o0).num("dq", e_dq0).num("dk", e_dk0).num("dv", e_dv0);
      j.object("rel_l2_error_tau0", err0);
    }
    j.object("time", time);
    std::string nf = "[";
    for (size_t i = 0; i < nonfinite.size(); ++i) nf += (i ? ", " : "") + json_escape(nonfinite[i]);
    j.raw("nonfinite_outputs", nf + "]");
    std::printf("%s\n", j.dump().c_str());
    return status;
  }

  std::printf("mala report: MassAlloc Attention at tau = %g\n\n", tau);
  std::printf("  device     %s [%s], %s\n", device_name.c_str(), runner->device().c_str(),
              runner->dtype().c_str());
  if (!device_note.empty()) std::printf("             (%s)\n", device_note.c_str());
  std::printf("  workload   %s, seed %llu (generated in %.2f s)\n", workload.c_str(),
              (unsigned long long)spec.seed, gen_s);
  std::printf("  shape      batch %lld, N %lld, Hq %lld, Hkv %lld, d %lld, %s\n",
              (long long)p.batch, (long long)spec.seqlen, (long long)p.heads_q,
              (long long)p.heads_kv, (long long)p.head_dim, p.causal ? "causal" : "non-causal");
  std::printf("  tiles      forward %dx%d, backward %dx%d (Bq x Bk)\n", fwd.tiles.block_q,
              fwd.tiles.block_k, bwd.tiles.block_q, bwd.tiles.block_k);
  std::printf("  reference  %s\n\n", ref_name.c_str());

  std::printf("  %-36s %14s %14s\n", "realized work", "forward", "backward");
  std::printf("  %-36s %14.1f %14.1f\n", "key slots / query, mean", fs.mean, bs.mean);
  std::printf("  %-36s %14.1f %14.1f\n", "key slots / query, P95", fs.p95, bs.p95);
  std::printf("  %-36s %14.1f %14.1f\n", "key slots / query at tau = 0, mean", fs0.mean, bs0.mean);
  std::printf("  %-36s %13.2f%% %13.2f%%\n\n", "legal tiles retained", 100 * fr, 100 * br);

  std::printf("  omitted softmax mass per row (forward)\n");
  std::printf("    mean %.3e   P95 %.3e   max %.3e   bound tau/(1+tau) = %.4f  %s\n\n", om.mean + 0.0,
              om.p95 + 0.0, om.max + 0.0, bound, om.max <= bound + 1e-6 ? "(within)" : "(EXCEEDED)");

  std::printf("  relative L2 error vs reference     O          dQ         dK         dV\n");
  std::printf("    mala at tau = %-10g %10.3e %10.3e %10.3e %10.3e\n", tau, e_o, e_dq, e_dk, e_dv);
  if (dense_ref)
    std::printf("    mala at tau = 0          %10.3e %10.3e %10.3e %10.3e\n", e_o0, e_dq0, e_dk0,
                e_dv0);
  const int timed = runner->timed_calls();
  const std::string time_title =
      (runner->device() == "cuda" ? "time (CUDA events" : "wall time (") +
      (timed == 1 ? std::string(runner->device() == "cuda" ? ", one call)" : "one call each)")
                  : format("%smedian of %d)", runner->device() == "cuda" ? ", " : "", timed));
  std::printf("\n  %-34s %12s %12s %8s\n", time_title.c_str(), "tau", "tau = 0", "ratio");
  std::printf("    %-32s %9.1f ms %9.1f ms %8.3f\n", "forward", fwd.ms, fwd0.ms, fwd.ms / fwd0.ms);
  std::printf("    %-32s %9.1f ms %9.1f ms %8.3f\n", "backward", bwd.ms, bwd0.ms, bwd.ms / bwd0.ms);
  std::printf("    %-32s %9.1f ms %9.1f ms %8.3f\n", "forward + backward", fwd.ms + bwd.ms,
              fwd0.ms + bwd0.ms, (fwd.ms + bwd.ms) / (fwd0.ms + bwd0.ms));
  return status;
}

}  // namespace cli
}  // namespace mala
