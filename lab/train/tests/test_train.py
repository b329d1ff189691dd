"""CPU tests of the training study (lab/train): the corpus build, the split, the FLOP accounting,
the schedule, the arms' agreement on their step count, and a few steps of each arm."""

import gzip
import json
import os
import subprocess
import sys

import pytest

np = pytest.importorskip("numpy")
tokenizers = pytest.importorskip("tokenizers")

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.dirname(HERE)
sys.path.insert(0, TRAIN)

import configs  # noqa: E402
import code_corpus as corpus  # noqa: E402
import tokenizer as tok_mod  # noqa: E402


def make_roots(base):
    """Two roots of small packages; one file's bytes appear in two packages."""
    py, inc = base / "py", base / "inc"
    for p in range(12):
        d = py / f"pkg{p:02d}"
        d.mkdir(parents=True)
        for i in range(6):
            (d / f"m{i}.py").write_text(f"def f_{p}_{i}(x):\n    return x * {p} + {i}\n\nclass K{p}{i}:\n    pass\n")
        (d / "shared.py").write_text("import os\n\nVALUE = os.sep\n")  # identical in every package
    (py / "pkg00" / "__pycache__").mkdir()
    (py / "pkg00" / "__pycache__" / "x.py").write_text("skipped = True\n")
    (py / "pkg00" / "notes.txt").write_text("not code\n")
    (py / "pkg01" / "bin.py").write_bytes(b"\xff\xfe not utf-8")
    for p in range(8):
        d = inc / f"lib{p}"
        d.mkdir(parents=True)
        for i in range(4):
            (d / f"h{i}.h").write_text(f"#pragma once\nint lib{p}_fn{i}(int x);\n")
    cxx = inc / "c++" / "12"
    cxx.mkdir(parents=True)
    (cxx / "vector").write_text("#pragma once\nnamespace std { template <class T> class vector; }\n")
    return {"py": str(py), "inc": str(inc)}


@pytest.fixture()
def roots(tmp_path):
    return make_roots(tmp_path / "roots")


def small_tokenizer(rows, header):
    return tok_mod.train_tokenizer(corpus.load_split(rows, header, "train"), vocab_size=400)


def test_scan_selects_code_files_and_is_deterministic(roots, tmp_path):
    rows, header = corpus.scan(roots, 0.2, 0.15)
    rows2, header2 = corpus.scan(roots, 0.2, 0.15)
    assert rows == rows2 and header == header2
    paths = {(r[3], r[4]) for r in rows}
    assert ("inc", "c++/12/vector") in paths  # suffix-less C++ standard headers count as headers
    assert not any("__pycache__" in p or p.endswith(".txt") or p.endswith("bin.py") for _, p in paths)
    corpus.write_manifest(rows, header, str(tmp_path / "a"))
    corpus.write_manifest(rows2, header2, str(tmp_path / "b"))
    for f in ("manifest.tsv.gz", "manifest.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    back, _ = corpus.read_manifest(str(tmp_path / "a"))
    assert back == rows


def test_heldout_split_never_overlaps_training(roots):
    rows, header = corpus.scan(roots, 0.2, 0.15)
    held = [r for r in rows if r[0] == "heldout"]
    train = [r for r in rows if r[0] == "train"]
    assert held and train
    # Whole packages: no package has files in both splits.
    pk = lambda r: (r[3], corpus.package_of(r[4]))  # noqa: E731
    assert not {pk(r) for r in held} & {pk(r) for r in train}
    assert {pk(r) for r in held} <= {(root, p) for root, ps in header["heldout_packages"].items() for p in ps}
    # No document in both: shared.py's bytes sit in every package, so only one copy survives.
    assert not {r[1] for r in held} & {r[1] for r in train}
    assert len({r[1] for r in rows}) == len(rows)


def test_build_gives_the_same_streams_from_the_same_manifest(roots, tmp_path):
    rows, header = corpus.scan(roots, 0.2, 0.15)
    tok = small_tokenizer(rows, header)
    infos = []
    for name in ("a", "b"):
        d = str(tmp_path / name)
        corpus.write_manifest(rows, header, d)
        infos.append(corpus.build(d, tok, seed=42))
    assert infos[0] == infos[1]
    a = np.load(tmp_path / "a" / "train.npy")
    sep = tok.token_to_id(corpus.SEPARATOR)
    assert a.dtype == np.uint16 and int((a == sep).sum()) == infos[0]["train_files"]
    # Another seed reorders the training documents, not their tokens.
    other = corpus.build(str(tmp_path / "a"), tok, seed=7)
    assert other["train_sha256"] != infos[0]["train_sha256"]
    assert other["train_tokens"] == infos[0]["train_tokens"] and other["heldout_sha256"] == infos[0]["heldout_sha256"]


def test_build_refuses_a_changed_file(roots, tmp_path):
    rows, header = corpus.scan(roots, 0.2, 0.15)
    tok = small_tokenizer(rows, header)
    d = str(tmp_path / "m")
    corpus.write_manifest(rows, header, d)
    split, sha, n, root, rel = next(r for r in rows if r[0] == "train")
    with open(os.path.join(roots[root], rel), "a") as f:
        f.write("# edited\n")
    with pytest.raises(ValueError, match="1 train files missing or changed"):
        corpus.build(d, tok)


def test_committed_manifest_and_tokenizer_agree():
    d = os.path.join(TRAIN, "corpus")
    rows, header = corpus.read_manifest(d)
    counts = {s: sum(1 for r in rows if r[0] == s) for s in ("train", "heldout")}
    assert counts == {s: header["counts"][s]["files"] for s in counts}
    assert not {r[1] for r in rows if r[0] == "heldout"} & {r[1] for r in rows if r[0] == "train"}
    tok = tokenizers.Tokenizer.from_file(os.path.join(TRAIN, "tokenizer.json"))
    assert tok.get_vocab_size() == configs.VOCAB and tok.token_to_id(corpus.SEPARATOR) == 0
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text).ids) == text


def test_attention_flops_match_a_hand_computation():
    # n = 4096, 4 heads of 128, 4 layers: a = 2048.5, h d = 512.
    assert configs.attention_flops_per_token(4096, 4, 128, 4) == 4 * 14 * 2048.5 * 512 == 58_734_592
    # s_f = 1000, s_b = 1200 in every layer: 4 a hd + 4 s_b hd + 2 s_f hd + 4 s_b hd per layer.
    per_layer = 4 * 2048.5 * 512 + 4 * 1200 * 512 + 2 * 1000 * 512 + 4 * 1200 * 512
    assert per_layer == 10_134_528
    assert configs.attention_flops_per_token(4096, 4, 128, 4, 1000, 1200) == 4 * per_layer
    # Per-layer lists, and the dense count when every layer keeps a slots per query.
    assert configs.attention_flops_per_token(4096, 4, 128, 2, [1000, 2048.5], [1200, 2048.5]) == \
        per_layer + 14 * 2048.5 * 512
    with pytest.raises(ValueError, match="s_f / s_b"):
        configs.attention_flops_per_token(4096, 4, 128, 3, [1, 2], [1, 2])


def test_wsd_schedule():
    peak, total = 1e-3, 1000
    lrs = [configs.wsd_lr(s, total, peak) for s in range(total)]
    assert lrs[0] == pytest.approx(peak / configs.WARMUP_STEPS)
    assert lrs[configs.WARMUP_STEPS] == peak and lrs[799] == peak
    assert all(a >= b for a, b in zip(lrs[800:], lrs[801:]))
    assert lrs[-1] == pytest.approx(configs.LCT_LR_FACTOR * peak)


def test_both_arms_agree_on_the_step_count(tmp_path):
    train = pytest.importorskip("train")
    kw = dict(step_now=40, max_steps=10_000, wait_s=0)
    # Each arm writes its own numbers; the second to arrive reads the first's.
    first = train.agree_steps(str(tmp_path), "s_pt", "dense", 300.0, 250.0, **kw)
    second = train.agree_steps(str(tmp_path), "s_pt", "mala", 420.0, 251.3, **kw)
    again = train.agree_steps(str(tmp_path), "s_pt", "dense", 300.0, 250.0, **kw)
    assert second[0] == again[0] == train.steps_for(420.0, 250.0, 40, 10_000)
    assert first[0] >= second[0]  # alone, the dense arm planned with its own, faster time


def run_arm(tmp_path, data, tok_path, arm, steps=30, stage="pt", seqlen=64, seed=configs.SEED, extra=()):
    cmd = [sys.executable, os.path.join(TRAIN, "train.py"), "--size", "tiny", "--arm", arm, "--stage", stage,
           "--seed", str(seed),
           "--data", data, "--tokenizer", tok_path, "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
           "--seqlen", str(seqlen), "--tokens-per-step", "512", "--steps", str(steps), "--eval-every", "10",
           "--eval-lengths", "32,64", "--eval-tokens", "64", "--device", "cpu", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    tag = f"tiny_{arm}_{stage}" + ("" if seed == configs.SEED else f"_s{seed}")
    with open(tmp_path / "out" / f"train_{tag}.json") as f:
        return json.load(f)


def run_analyze(tmp_path, data, tok_path, cmd, arm, *args):
    """analyze.py CMD on the tiny model's pre-training run of ARM (CPU); its JSON (CMD.json)."""
    argv = [sys.executable, os.path.join(TRAIN, "analyze.py"), cmd, "--size", "tiny", "--arm", arm, "--stage", "pt",
            "--data", data, "--tokenizer", tok_path, "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
            "--device", "cpu", *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "out" / f"{cmd}.json") as f:
        return json.load(f)


def test_a_few_steps_of_each_arm_lower_the_loss(roots, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("mala")
    rows, header = corpus.scan(roots, 0.2, 0.15)
    tok = small_tokenizer(rows, header)
    data = str(tmp_path / "data")
    corpus.write_manifest(rows, header, data)
    corpus.build(data, tok)
    tok_path = str(tmp_path / "tok.json")
    tok.save(tok_path)
    recs = {arm: run_arm(tmp_path, data, tok_path, arm) for arm in ("dense", "mala", "mala0", "dense_ea")}
    for arm, rec in recs.items():
        first, last = rec["evals"][0], rec["evals"][-1]
        assert last["step"] == 30 and rec["final"]["tokens"] == 30 * 512
        assert last["len_64"]["loss"] < first["len_64"]["loss"] - 0.5, arm
        assert rec["steps"][-1]["loss"] < rec["steps"][0]["loss"], arm
        # The kernels' counters are read on the held-out batch for either arm.
        assert all(x["fwd_slots"] > 0 and x["bwd_slots"] > 0 for x in last["len_64"]["layers"])
    # Same init and data: at step 0 both arms evaluate the same model.
    assert recs["dense"]["evals"][0]["len_64"]["loss"] == pytest.approx(recs["mala"]["evals"][0]["len_64"]["loss"],
                                                                      rel=1e-6)
    # The control arm trains through MALA's kernels at tau = 0: exact attention, so (fp32 on the CPU)
    # it follows the dense arm up to rounding.
    assert recs["mala0"]["tau"] == 0.0 and recs["mala"]["tau"] == 1.0
    for a, b in zip(recs["mala0"]["steps"], recs["dense"]["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    # So does the noise-floor arm, SDPA held to its second exact kernel.
    assert recs["dense_ea"]["tau"] == 0.0
    for a, b in zip(recs["dense_ea"]["steps"], recs["dense"]["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    # The long-context stage starts from the pre-training weights, at LCT_LR_FACTOR x peak.
    lct = run_arm(tmp_path, data, tok_path, "mala", steps=5, stage="lct", seqlen=128)
    assert lct["evals"][0]["len_64"]["loss"] == pytest.approx(recs["mala"]["evals"][-1]["len_64"]["loss"], rel=1e-5)
    assert lct["steps"][-1]["lr"] == pytest.approx(configs.SIZES["tiny"]["lr"] * configs.LCT_LR_FACTOR)
    # The regime step on the trained tiny model (CPU): slots and the Fig. 2 fidelity per layer. At 64 keys
    # a row has one key tile, always retained, so MALA omits nothing there.
    regime = run_analyze(tmp_path, data, tok_path, "regime", "mala", "--lengths", "32,64", "--sequences", "1")
    regime = regime["tiny_mala_pt"]
    layers = regime["fidelity"]["64"][0]
    assert len(layers) == configs.SIZES["tiny"]["layers"]
    for layer in layers:
        assert layer["omitted_mean"] == [0.0] * configs.SIZES["tiny"]["heads"] and max(layer["o_err"]) == 0.0
        assert layer["fwd_retained"] == [1.0] * configs.SIZES["tiny"]["heads"]
    # The gradient's fidelity on the trained dense model: on the CPU (fp32, no autocast) every
    # attention's gradient equals the reference up to fp32 rounding, MALA's at tau = 0 too.
    grads = run_analyze(tmp_path, data, tok_path, "grads", "dense", "--seqlen", "64", "--sequences", "2",
                        "--batches", "2")
    grads = grads["tiny_dense_pt_64"]
    assert grads["sequences"] == 2 and grads["batches"] == 2
    assert set(grads["attention"]) == {"sdpa", "sdpa_ea", "mala_tau0", "mala_tau1"}
    for label in ("sdpa", "sdpa_ea", "mala_tau0"):
        g = grads["attention"][label]
        assert len(g["per_batch"]) == 2 and len(g["attn_bias_ci95"]) == 3, label
        assert g["grad_rel_err"] < 1e-4 and g["grad_cosine"] > 0.9999, label
        # Against the fp32-attention reference too (on the CPU the same arithmetic): no error, no bias.
        assert g["attn_rel_err"] < 1e-4 and abs(g["attn_bias"]) < 1e-5, label
        assert g["loss"] == pytest.approx(grads["loss_reference"], rel=1e-5), label
    # The two batches are different sequences, so their losses differ.
    b0, b1 = grads["attention"]["sdpa"]["per_batch"]
    assert b0["loss_reference"] != pytest.approx(b1["loss_reference"], rel=1e-4)
    assert grads["attention"]["mala_tau0"]["rel_to_sdpa"] < 1e-4
    # The gradient probe during training: at step 0, every --grad-probe-every steps and at the end;
    # on the CPU (fp32) every exact attention's gradient equals fp32 attention's, and the probe
    # leaves the run's attention as it was: the probed run's losses equal the unprobed run's.
    probed = run_arm(tmp_path, data, tok_path, "mala", steps=12, seed=11,
                     extra=("--grad-probe-every", "5", "--grad-probe-batches", "2", "--grad-probe-sequences", "1"))
    plain = run_arm(tmp_path, data, tok_path, "mala", steps=12, seed=11)
    assert [p["step"] for p in probed["grad_probes"]] == [0, 5, 10, 12] and plain["grad_probes"] == []
    for p in probed["grad_probes"]:
        assert p["batches"] == 2 and set(p["attention"]) == {"sdpa", "sdpa_ea", "mala_tau0", "mala_tau1"}
        for label in ("sdpa", "sdpa_ea", "mala_tau0"):
            assert p["attention"][label]["attn_rel_err"] < 1e-4, (p["step"], label)
    assert [s["loss"] for s in probed["steps"]] == pytest.approx([s["loss"] for s in plain["steps"]], rel=1e-6)
    assert probed["tau"] == 1.0
    # Another seed: other initial weights (and data order), recorded under its own name.
    other = run_arm(tmp_path, data, tok_path, "dense", steps=2, seed=7)
    assert other["seed"] == 7
    assert other["evals"][0]["len_64"]["loss"] != pytest.approx(recs["dense"]["evals"][0]["len_64"]["loss"], rel=1e-4)


def test_the_second_exact_attention_equals_sdpa_with_grouped_heads():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("mala")
    import attn

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 48, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 48, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 48, 16, generator=g, requires_grad=True)
    out, w = attn._sdpa_ea_attention(None, q, k, v, None, scaling=0.3)
    assert w is None and out.shape == (2, 48, 4, 16)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    gq, gk = torch.autograd.grad(out.square().sum(), (q, k))
    rq, rk = torch.autograd.grad(ref.square().sum(), (q, k))
    torch.testing.assert_close(gq, rq, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gk, rk, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="attention_mask"):
        attn._sdpa_ea_attention(None, q, k, v, torch.ones(1))


def test_manifest_is_gzip_text(tmp_path, roots):
    rows, header = corpus.scan(roots, 0.2, 0.15)
    corpus.write_manifest(rows, header, str(tmp_path))
    with gzip.open(tmp_path / "manifest.tsv.gz", "rt") as f:
        first = f.readline().rstrip("\n").split("\t")
    assert first[0] in ("train", "heldout") and len(first[1]) == 64 and int(first[2]) > 0


def test_compiled_loss_equals_the_eager_loss():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import train

    model = train.build_model("tiny", 512, "dense", torch.device("cpu"), None, 0)
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    grads = []
    for compiled in (False, True):
        model.zero_grad(set_to_none=True)
        loss = train.sequence_loss(model, x, chunk=48, compiled=compiled)
        loss.backward()
        grads.append((float(loss), model.lm_head.weight.grad.clone()))
    assert grads[1][0] == pytest.approx(grads[0][0], rel=1e-5)
    assert torch.allclose(grads[1][1], grads[0][1], rtol=1e-4, atol=1e-6)


def test_the_gradient_probe_restores_the_runs_attention():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("mala")
    import attn
    import gradcheck
    import train

    attn.register(0.0)
    model = train.build_model("tiny", 512, "dense_ea", torch.device("cpu"), None, 0)
    x = [torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(b)) for b in range(2)]
    res = gradcheck.probe(model, x, torch.device("cpu"), 1.0, ("sdpa_ea", 0.0))
    # The probe ends on MALA at tau = 1; the run's own attention and tau are back.
    assert model.config._attn_implementation == "sdpa_ea" and attn.RECORD["tau"] == 0.0
    assert all(p.grad is None for p in model.parameters())
    assert res["batches"] == 2 and len(res["attention"]["mala_tau1"]["per_batch"]) == 2
    # Each batch's reference loss is its own.
    b0, b1 = res["attention"]["sdpa"]["per_batch"]
    assert b0["loss_reference"] != pytest.approx(b1["loss_reference"], rel=1e-4)


def test_probe_batches_are_disjoint_and_a_shortfall_names_the_arguments():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("mala")
    import gradcheck

    seqs = np.arange(40).reshape(5, 8)
    xs = gradcheck.batches(seqs, 2, 2, torch.device("cpu"))
    assert [x.tolist() for x in xs] == [seqs[0:2].tolist(), seqs[2:4].tolist()] and xs[0].dtype == torch.int64
    with pytest.raises(ValueError, match="--grad-probe-batches 3 x --grad-probe-sequences 2"):
        gradcheck.batches(seqs, 3, 2, torch.device("cpu"), ("--grad-probe-batches", "--grad-probe-sequences"))
