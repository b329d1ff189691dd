"""The `real` regime's text: Python sources of the standard library of the interpreter that runs this
(real code, on every machine, nothing downloaded), one package per sequence.

A sequence is its package's `.py` files in sorted path order (`__init__.py` first), each preceded by
a `# file: <path>` line, tokenized and cut to the wanted length.  Packages are taken in the order of
PACKAGES, skipping any that is missing or too short, so the set is reproducible from the interpreter
version alone; every file used is listed with its SHA-256 and token count.

    seqs, manifest = build(tokenize, n_tokens=32768, n_sequences=4)
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

# Large, self-contained packages of CPython's standard library (tests excluded).
PACKAGES = ("asyncio", "email", "multiprocessing", "tkinter", "importlib", "logging", "unittest", "xml",
            "http", "concurrent", "json", "sqlite3")
SKIP_DIRS = {"test", "tests", "__pycache__", "idle_test"}


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def package_files(root: str, package: str) -> list[str]:
    """Relative paths of the package's .py files, sorted (directories without tests)."""
    out = []
    base = os.path.join(root, package)
    for d, dirs, files in os.walk(base):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, f), root))
    return sorted(out, key=lambda p: (os.path.dirname(p), os.path.basename(p) != "__init__.py", p))


def sequence(root: str, package: str, tokenize, n_tokens: int):
    """(token ids of exactly n_tokens or None if the package is too short, files used)."""
    ids, files = [], []
    for rel in package_files(root, package):
        with open(os.path.join(root, rel), "rb") as fh:
            raw = fh.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        chunk = tokenize(f"# file: {rel}\n{text}\n")
        take = min(len(chunk), n_tokens - len(ids))
        ids.extend(chunk[:take])
        files.append({"path": rel, "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw),
                      "tokens_used": take, "whole": take == len(chunk)})
        if len(ids) >= n_tokens:
            return ids, files
    return None, files


def build(tokenize, n_tokens: int, n_sequences: int, root: str | None = None, packages=PACKAGES):
    """n_sequences token lists of n_tokens each, and the manifest that reproduces them."""
    import platform

    root = root or stdlib_dir()
    seqs, manifest = [], {"source": "CPython standard library", "python": platform.python_version(),
                          "root": root, "n_tokens": n_tokens, "sequences": []}
    for pkg in packages:
        if len(seqs) == n_sequences:
            break
        if not os.path.isdir(os.path.join(root, pkg)):
            continue
        ids, files = sequence(root, pkg, tokenize, n_tokens)
        if ids is None:
            continue
        seqs.append(ids)
        digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()
        manifest["sequences"].append({"package": pkg, "files": files, "token_ids_sha256": digest})
    if len(seqs) < n_sequences:
        raise RuntimeError(f"corpus: only {len(seqs)} packages under {root} reach {n_tokens} tokens")
    return seqs, manifest
