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


def source_texts(root: str, paths):
    """(relative path, raw bytes, the text a sequence holds: '# file: <path>' then the file) of each
    path that decodes as UTF-8, in order."""
    for rel in paths:
        with open(os.path.join(root, rel), "rb") as fh:
            raw = fh.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        yield rel, raw, f"# file: {rel}\n{text}\n"


def sequence(root: str, package: str, tokenize, n_tokens: int):
    """(token ids of exactly n_tokens or None if the package is too short, files used)."""
    ids, files = [], []
    for rel, raw, text in source_texts(root, package_files(root, package)):
        chunk = tokenize(text)
        take = min(len(chunk), n_tokens - len(ids))
        ids.extend(chunk[:take])
        files.append({"path": rel, "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw),
                      "tokens_used": take, "whole": take == len(chunk)})
        if len(ids) >= n_tokens:
            return ids, files
    return None, files


def build(tokenize, n_tokens: int, n_sequences: int, root: str | None = None, packages=PACKAGES,
          allow_fewer: bool = False):
    """n_sequences token lists of n_tokens each, and the manifest that reproduces them.  Fewer
    packages than that reach n_tokens: an error, or with allow_fewer the ones that do (at least one)."""
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
    if len(seqs) < n_sequences and not (allow_fewer and seqs):
        raise RuntimeError(f"corpus: only {len(seqs)} packages under {root} reach {n_tokens} tokens")
    return seqs, manifest


# Not source code, or tests and tools rather than the library: left out of the chunked corpus.
CHUNK_SKIP_TOP = {"test", "idlelib", "lib2to3", "turtledemo", "ensurepip", "encodings", "pydoc_data",
                  "site-packages", "dist-packages"}


def library_files(root: str, exclude=()) -> list[str]:
    """Relative paths of every .py file of the standard library, sorted, without the test suites,
    the data tables and tools of CHUNK_SKIP_TOP, the build configuration, and the top-level packages
    or modules named in `exclude`."""
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        top = rel.split(os.sep)[0]
        if rel != "." and (top in CHUNK_SKIP_TOP or top in exclude or top.startswith("config-")):
            dirs[:] = []
            continue
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for f in files:
            if f.endswith(".py") and not (rel == "." and f[:-3] in exclude) and not f.startswith("_sysconfigdata"):
                out.append(os.path.normpath(os.path.join(rel, f)))
    return sorted(out)


def chunks(tokenize, n_tokens: int, max_sequences: int, exclude=(), root: str | None = None):
    """The whole library (library_files, minus `exclude`) as one token stream, cut into consecutive
    sequences of n_tokens (at most max_sequences; the tail shorter than n_tokens is dropped): many
    distinct sequences, for training.  Returns (seqs, manifest)."""
    import platform

    root = root or stdlib_dir()
    seqs, ids, files = [], [], []
    manifest = {"source": "CPython standard library, chunked", "python": platform.python_version(), "root": root,
                "n_tokens": n_tokens, "excluded": sorted(exclude), "files": files}
    for rel, raw, text in source_texts(root, library_files(root, exclude)):
        ids.extend(tokenize(text))
        files.append({"path": rel, "sha256": hashlib.sha256(raw).hexdigest()})
        while len(ids) >= n_tokens and len(seqs) < max_sequences:
            seqs.append(ids[:n_tokens])
            ids = ids[n_tokens:]
        if len(seqs) == max_sequences:
            break
    manifest["sequences"] = len(seqs)
    manifest["token_ids_sha256"] = hashlib.sha256(",".join(",".join(map(str, s)) for s in seqs).encode()).hexdigest()
    return seqs, manifest
