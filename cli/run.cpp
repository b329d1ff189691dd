// `mala run`: MALA forward (and backward with --do) on arrays from .npy files; writes the outputs
// as .npy.  Every input is read and checked, and the computation finished, before the output
// directory is created: a failing run writes nothing.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <unistd.h>

#include "cli.h"
#include "npy.h"
#include "out_dir.h"
#include "runner.h"
#include "validate.h"

namespace mala {
namespace cli {
namespace {

const char* kRunHelp =
    "usage: mala run --q Q.npy --k K.npy --v V.npy [--do DO.npy] --out DIR [flags]\n"
    "\n"
    "Runs MALA on arrays saved with numpy.save: q (and do) [N, Hq, d] or [B, N, Hq, d],\n"
    "k and v [Nk, Hkv, d] or [B, Nk, Hkv, d]; float32 or float16; Hq a multiple of Hkv.\n"
    "Causal attention is bottom-right aligned when N != Nk.\n"
    "Writes to DIR (created): o.npy (shape of q), lse.npy and fwd_slots.npy ([Hq, N] or\n"
    "[B, Hq, N]), fwd_tile_mask.npy ([(B,) Hq, query tiles, key tiles]: 0 illegal, 1 skipped,\n"
    "2 retained); with --do also dq.npy, dk.npy, dv.npy and bwd_slots.npy.  Arrays are\n"
    "float32, slots and masks int32.  Prints the realized work.\n"
    "\n"
    "  --q, --k, --v, --do FILE   inputs (--do optional: runs the backward)\n"
    "  --out DIR                  output directory (created; outputs there are replaced,\n"
    "                             and an earlier run's that this run does not write removed)\n"
    "  --tau T                    tolerance, >= 0; 0 = dense         (default 1)\n"
    "  --causal, --no-causal                                        (default causal)\n"
    "  --scale S                  softmax scale, > 0                 (default 1/sqrt(d))\n"
    "  --bq N, --bk N             tile rows; 0 = the device's        (default 0: 128 on the CPU)\n"
    "  --device D                 cpu | cuda | auto                  (default cpu)\n"
    "  --compare                  also run tau = 0 and print omitted mass and relative errors\n"
    "  --allow-nonfinite          run even when an input holds NaN or Inf\n"
    "  --json                     print the summary as one JSON object\n"
    "  --quiet                    no progress lines on stderr\n"
    "  --help                     this text\n"
    "\n"
    "Exit status: 0 ok, 1 unreadable or inconsistent inputs, unusable --out or a failed run,\n"
    "2 bad flags or NaN/Inf in an input, 3 outputs written but one holds NaN/Inf.\n"
    "SIGINT/SIGTERM/SIGHUP: what the run created is removed, then it ends by that signal\n"
    "(130/143/129 in a shell).  Outputs are staged in a private directory and published\n"
    "together (docs/cli.md, \"Output directory\").\n";

struct Input {
  std::string flag;  // "--q"
  std::string path;
  npy::Array array;
};

// Checks one input's rank (the reader accepted only float32 and float16); the message names the flag.
Status check_input(const Input& in) {
  const size_t rank = in.array.shape.size();
  if (rank != 3 && rank != 4)
    return Status::error(in.flag + ": expected a [N, H, d] or [B, N, H, d] array (got shape " +
                         in.array.shape_string() + ")");
  for (int64_t s : in.array.shape)
    if (s == 0) return Status::error(in.flag + ": shape " + in.array.shape_string() + " is empty");
  return Status::success();
}

Json dist_json(const Distribution& d) {
  Json j;
  j.num("mean", d.mean).num("p95", d.p95).num("max", d.max).integer("count", d.count);
  return j;
}

namespace fs = std::filesystem;

// Checked before any work: --out must be an existing writable directory, or a path whose nearest
// existing ancestor is a writable directory (DIR is then created after the computation), and no
// output name in an existing DIR may be a directory.
Status check_out_dir(const std::string& dir, const std::vector<std::string>& names) {
  fs::path probe = fs::path(dir);
  while (true) {
    std::error_code ec;
    const fs::file_status st = fs::status(probe, ec);
    if (fs::exists(st)) {
      if (!fs::is_directory(st)) return Status::error("--out: " + probe.string() + ": not a directory");
      if (::access(probe.c_str(), W_OK | X_OK) != 0)
        return Status::error("--out: " + probe.string() + ": not writable (" + std::strerror(errno) + ")");
      break;
    }
    fs::path parent = probe.parent_path();
    if (parent.empty()) parent = ".";
    if (parent == probe) return Status::error("--out: " + dir + ": no existing parent directory");
    probe = parent;
  }
  for (const std::string& name : names) {
    std::error_code ec;
    const fs::path p = fs::path(dir) / name;
    if (fs::is_directory(p, ec)) return Status::error("--out: " + p.string() + ": is a directory");
  }
  return Status::success();
}

}  // namespace

int run_main(int argc, char** argv) {
  std::vector<Input> inputs;
  std::string out_dir, device_flag;
  float tau, scale;
  bool causal, compare, json, allow_nonfinite;
  int bq, bk;
  try {
    Flags f(argc, argv, {"q", "k", "v", "do", "out", "tau", "scale", "bq", "bk", "device"},
            {"causal", "no-causal", "compare", "json", "quiet", "help", "allow-nonfinite"});
    if (f.is_set("help")) {
      std::fputs(kRunHelp, stdout);
      return 0;
    }
    for (const char* name : {"q", "k", "v"})
      if (!f.has(name)) throw UsageError(std::string("--") + name + ": required");
    if (!f.has("out")) throw UsageError("--out: required (the output directory)");
    for (const char* name : {"q", "k", "v", "do"})
      if (f.has(name)) inputs.push_back({std::string("--") + name, f.get(name, ""), {}});
    out_dir = f.get("out", "");
    if (out_dir.empty()) throw UsageError("--out: must not be empty");
    tau = static_cast<float>(f.get_tau(1.0));
    scale = static_cast<float>(f.get_double("scale", 0.0));
    if (f.has("scale") && !(scale > 0))
      throw UsageError("--scale: must be > 0 (got " + f.get("scale", "") + ")");
    bq = static_cast<int>(f.get_int("bq", 0, 0, 1 << 20));
    bk = static_cast<int>(f.get_int("bk", 0, 0, 1 << 20));
    if (f.is_set("causal") && f.is_set("no-causal"))
      throw UsageError("--causal and --no-causal: give one of them");
    causal = !f.is_set("no-causal");
    device_flag = f.get("device", "cpu");
    if (device_flag != "cpu" && device_flag != "cuda" && device_flag != "auto")
      throw UsageError("--device: must be cpu, cuda or auto (got '" + device_flag + "')");
    compare = f.is_set("compare");
    allow_nonfinite = f.is_set("allow-nonfinite");
    json = f.is_set("json");
    set_quiet(f.is_set("quiet"));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "mala run: %s\n", e.what());
    return kExitUsage;
  }
  auto fail = [](const std::string& msg) {
    std::fprintf(stderr, "mala run: %s\n", msg.c_str());
    return kExitFailure;
  };

  // --out before any work: a typo must not cost a computation.
  const std::vector<std::string> kForwardOutputs = {"o.npy", "lse.npy", "fwd_slots.npy", "fwd_tile_mask.npy"};
  const std::vector<std::string> kBackwardOutputs = {"dq.npy", "dk.npy", "dv.npy", "bwd_slots.npy"};
  std::vector<std::string> every_output = kForwardOutputs;
  every_output.insert(every_output.end(), kBackwardOutputs.begin(), kBackwardOutputs.end());
  {
    Status s = check_out_dir(out_dir, inputs.size() > 3 ? every_output : kForwardOutputs);
    if (!s) return fail(s.message);
  }

  // Read and check every input before anything else.
  for (Input& in : inputs) {
    Status s = npy::read(in.path, &in.array, npy::kAcceptFloat);
    if (!s) return fail(in.flag + ": " + s.message);
    if (!(s = check_input(in))) return fail(s.message);
  }
  const Input& q = inputs[0];
  const Input& k = inputs[1];
  const Input& v = inputs[2];
  const Input* dout = inputs.size() > 3 ? &inputs[3] : nullptr;
  const bool batched = q.array.shape.size() == 4;
  auto dims = [&](const npy::Array& a) {
    // [B, N, H, d] with B = 1 for rank-3 arrays.
    return a.shape.size() == 4 ? a.shape
                               : std::vector<int64_t>{1, a.shape[0], a.shape[1], a.shape[2]};
  };
  const std::vector<int64_t> qd = dims(q.array), kd = dims(k.array);
  auto mismatch = [&](const Input& in, const std::string& what) {
    return fail(in.flag + ": shape " + in.array.shape_string() + " does not match --q " +
                q.array.shape_string() + " (" + what + ")");
  };
  if (k.array.shape.size() != q.array.shape.size()) return mismatch(k, "rank differs");
  if (kd[0] != qd[0]) return mismatch(k, "batch differs");
  if (kd[3] != qd[3]) return mismatch(k, "head_dim differs");
  if (qd[2] % kd[2] != 0)
    return mismatch(k, "its " + std::to_string(kd[2]) + " KV heads do not divide the " +
                           std::to_string(qd[2]) + " query heads");
  if (v.array.shape != k.array.shape)
    return fail("--v: shape " + v.array.shape_string() + " does not match --k " +
                k.array.shape_string());
  if (dout && dout->array.shape != q.array.shape) return mismatch(*dout, "--do must have q's shape");

  Problem p;
  p.batch = qd[0];
  p.seqlen_q = qd[1];
  p.heads_q = qd[2];
  p.head_dim = qd[3];
  p.seqlen_k = kd[1];
  p.heads_kv = kd[2];
  p.causal = causal;
  p.softmax_scale = scale;
  p.block_q = bq;
  p.block_k = bk;
  p.q = npy::to_float(q.array);
  p.k = npy::to_float(k.array);
  p.v = npy::to_float(v.array);
  if (dout) p.dout = npy::to_float(dout->array);

  // NaN or Inf in an input spreads through whole rows (one NaN key poisons every query that sees
  // it); the library does not scan for them, the CLI does.
  if (!allow_nonfinite) {
    const std::pair<const Input*, const std::vector<float>*> tensors[] = {
        {&q, &p.q}, {&k, &p.k}, {&v, &p.v}, {dout, &p.dout}};
    for (const auto& t : tensors) {
      if (!t.first) continue;
      const int64_t i = first_nonfinite(t.second->data(), static_cast<int64_t>(t.second->size()));
      if (i >= 0) {
        std::fprintf(stderr,
                     "mala run: %s: non-finite value %g at index %s (%lld non-finite in all); "
                     "--allow-nonfinite runs anyway\n",
                     t.first->flag.c_str(), (*t.second)[i], index_string(i, t.first->array.shape).c_str(),
                     (long long)count_nonfinite(t.second->data(), static_cast<int64_t>(t.second->size())));
        return kExitUsage;
      }
    }
  }

  std::unique_ptr<Runner> runner;
  std::string device_note;
  if (device_flag == "cpu") {
    runner = make_cpu_runner();
  } else {
    std::string why;
    runner = make_cuda_runner(&why);
    if (!runner) {
      if (device_flag == "cuda") return fail("--device cuda: " + why);
      device_note = "--device auto: " + why + "; running on the CPU";
      progress(device_note);
      runner = make_cpu_runner();
    }
  }

  // The library's own checks (tile sizes, scale, ...) before any work; the output buffers do not
  // exist yet, so the memory-overlap part of mala::check() is left to the runner's calls.
  {
    ForwardArgs fa = forward_args(p, tau);
    fa.device = Device::cpu;
    fa.q = p.q.data(), fa.k = p.k.data(), fa.v = p.v.data();
    std::vector<float> dummy(1);
    fa.o = dummy.data();
    Status s = internal::check_arguments(fa);
    if (!s) {
      const std::string msg =
          name_flag(s.message, {{"head_dim", "--q"}, {"block_q", "--bq"}, {"block_k", "--bk"},
                                {"tau", "--tau"}, {"softmax_scale", "--scale"}});
      std::fprintf(stderr, "mala run: %s\n", msg.c_str());
      // A flag's value is a usage error; an input's shape is a failed input.
      return msg.rfind("--q", 0) == 0 || msg.rfind("--", 0) != 0 ? kExitFailure : kExitUsage;
    }
  }

  ForwardResult fwd, fwd0;
  BackwardResult bwd, bwd0;
  Status s;
  progress(format("forward, tau = %g", tau));
  if (!(s = runner->forward(p, tau, &fwd))) return fail("forward: " + s.message);
  if (dout) {
    progress(format("backward, tau = %g", tau));
    if (!(s = runner->backward(p, tau, fwd, &bwd))) return fail("backward: " + s.message);
  }
  if (compare) {
    progress("forward, tau = 0 (--compare)");
    if (!(s = runner->forward(p, 0.f, &fwd0))) return fail("forward (tau = 0): " + s.message);
    if (dout) {
      progress("backward, tau = 0 (--compare)");
      if (!(s = runner->backward(p, 0.f, fwd0, &bwd0)))
        return fail("backward (tau = 0): " + s.message);
    }
  }

  // Non-finite outputs: written all the same (to be looked at), flagged, exit status 3.
  std::vector<std::string> nonfinite;
  {
    const struct {
      const char* name;
      const std::vector<float>* x;
      const std::vector<int64_t>* shape;
    } outs[] = {{"o", &fwd.o, &q.array.shape},
                {"dq", dout ? &bwd.dq : nullptr, &q.array.shape},
                {"dk", dout ? &bwd.dk : nullptr, &k.array.shape},
                {"dv", dout ? &bwd.dv : nullptr, &k.array.shape}};
    for (const auto& o : outs) {
      if (!o.x) continue;
      const int64_t i = first_nonfinite(o.x->data(), static_cast<int64_t>(o.x->size()));
      if (i < 0) continue;
      nonfinite.push_back(o.name);
      std::fprintf(stderr, "mala run: warning: %s: %lld non-finite values (first %g at index %s)\n", o.name,
                   (long long)count_nonfinite(o.x->data(), static_cast<int64_t>(o.x->size())), (*o.x)[i],
                   index_string(i, *o.shape).c_str());
    }
  }

  // Write: staged privately and published as a whole once all are written (cli/out_dir.h);
  // nothing partial on a failure or a SIGINT/SIGTERM.
  const std::vector<int64_t> row_shape =
      batched ? std::vector<int64_t>{p.batch, p.heads_q, p.seqlen_q}
              : std::vector<int64_t>{p.heads_q, p.seqlen_q};
  OutputWriter writer(out_dir, every_output);
  if (!(s = writer.begin())) return fail(s.message);
  if (!(s = writer.put("o.npy", npy::Type::f32, q.array.shape, fwd.o.data())) ||
      !(s = writer.put("lse.npy", npy::Type::f32, row_shape, fwd.lse.data())) ||
      !(s = writer.put("fwd_slots.npy", npy::Type::i32, row_shape, fwd.slots.data())))
    return fail(s.message);
  {
    // The forward's decisions per (query tile, key tile): 0 illegal, 1 skipped, 2 retained (TileState).
    const std::vector<int32_t> mask(fwd.tile_mask.begin(), fwd.tile_mask.end());
    std::vector<int64_t> mask_shape = {p.heads_q, (p.seqlen_q + fwd.tiles.block_q - 1) / fwd.tiles.block_q,
                                       (p.seqlen_k + fwd.tiles.block_k - 1) / fwd.tiles.block_k};
    if (batched) mask_shape.insert(mask_shape.begin(), p.batch);
    if (!(s = writer.put("fwd_tile_mask.npy", npy::Type::i32, mask_shape, mask.data()))) return fail(s.message);
  }
  if (dout) {
    if (!(s = writer.put("dq.npy", npy::Type::f32, q.array.shape, bwd.dq.data())) ||
        !(s = writer.put("dk.npy", npy::Type::f32, k.array.shape, bwd.dk.data())) ||
        !(s = writer.put("dv.npy", npy::Type::f32, k.array.shape, bwd.dv.data())) ||
        !(s = writer.put("bwd_slots.npy", npy::Type::i32, row_shape, bwd.slots.data())))
      return fail(s.message);
  }
  if (!(s = writer.commit())) return fail(s.message);
  const std::vector<std::string>& written = writer.names();
  const std::vector<std::string>& removed = writer.removed();
  const int status = nonfinite.empty() ? 0 : kExitNonfiniteOutput;

  // Summary.
  const Distribution fs =
      slot_stats(fwd.slots.data(), p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, p.causal);
  const double fr = retained_fraction(fwd.tile_mask.data(), fwd.tile_mask.size());
  Distribution bs;
  double br = 0;
  if (dout) {
    bs = slot_stats(bwd.slots.data(), p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, p.causal);
    br = retained_fraction(bwd.tile_mask.data(), bwd.tile_mask.size());
  }
  Distribution om;
  double e_o = 0, e_dq = 0, e_dk = 0, e_dv = 0;
  if (compare) {
    om = omitted_mass(fwd.lse.data(), fwd0.lse.data(), p.rows());
    e_o = relative_l2(fwd.o.data(), fwd0.o.data(), fwd.o.size());
    if (dout) {
      e_dq = relative_l2(bwd.dq.data(), bwd0.dq.data(), bwd.dq.size());
      e_dk = relative_l2(bwd.dk.data(), bwd0.dk.data(), bwd.dk.size());
      e_dv = relative_l2(bwd.dv.data(), bwd0.dv.data(), bwd.dv.size());
    }
  }

  if (json) {
    Json j;
    j.str("device", runner->device()).str("device_name", runner->device_name())
        .integer("batch", p.batch).integer("seqlen_q", p.seqlen_q).integer("seqlen_k", p.seqlen_k)
        .integer("heads_q", p.heads_q).integer("heads_kv", p.heads_kv)
        .integer("head_dim", p.head_dim).boolean("causal", p.causal).num("tau", tau)
        .integer("fwd_block_q", fwd.tiles.block_q).integer("fwd_block_k", fwd.tiles.block_k)
        .object("fwd_slots", dist_json(fs)).num("retained_fraction_fwd", fr).num("fwd_ms", fwd.ms);
    if (dout)
      j.integer("bwd_block_q", bwd.tiles.block_q).integer("bwd_block_k", bwd.tiles.block_k)
          .object("bwd_slots", dist_json(bs)).num("retained_fraction_bwd", br).num("bwd_ms", bwd.ms);
    if (compare) {
      j.object("omitted_mass", dist_json(om)).num("omitted_mass_bound", tau / (1.0 + tau));
      Json err;
      err.num("o", e_o);
      if (dout) err.num("dq", e_dq).num("dk", e_dk).num("dv", e_dv);
      j.object("rel_l2_error_vs_tau0", err);
    }
    j.str("out", out_dir);
    std::string nf = "[";
    for (size_t i = 0; i < nonfinite.size(); ++i) nf += (i ? ", " : "") + json_escape(nonfinite[i]);
    j.raw("nonfinite_outputs", nf + "]");
    std::string rm = "[";
    for (size_t i = 0; i < removed.size(); ++i) rm += (i ? ", " : "") + json_escape(removed[i]);
    j.raw("removed_outputs", rm + "]");
    std::printf("%s\n", j.dump().c_str());
    return status;
  }
  std::printf("mala run: tau = %g on %s [%s]%s\n", tau, runner->device_name().c_str(),
              runner->device().c_str(), device_note.empty() ? "" : " (no GPU: fell back to cpu)");
  std::printf("  shape        batch %lld, Nq %lld, Nk %lld, Hq %lld, Hkv %lld, d %lld, %s\n",
              (long long)p.batch, (long long)p.seqlen_q, (long long)p.seqlen_k,
              (long long)p.heads_q, (long long)p.heads_kv, (long long)p.head_dim,
              p.causal ? "causal" : "non-causal");
  std::printf("  forward      tiles %dx%d, key slots/query mean %.1f P95 %.1f, "
              "tiles retained %.2f%%, %.1f ms\n",
              fwd.tiles.block_q, fwd.tiles.block_k, fs.mean, fs.p95, 100 * fr, fwd.ms);
  if (dout)
    std::printf("  backward     tiles %dx%d, key slots/query mean %.1f P95 %.1f, "
                "tiles retained %.2f%%, %.1f ms\n",
                bwd.tiles.block_q, bwd.tiles.block_k, bs.mean, bs.p95, 100 * br, bwd.ms);
  if (compare) {
    std::printf("  omitted mass mean %.3e P95 %.3e max %.3e (bound tau/(1+tau) = %.4f)\n", om.mean + 0.0,
                om.p95 + 0.0, om.max + 0.0, tau / (1.0 + tau));  // + 0.0: print -0 as 0
    std::printf("  rel. L2 error vs tau = 0: O %.3e", e_o);
    if (dout) std::printf(", dQ %.3e, dK %.3e, dV %.3e", e_dq, e_dk, e_dv);
    std::printf("\n");
  }
  std::printf("  wrote        %s/{", out_dir.c_str());
  for (size_t i = 0; i < written.size(); ++i) std::printf("%s%s", i ? "," : "", written[i].c_str());
  std::printf("}\n");
  if (!removed.empty()) {
    std::printf("  removed      %s/{", out_dir.c_str());
    for (size_t i = 0; i < removed.size(); ++i) std::printf("%s%s", i ? "," : "", removed[i].c_str());
    std::printf("} (an earlier run's outputs that this run does not write)\n");
  }
  return status;
}

}  // namespace cli
}  // namespace mala
