"""Fixtures of the model-in-the-loop script tests (qwen_eval, qwen_niah, qwen_e2e, qwen_train),
imported by them by name: a conftest.py here would shadow python/tests/conftest.py, which those tests
import as `conftest` when CI runs both folders in one pytest."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import tiny_gguf  # noqa: E402


def require_model_stack():
    """Skips the calling test unless torch, transformers and mala import; returns torch."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("mala")
    return torch


@pytest.fixture
def tiny_model(tmp_path):
    """A tiny Qwen2 GGUF (tiny_gguf.write) in tmp_path; its path."""
    path = str(tmp_path / "tiny.gguf")
    tiny_gguf.write(path)
    return path


@pytest.fixture
def run_script(monkeypatch):
    """run(module, *argv): module.main() with that command line, on the CPU; qwen_measure's device
    setting is restored afterwards."""
    def run(module, *argv):
        import qwen_measure as qm

        monkeypatch.setattr(sys, "argv", [module.__name__ + ".py", *map(str, argv), "--device", "cpu"])
        saved = dict(qm.DEVICE)
        try:
            module.main()
        finally:
            qm.DEVICE.update(saved)

    return run
