#!/usr/bin/env bash
# End-to-end tests of the `mala` CLI (CTest `cli`): usage, `mala report` (table and --json), and
# `mala run` on .npy files written here with the Python standard library (no numpy), including
# its error cases (missing file, malformed file, mismatched shapes, bad flags: non-zero exit, a
# message naming the argument, and no output directory).
# Usage: bash tests/cli_test.sh path/to/mala
set -uo pipefail
MALA=${1:?usage: cli_test.sh path/to/mala}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
pass() { echo "ok: $*"; }

# expect_exit CODE NAME -- command...   (stdout/stderr saved in $TMP/out, $TMP/err)
expect_exit() {
  local want=$1 name=$2
  shift 3
  "$@" >"$TMP/out" 2>"$TMP/err"
  local got=$?
  if [ "$got" != "$want" ]; then
    fail "$name: exit $got, expected $want"
    sed 's/^/    stderr: /' "$TMP/err" | head -5 >&2
    return 1
  fi
  pass "$name (exit $got)"
}
expect_in() {  # expect_in FILE TEXT NAME
  if grep -qF -- "$2" "$1"; then pass "$3"; else fail "$3: '$2' not in $(basename "$1"): $(head -c 300 "$1")"; fi
}

# ---- usage -------------------------------------------------------------------------------------
expect_exit 0 "mala --help" -- "$MALA" --help && expect_in "$TMP/out" "report" "--help lists report"
expect_exit 2 "mala (no command)" -- "$MALA"
expect_exit 2 "mala bogus" -- "$MALA" bogus && expect_in "$TMP/err" "unknown command 'bogus'" "names the command"
expect_exit 0 "mala report --help" -- "$MALA" report --help && expect_in "$TMP/out" "--sharpness" "report help"
expect_exit 0 "mala run --help" -- "$MALA" run --help && expect_in "$TMP/out" "--out DIR" "run help"
expect_exit 2 "report --tau -1" -- "$MALA" report --n 256 --tau -1 && expect_in "$TMP/err" "--tau: must be finite and >= 0 (got -1)" "names --tau"
# A tau beyond float range is a usage error naming --tau once (it used to exit 1 with "tau: tau must").
if expect_exit 2 "report --tau 1e39" -- "$MALA" report --n 256 --tau 1e39; then
  expect_in "$TMP/err" "mala report: --tau: must be finite and >= 0 (got 1e+39)" "report --tau 1e39 message"
  grep -q "tau: tau" "$TMP/err" && fail "report --tau 1e39 names tau twice: $(cat "$TMP/err")"
fi
expect_exit 0 "mala report -h" -- "$MALA" report -h && expect_in "$TMP/out" "--sharpness" "report -h prints usage"
expect_exit 0 "mala run -h" -- "$MALA" run -h && expect_in "$TMP/out" "--out DIR" "run -h prints usage"
expect_exit 2 "report --n twice" -- "$MALA" report --n 256 --n=512 && expect_in "$TMP/err" "--n: given more than once" "duplicate valued flag"
expect_exit 2 "report --json twice" -- "$MALA" report --json --json && expect_in "$TMP/err" "--json: given more than once" "duplicate switch"
# --version: CMake's project(VERSION), the one place the version is written.
ROOT=$(cd "$(dirname "$0")/.." && pwd)
want_version=$(sed -n 's/^project(mala VERSION \([0-9.]*\).*/\1/p' "$ROOT/CMakeLists.txt")
if expect_exit 0 "mala --version" -- "$MALA" --version; then
  [ -n "$want_version" ] && [ "$(cat "$TMP/out")" = "mala $want_version" ] && pass "--version prints mala $want_version" ||
    fail "--version printed '$(cat "$TMP/out")', CMakeLists.txt says '$want_version'"
fi
expect_exit 2 "report --n abc" -- "$MALA" report --n abc && expect_in "$TMP/err" "--n: expected an integer" "names --n"
expect_exit 2 "report --kv-heads 3" -- "$MALA" report --n 256 --heads 8 --kv-heads 3 && expect_in "$TMP/err" "--kv-heads" "names --kv-heads"
expect_exit 2 "report --frobnicate" -- "$MALA" report --frobnicate && expect_in "$TMP/err" "unknown flag --frobnicate" "names the flag"
expect_exit 2 "report --repeat -1" -- "$MALA" report --repeat -1 && expect_in "$TMP/err" "--repeat: must be >= 0" "names --repeat"
expect_exit 2 "report --regime real" -- "$MALA" report --regime real && expect_in "$TMP/err" "--regime" "names --regime"

# ---- report ------------------------------------------------------------------------------------
if expect_exit 0 "report --n 512" -- "$MALA" report --n 512 --heads 2; then
  for text in "device" "key slots / query, mean" "legal tiles retained" "omitted softmax mass" \
              "bound tau/(1+tau) = 0.5000" "relative L2 error" "reference  exact dense" "ratio"; do
    expect_in "$TMP/out" "$text" "report table has '$text'"
  done
  expect_in "$TMP/err" "mala: [1/4] forward, tau = 1 ..." "progress on stderr"
fi
if expect_exit 0 "report --json" -- "$MALA" report --n 512 --heads 4 --kv-heads 2 --sharpness 6 --json --quiet; then
  [ -s "$TMP/err" ] && fail "--quiet still wrote to stderr: $(cat "$TMP/err")"
  python3 - "$TMP/out" <<'EOF' && pass "report --json content" || fail "report --json content"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["device"] == "cpu" and r["shape"]["seqlen"] == 512 and r["shape"]["heads_kv"] == 2, r
assert r["reference"] == "dense"
assert 0 < r["retained_fraction_fwd"] <= 1 and 0 < r["retained_fraction_bwd"] <= r["retained_fraction_fwd"] + 1e-9
s = r["slots_per_query"]
assert 0 < s["fwd"]["mean"] <= s["fwd_tau0"]["mean"] and s["bwd"]["mean"] <= s["fwd"]["mean"], s
assert s["fwd_tau0"]["mean"] == (512 + 128) / 2, s  # every legal 128-key tile: 128 * (4 + 1) / 2
assert abs(r["omitted_mass_bound"] - 0.5) < 1e-12
assert r["omitted_mass"]["max"] <= 0.5 + 1e-6, r["omitted_mass"]
for key in ("o", "dq", "dk", "dv"):
    assert r["rel_l2_error_tau0"][key] < 1e-5, (key, r["rel_l2_error_tau0"])
    assert 0 <= r["rel_l2_error"][key] < 1, (key, r["rel_l2_error"])
assert r["time"]["fwd_ms"] > 0 and r["time"]["bwd_tau0_ms"] > 0
assert r["nonfinite_outputs"] == [], r["nonfinite_outputs"]
EOF
fi
# tau = 0 is dense attention: everything retained, errors at rounding level.
if expect_exit 0 "report --tau 0 --json" -- "$MALA" report --n 384 --heads 2 --d 64 --tau 0 --regime random --json --quiet --bq 64 --bk 32 --repeat 2; then
  python3 - "$TMP/out" <<'EOF' && pass "tau 0 retains all" || fail "tau 0 retains all"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["retained_fraction_fwd"] == 1 and r["retained_fraction_bwd"] == 1, r
assert r["fwd_block_q"] == 64 and r["fwd_block_k"] == 32, r
assert r["time"]["timed_calls"] == 2, r["time"]
assert max(r["rel_l2_error"].values()) < 1e-5, r["rel_l2_error"]
assert r["omitted_mass"]["max"] < 1e-5
EOF
fi
expect_exit 0 "report --device auto" -- "$MALA" report --n 256 --heads 1 --d 32 --device auto --json --quiet
if grep -q '"device": "cuda"' "$TMP/out"; then
  pass "auto ran on the GPU"
elif grep -q 'running on the CPU' "$TMP/out"; then
  pass "auto fell back to the CPU and says so"
  # No usable GPU here: an explicit --device cuda is a failure that says why.
  expect_exit 1 "report --device cuda without a GPU" -- "$MALA" report --n 256 --device cuda --quiet &&
    expect_in "$TMP/err" "--device cuda:" "names --device"
else
  fail "auto: $(cat "$TMP/out")"
fi

# ---- run: inputs written with the standard library -----------------------------------------
python3 - "$TMP" <<'EOF'
import math, random, struct, sys
d = sys.argv[1]
def save(name, shape, values, descr="<f4"):
    fmt = {"<f4": "f", "<f2": "e", "<f8": "d", "<i4": "i"}[descr]
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (
        descr, "".join("%d, " % s for s in shape) if len(shape) != 1 else "%d," % shape[0])
    pad = 64 - (10 + len(header) + 1) % 64
    header += " " * (pad % 64) + "\n"
    with open(d + "/" + name, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack("<%d%s" % (len(values), fmt), *values))
rng = random.Random(5)
def randn(n): return [rng.gauss(0, 1) for _ in range(n)]
N, HQ, HKV, D = 64, 4, 2, 32
q, k, v, do = randn(N * HQ * D), randn(N * HKV * D), randn(N * HKV * D), randn(N * HQ * D)
save("q.npy", (N, HQ, D), q); save("k.npy", (N, HKV, D), k); save("v.npy", (N, HKV, D), v)
save("do.npy", (N, HQ, D), do)
# Dense causal attention in plain Python, to check `mala run --tau 0`.
scale = 1 / math.sqrt(D)
out = []
for t in range(N):
    for h in range(HQ):
        g = h // (HQ // HKV)
        qv = q[(t * HQ + h) * D:(t * HQ + h + 1) * D]
        s = [scale * sum(a * b for a, b in zip(qv, k[(u * HKV + g) * D:(u * HKV + g + 1) * D])) for u in range(t + 1)]
        m = max(s); p = [math.exp(x - m) for x in s]; z = sum(p)
        out += [sum(p[u] * v[(u * HKV + g) * D + i] for u in range(t + 1)) / z for i in range(D)]
save("o_dense.npy", (N, HQ, D), out)
# Batched float16 inputs with fewer queries than keys (bottom-right causal).
save("q16.npy", (2, 24, 2, 16), randn(2 * 24 * 2 * 16), "<f2")
save("k16.npy", (2, 40, 1, 16), randn(2 * 40 * 16), "<f2")
save("v16.npy", (2, 40, 1, 16), randn(2 * 40 * 16), "<f2")
# Bad inputs.
save("k_bad_d.npy", (N, HKV, 16), randn(N * HKV * 16))
save("k_f64.npy", (N, HKV, D), k, "<f8")
save("v_short.npy", (N, HKV, D), v)
with open(d + "/v_short.npy", "r+b") as f: f.truncate(200)
with open(d + "/garbage.npy", "wb") as f: f.write(b"this is not an npy file at all")
save("k_i32.npy", (N, HKV, D), [int(x * 10) for x in k], "<i4")
# Non-finite inputs: a NaN in k at [3, 1, 7], an inf in q at [10, 2, 0].
k_nan = list(k); k_nan[(3 * HKV + 1) * D + 7] = float("nan")
save("k_nan.npy", (N, HKV, D), k_nan)
q_inf = list(q); q_inf[(10 * HQ + 2) * D] = float("inf")
save("q_inf.npy", (N, HQ, D), q_inf)
EOF

# reads a .npy header: prints "descr shape"
npy_info() {
  python3 - "$1" <<'EOF'
import ast, struct, sys
b = open(sys.argv[1], "rb").read()
assert b[:6] == b"\x93NUMPY", "magic"
n = struct.unpack("<H", b[8:10])[0]
h = ast.literal_eval(b[10:10 + n].decode())
size = {"<f4": 4, "<i4": 4}[h["descr"]]
count = 1
for s in h["shape"]: count *= s
assert len(b) == 10 + n + size * count, "data size"
print(h["descr"], ",".join(map(str, h["shape"])))
EOF
}
check_npy() {  # check_npy FILE "descr shape"
  local got
  got=$(npy_info "$1" 2>&1)
  [ "$got" = "$2" ] && pass "$(basename "$1"): $2" || fail "$(basename "$1"): got '$got', expected '$2'"
}

I="$TMP"
if expect_exit 0 "run with --do" -- "$MALA" run --q "$I/q.npy" --k "$I/k.npy" --v "$I/v.npy" --do "$I/do.npy" --out "$I/o1" --bq 16 --bk 16 --compare; then
  check_npy "$I/o1/o.npy" "<f4 64,4,32"
  check_npy "$I/o1/lse.npy" "<f4 4,64"
  check_npy "$I/o1/fwd_slots.npy" "<i4 4,64"
  check_npy "$I/o1/dq.npy" "<f4 64,4,32"
  check_npy "$I/o1/dk.npy" "<f4 64,2,32"
  check_npy "$I/o1/dv.npy" "<f4 64,2,32"
  check_npy "$I/o1/bwd_slots.npy" "<i4 4,64"
  expect_in "$TMP/out" "key slots/query mean" "run prints the realized work"
  expect_in "$TMP/out" "omitted mass" "run --compare prints omitted mass"
fi
if expect_exit 0 "run --tau 0 (forward only)" -- "$MALA" run --q "$I/q.npy" --k "$I/k.npy" --v "$I/v.npy" --out "$I/o0" --tau 0 --bq 16 --bk 32; then
  [ -e "$I/o0/dq.npy" ] && fail "forward-only run wrote dq.npy"
  python3 - "$I/o0/o.npy" "$I/o_dense.npy" "$I/o0/fwd_slots.npy" <<'EOF' && pass "run --tau 0 equals dense attention; slots count retained keys" || fail "run --tau 0 values"
import struct, sys
def load(p):
    b = open(p, "rb").read(); n = struct.unpack("<H", b[8:10])[0]; data = b[10 + n:]
    fmt = "f" if b"<f4" in b[10:10 + n] else "i"
    return struct.unpack("<%d%s" % (len(data) // 4, fmt), data)
o, ref, slots = load(sys.argv[1]), load(sys.argv[2]), load(sys.argv[3])
err = max(abs(a - b) for a, b in zip(o, ref))
assert err < 1e-4, err
# [Hq, N]: at tau = 0 every legal key tile (Bk = 32) of row t is retained: ceil((t+1)/32)*32.
for h in range(4):
    for t in range(64):
        assert slots[h * 64 + t] == ((t + 1 + 31) // 32) * 32, (h, t, slots[h * 64 + t])
EOF
fi
# A forward-only run into o1 (which holds the backward outputs of the run with --do) removes those:
# left in place they would read as this run's.  Files that are not outputs stay, and a symlink at
# an output name goes without its target being touched.
echo mine >"$I/o1/notes.txt"
echo precious >"$I/o1_victim"
rm -f "$I/o1/bwd_slots.npy" && ln -s "$I/o1_victim" "$I/o1/bwd_slots.npy"
if expect_exit 0 "run forward-only over a run with --do" -- "$MALA" run --q "$I/q.npy" --k "$I/k.npy" --v "$I/v.npy" --out "$I/o1"; then
  [ "$(cd "$I/o1" && ls -A | sort | tr '\n' ' ')" = "fwd_slots.npy fwd_tile_mask.npy lse.npy notes.txt o.npy " ] &&
    pass "forward-only run: the earlier backward outputs are removed, other files kept" ||
    fail "forward-only run left: $(ls -A "$I/o1")"
  [ "$(cat "$I/o1_victim")" = precious ] && pass "a symlinked output is removed, not followed" || fail "symlink target changed"
  expect_in "$TMP/out" "removed      $I/o1/{dq.npy,dk.npy,dv.npy,bwd_slots.npy}" "run names the removed outputs"
fi
if expect_exit 0 "run --json with --do, then forward-only --json" -- "$MALA" run --q "$I/q.npy" --k "$I/k.npy" --v "$I/v.npy" --do "$I/do.npy" --out "$I/o1" --json --quiet; then
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['removed_outputs']==[], r" "$TMP/out" &&
    pass "run --json: removed_outputs empty when nothing is removed" || fail "run --json removed_outputs: $(cat "$TMP/out")"
  if expect_exit 0 "forward-only --json" -- "$MALA" run --q "$I/q.npy" --k "$I/k.npy" --v "$I/v.npy" --out "$I/o1" --json --quiet; then
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['removed_outputs']==['dq.npy','dk.npy','dv.npy','bwd_slots.npy'], r" "$TMP/out" &&
      pass "run --json lists removed_outputs" || fail "run --json removed_outputs: $(cat "$TMP/out")"
  fi
fi
if expect_exit 0 "run batched float16, Nq < Nk" -- "$MALA" run --q "$I/q16.npy" --k "$I/k16.npy" --v "$I/v16.npy" --do "$I/q16.npy" --out "$I/o16" --json --quiet; then
  check_npy "$I/o16/o.npy" "<f4 2,24,2,16"
  check_npy "$I/o16/lse.npy" "<f4 2,2,24"
  check_npy "$I/o16/dk.npy" "<f4 2,40,1,16"
  check_npy "$I/o16/bwd_slots.npy" "<i4 2,2,24"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['seqlen_q']==24 and r['seqlen_k']==40" "$TMP/out" \
    && pass "run --json" || fail "run --json: $(cat "$TMP/out")"
fi

# ---- run: errors name the argument and write nothing ------------------------------------------
run_error() {  # run_error NAME CODE EXPECTED_TEXT args...
  local name=$1 code=$2 text=$3
  shift 3
  rm -rf "$I/bad"
  expect_exit "$code" "$name" -- "$MALA" run "$@" --out "$I/bad" && expect_in "$TMP/err" "$text" "$name: message"
  [ -e "$I/bad" ] && fail "$name: wrote $I/bad" || pass "$name: no output directory"
}
Q=(--q "$I/q.npy")
run_error "missing file" 1 "--k: $I/nope.npy: cannot open" "${Q[@]}" --k "$I/nope.npy" --v "$I/v.npy"
run_error "malformed npy" 1 "--v: $I/garbage.npy: not a .npy file" "${Q[@]}" --k "$I/k.npy" --v "$I/garbage.npy"
run_error "truncated npy" 1 "--v: $I/v_short.npy: truncated data" "${Q[@]}" --k "$I/k.npy" --v "$I/v_short.npy"
run_error "float64 input" 1 "unsupported dtype '<f8'" "${Q[@]}" --k "$I/k_f64.npy" --v "$I/v.npy"
run_error "mismatched head_dim" 1 "--k: shape [64,2,16] does not match --q [64,4,32] (head_dim differs)" \
  "${Q[@]}" --k "$I/k_bad_d.npy" --v "$I/k_bad_d.npy"
run_error "v differs from k" 1 "--v: shape [64,4,32] does not match --k [64,2,32]" "${Q[@]}" --k "$I/k.npy" --v "$I/q.npy"
run_error "do differs from q" 1 "--do: shape [64,2,32] does not match --q" "${Q[@]}" --k "$I/k.npy" --v "$I/v.npy" --do "$I/k.npy"
run_error "rank mismatch" 1 "--k: shape [2,40,1,16] does not match --q [64,4,32] (rank differs)" "${Q[@]}" --k "$I/k16.npy" --v "$I/k16.npy"
run_error "tau < 0" 2 "--tau: must be finite and >= 0 (got -0.5)" "${Q[@]}" --k "$I/k.npy" --v "$I/v.npy" --tau -0.5
run_error "tau 1e39" 2 "mala run: --tau: must be finite and >= 0 (got 1e+39)" "${Q[@]}" --k "$I/k.npy" --v "$I/v.npy" --tau 1e39
run_error "duplicate --k" 2 "--k: given more than once" "${Q[@]}" --k "$I/k.npy" --k "$I/k.npy" --v "$I/v.npy"
run_error "int32 input" 1 "--k: $I/k_i32.npy: unsupported dtype '<i4' (int32) (supported: '<f4' float32, '<f2' float16)" \
  "${Q[@]}" --k "$I/k_i32.npy" --v "$I/v.npy"
mkdir -p "$I/adir"
run_error "directory as input" 1 "--v: $I/adir: is a directory" "${Q[@]}" --k "$I/k.npy" --v "$I/adir"
run_error "NaN input" 2 "--k: non-finite value nan at index [3,1,7]" "${Q[@]}" --k "$I/k_nan.npy" --v "$I/v.npy"
run_error "inf input" 2 "--q: non-finite value inf at index [10,2,0]" --q "$I/q_inf.npy" --k "$I/k.npy" --v "$I/v.npy"
run_error "scale 0" 2 "--scale: must be > 0" "${Q[@]}" --k "$I/k.npy" --v "$I/v.npy" --scale 0
run_error "missing --v" 2 "--v: required" "${Q[@]}" --k "$I/k.npy"
rm -rf "$I/bad"

# --allow-nonfinite runs; the NaN reaches o, which is written, flagged, and exits 3.
if expect_exit 3 "run --allow-nonfinite" -- "$MALA" run --q "$I/q.npy" --k "$I/k_nan.npy" --v "$I/v.npy" --out "$I/onan" --allow-nonfinite --quiet --json; then
  expect_in "$TMP/err" "mala run: warning: o: " "non-finite output warned"
  check_npy "$I/onan/o.npy" "<f4 64,4,32"
  expect_in "$TMP/out" '"nonfinite_outputs": ["o"]' "run --json lists non-finite outputs"
fi

# --out is checked before any work: a file on the path, an output name that is a directory.
RUNQKV=(run --q "$I/q.npy" --k "$I/k.npy" --v "$I/v.npy")
if expect_exit 1 "--out under a file" -- "$MALA" "${RUNQKV[@]}" --out "$I/q.npy/sub"; then
  expect_in "$TMP/err" "--out: $I/q.npy: not a directory" "--out under a file: message"
  grep -q "forward" "$TMP/err" && fail "--out under a file: computed before checking --out"
fi
mkdir -p "$I/hasdir/lse.npy"
if expect_exit 1 "--out with a directory named lse.npy" -- "$MALA" "${RUNQKV[@]}" --out "$I/hasdir"; then
  expect_in "$TMP/err" "--out: $I/hasdir/lse.npy: is a directory" "--out lse.npy directory: message"
  grep -q "forward" "$TMP/err" && fail "--out lse.npy directory: computed before checking --out"
  [ "$(ls -A "$I/hasdir")" = "lse.npy" ] || fail "--out lse.npy directory: wrote $(ls -A "$I/hasdir")"
fi

# Writes are atomic: with a file-size limit (SIGXFSZ ignored, so write() fails with EFBIG) the run
# fails with the system's reason, leaves no new directory, and leaves an existing one as it was.
limited() { bash -c 'trap "" XFSZ; ulimit -f 8; exec "$@"' limited "$@"; }
if expect_exit 1 "write fails (file size limit)" -- limited "$MALA" "${RUNQKV[@]}" --out "$I/full/deep" --quiet; then
  expect_in "$TMP/err" "write failed (File too large)" "write error carries strerror"
  [ -e "$I/full" ] && fail "failed write left $I/full: $(find "$I/full")" || pass "failed write: no directory left"
fi
mkdir -p "$I/keep"
echo old >"$I/keep/o.npy"
if expect_exit 1 "write fails into an existing directory" -- limited "$MALA" "${RUNQKV[@]}" --out "$I/keep" --quiet; then
  [ "$(ls -A "$I/keep")" = "o.npy" ] && [ "$(cat "$I/keep/o.npy")" = old ] && pass "existing directory untouched" ||
    fail "existing directory changed: $(ls -A "$I/keep")"
fi
# A successful run replaces a read-only existing file (by rename) and leaves no temporaries.
chmod 444 "$I/keep/o.npy"
if expect_exit 0 "run over a read-only o.npy" -- "$MALA" "${RUNQKV[@]}" --out "$I/keep" --quiet; then
  check_npy "$I/keep/o.npy" "<f4 64,4,32"
  [ -z "$(find "$I/keep" -name '*.tmp-*' -o -name '.*staging*')" ] && pass "no temporaries left" || fail "temporaries left: $(ls -A "$I/keep")"
fi

# A symlink planted at a predictable temporary name is not followed (issue #64 D7): the run's
# temporaries used to be DIR/.<name>.tmp-<pid>; sh -c plants links for its own pid, which exec
# hands to mala.  The victim keeps its bytes and o.npy is a regular file.
mkdir -p "$I/plant"
echo precious >"$I/victim"
if expect_exit 0 "run with planted symlinks" -- sh -c 'for n in o lse fwd_slots fwd_tile_mask; do
    ln -s "$1" "$2/.$n.npy.tmp-$$"; done; shift 2; exec "$@"' plant "$I/victim" "$I/plant" \
    "$MALA" "${RUNQKV[@]}" --out "$I/plant" --quiet; then
  [ "$(cat "$I/victim")" = precious ] && pass "planted symlink not followed" || fail "victim overwritten through a planted symlink"
  [ -f "$I/plant/o.npy" ] && [ ! -L "$I/plant/o.npy" ] && pass "o.npy is a regular file" || fail "o.npy: $(ls -l "$I/plant")"
fi

# SIGTERM / SIGINT during the write phase (D8): the run ends by the signal (128 + n) and leaves
# nothing: no new --out directory, no parent it made, no staged file in an existing directory.
# (MALA_TEST_SIGNAL_AFTER_FIRST_OUTPUT raises the signal after the first output is staged.)
for sig in TERM INT; do
  want=$([ $sig = TERM ] && echo 143 || echo 130)
  rm -rf "$I/sig"
  if expect_exit $want "SIG$sig while writing a new --out" -- env MALA_TEST_SIGNAL_AFTER_FIRST_OUTPUT=$sig \
      "$MALA" "${RUNQKV[@]}" --out "$I/sig/new/out" --quiet; then
    [ -e "$I/sig" ] && fail "SIG$sig left $(find "$I/sig")" || pass "SIG$sig: nothing left of a new --out"
  fi
  mkdir -p "$I/sigkeep" && rm -rf "$I/sigkeep"/* "$I/sigkeep"/.[!.]* && echo old >"$I/sigkeep/o.npy"
  if expect_exit $want "SIG$sig while writing into an existing --out" -- env MALA_TEST_SIGNAL_AFTER_FIRST_OUTPUT=$sig \
      "$MALA" "${RUNQKV[@]}" --out "$I/sigkeep" --quiet; then
    [ "$(ls -A "$I/sigkeep")" = "o.npy" ] && [ "$(cat "$I/sigkeep/o.npy")" = old ] && pass "SIG$sig: existing --out untouched" ||
      fail "SIG$sig: existing --out changed: $(ls -A "$I/sigkeep")"
  fi
done

# Two runs into one --out publish whole sets (D9): run A pauses between its publishing renames
# (MALA_TEST_PUBLISH_DELAY_MS), run B with other inputs starts meanwhile; afterwards o.npy and
# lse.npy come from the same run (each run's o.npy has a different shape, and so has its lse.npy).
mkdir -p "$I/race"
env MALA_TEST_PUBLISH_DELAY_MS=400 "$MALA" "${RUNQKV[@]}" --out "$I/race" --quiet >/dev/null 2>&1 &
pid_a=$!
sleep 0.2
"$MALA" run --q "$I/q16.npy" --k "$I/k16.npy" --v "$I/v16.npy" --out "$I/race" --quiet >/dev/null 2>&1
wait $pid_a
o_shape=$(npy_info "$I/race/o.npy")
lse_shape=$(npy_info "$I/race/lse.npy")
case "$o_shape|$lse_shape" in
  "<f4 64,4,32|<f4 4,64" | "<f4 2,24,2,16|<f4 2,2,24") pass "concurrent runs: one run's whole set ($o_shape)" ;;
  *) fail "concurrent runs mixed their outputs: o $o_shape, lse $lse_shape" ;;
esac
[ -z "$(find "$I/race" -name '.*staging*')" ] && pass "concurrent runs: no staging left" || fail "staging left: $(ls -A "$I/race")"

expect_exit 2 "run without --out" -- "$MALA" run --q "$I/q.npy" --k "$I/k.npy" --v "$I/v.npy" && expect_in "$TMP/err" "--out: required" "names --out"

# ---- scripts/dev.sh, with a stand-in cmake (nothing is built): stdout carries only the step's ----
# output, and an unknown step is refused before anything is built.
mkdir -p "$TMP/bin" "$TMP/devbuild/cli"
printf '#!/usr/bin/env bash\necho "-- cmake stand-in: $*"\necho "$*" >>"%s/cmake_calls"\n' "$TMP" >"$TMP/bin/cmake"
chmod +x "$TMP/bin/cmake"
ln -sf "$(cd "$(dirname "$MALA")" && pwd)/$(basename "$MALA")" "$TMP/devbuild/cli/mala"
if expect_exit 0 "dev.sh report --json" -- env PATH="$TMP/bin:$PATH" BUILD_DIR="$TMP/devbuild" \
    bash "$ROOT/scripts/dev.sh" report --n 128 --heads 1 --d 16 --json --quiet; then
  python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$TMP/out" && pass "dev.sh report --json: stdout is JSON only" ||
    fail "dev.sh report --json stdout is not one JSON object: $(head -c 300 "$TMP/out")"
  expect_in "$TMP/err" "cmake stand-in" "dev.sh: build output on stderr"
fi
rm -f "$TMP/cmake_calls"
if expect_exit 2 "dev.sh bogus" -- env PATH="$TMP/bin:$PATH" BUILD_DIR="$TMP/devbuild" bash "$ROOT/scripts/dev.sh" bogus; then
  expect_in "$TMP/err" "unknown step 'bogus'" "dev.sh bogus names the step"
  [ -e "$TMP/cmake_calls" ] && fail "dev.sh bogus ran cmake before refusing: $(cat "$TMP/cmake_calls")" || pass "dev.sh bogus: refused before building"
fi

if [ "$failures" -gt 0 ]; then
  echo "cli_test: $failures failure(s)" >&2
  exit 1
fi
echo "cli_test: all passed"
