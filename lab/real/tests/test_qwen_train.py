"""lab/real/qwen_train.py (continued-training parity) on the CPU, on a tiny GGUF: a dense run and a
MALA run at tau = 0 follow the same losses (tau = 0 is exact dense attention), the MALA run at
tau = 1 reports its realized slots and FLOPs, and a run stopped at its deadline resumes where it
stopped.

    .venv-real/bin/python -m pytest lab/real/tests     (CI: scripts/dev.sh test)
"""

import json
import os

import pytest

from script_fixtures import require_model_stack, run_script, tiny_model  # noqa: F401  (fixtures)


def _run(run_script, gguf, out, work, *extra):
    import qwen_train

    run_script(qwen_train, "--gguf", gguf, "--out", out, "--work", work, "--seqlen", "256", "--steps", "3",
               "--eval-every", "3", "--lr", "1e-3", "--warmup", "1", *extra)


def test_dense_and_mala_runs(tmp_path, tiny_model, run_script):
    require_model_stack()
    work = tmp_path / "w"
    _run(run_script, tiny_model, tmp_path / "dense", work, "--attn", "dense")
    _run(run_script, tiny_model, tmp_path / "mala0", work, "--attn", "mala", "--tau", "0")
    _run(run_script, tiny_model, tmp_path / "mala1", work, "--attn", "mala", "--tau", "1")
    load = lambda d, a: json.load(open(tmp_path / d / f"qwen_train_{a}.json"))  # noqa: E731
    dense, mala0, mala1 = load("dense", "dense"), load("mala0", "mala"), load("mala1", "mala")
    assert [r["step"] for r in dense["steps"]] == [1, 2, 3] and dense["completed_steps"] == 3
    for a, b in zip(dense["steps"], mala0["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert dense["final"]["held_out_loss"] == pytest.approx(mala0["final"]["held_out_loss"], rel=1e-4)
    assert dense["steps"][-1]["loss"] != dense["steps"][0]["loss"]  # the weights did move
    last = mala1["steps"][-1]
    assert 0 < last["fwd_slots_per_query"] and 0 < last["bwd_slots_per_query"]
    assert 0 < last["attention_flops_per_token"] <= 2 * last["dense_attention_flops_per_token"]


def test_deadline_then_resume(tmp_path, tiny_model, run_script):
    require_model_stack()
    work = tmp_path / "w"
    _run(run_script, tiny_model, tmp_path / "o", work, "--attn", "dense", "--deadline-s", "0")
    first = json.load(open(tmp_path / "o" / "qwen_train_dense.json"))
    assert first["completed_steps"] == 0 and os.path.exists(work / "train_dense.pt")
    _run(run_script, tiny_model, tmp_path / "o", work, "--attn", "dense", "--resume")
    done = json.load(open(tmp_path / "o" / "qwen_train_dense.json"))
    assert done["completed_steps"] == 3 and [r["step"] for r in done["steps"]] == [1, 2, 3]


def test_training_text_is_distinct_chunks_without_the_held_out_packages():
    import corpus

    tokenize = lambda s: [ord(c) for c in s]  # noqa: E731  (one id per character: exact to check)
    seqs, manifest = corpus.chunks(tokenize, 4096, 20, exclude=("http", "xml"))
    assert len(seqs) == 20 and all(len(s) == 4096 for s in seqs)
    paths = [f["path"] for f in manifest["files"]]
    assert not any(p.split("/")[0] in ("http", "xml", "test") or p in ("http.py", "xml.py") for p in paths)
    # Consecutive cuts of one stream: the files' texts in order, nothing skipped or repeated.
    stream = "".join(c for s in seqs for c in map(chr, s))
    assert stream.startswith(f"# file: {paths[0]}\n")
    assert stream.count("# file: ") >= len(paths) - 1
    assert len({tuple(s) for s in seqs}) == 20


def test_run_reports_its_text(tmp_path, tiny_model, run_script):
    require_model_stack()
    _run(run_script, tiny_model, tmp_path / "dense", tmp_path / "w", "--attn", "dense")
    text = json.load(open(tmp_path / "dense" / "qwen_train_dense.json"))["text"]
    assert text["held_out"] == ["http", "xml"] and text["train"]["sequences"] == 3
