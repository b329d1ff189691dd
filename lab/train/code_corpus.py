"""The training study's corpus: real code already on the GPU machine, nothing downloaded.

Sources (roots), each a folder of the machine it runs on:
  py      the Python environment's installed packages (site-packages), `.py` files
  stdlib  the interpreter's standard library, `.py` files (site-packages left out)
  inc     the system C/C++ headers (/usr/include), header files

A *package* is a root's top-level entry (a folder or a single file): `py:torch`, `inc:linux`.
Whole packages are held out for evaluation (`heldout_packages`); a training file whose bytes equal
a held-out file's is dropped, and within each split identical files are kept once, so the two
splits share no document.

`scan` walks the roots and writes the manifest: one line per file, `split sha256 bytes root path`,
sorted by (root, path), gzip-compressed, plus a JSON header (roots, the held-out packages, counts).
`build` re-reads exactly the manifest's files, checks every SHA-256, tokenizes them and writes the
token streams: the training files in an order drawn from `seed`, the held-out files in manifest
order, each document followed by the separator token.  The same manifest, file bytes and tokenizer
give the same streams (their SHA-256 is recorded), so every arm of the study sees the same data.

    python3 lab/train/code_corpus.py scan --out /tmp/mala-train/data            # manifest.tsv.gz, manifest.json
    python3 lab/train/code_corpus.py build --data /tmp/mala-train/data --tokenizer lab/train/tokenizer.json
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import sysconfig

import numpy as np

PY_SUFFIXES = (".py",)
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".h++", ".inl", ".tcc", ".cuh")
SKIP_DIRS = {"__pycache__", ".git"}
MAX_FILE_BYTES = 1 << 20  # larger sources are generated tables, not code a model should learn from
HELDOUT_FRACTION = 0.03  # of each root's bytes, in whole packages
HELDOUT_MAX_PACKAGE = 0.01  # no held-out package above this fraction of its root (keeps the split spread)
SEPARATOR = "<|endoftext|>"


def default_roots() -> dict[str, str]:
    paths = sysconfig.get_paths()
    roots = {"py": paths["purelib"], "stdlib": paths["stdlib"], "inc": "/usr/include"}
    return {k: os.path.realpath(v) for k, v in roots.items() if os.path.isdir(v)}


def _wanted(root_name: str, rel: str) -> bool:
    name = os.path.basename(rel)
    if root_name == "inc":
        # C++ standard headers have no suffix (c++/12/vector).
        return name.endswith(HEADER_SUFFIXES) or ("c++/" in rel and "." not in name)
    return name.endswith(PY_SUFFIXES)


def walk_root(root_name: str, root: str, skip: tuple[str, ...] = ()):
    """(rel_path, bytes) of the root's wanted files, sorted; symlinks and files over the cap skipped."""
    out = []
    for d, dirs, files in os.walk(root):
        rel_d = os.path.relpath(d, root)
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.endswith((".dist-info", ".egg-info"))
                         and not os.path.islink(os.path.join(d, x))
                         and os.path.realpath(os.path.join(d, x)) not in skip)
        for f in sorted(files):
            rel = os.path.normpath(os.path.join(rel_d, f))
            p = os.path.join(d, f)
            if os.path.islink(p) or not _wanted(root_name, rel):
                continue
            size = os.path.getsize(p)
            if 0 < size <= MAX_FILE_BYTES:
                out.append(rel)
    return sorted(out)


def package_of(rel: str) -> str:
    return rel.split(os.sep, 1)[0]


def read_text(path: str):
    """(bytes, text) or None when the file is not UTF-8."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw, raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def choose_heldout(sizes: dict[str, int], root_name: str, fraction: float = HELDOUT_FRACTION,
                   max_package: float = HELDOUT_MAX_PACKAGE) -> list[str]:
    """Whole packages, taken in the order of SHA-256("root:package") (a fixed pseudo-random order),
    skipping any above max_package of the root's bytes, until `fraction` of its bytes."""
    total = sum(sizes.values())
    order = sorted(sizes, key=lambda p: hashlib.sha256(f"{root_name}:{p}".encode()).hexdigest())
    out, got = [], 0
    for p in order:
        if got >= fraction * total:
            break
        if sizes[p] <= max_package * total:
            out.append(p)
            got += sizes[p]
    return sorted(out)


def scan(roots: dict[str, str], heldout_fraction: float = HELDOUT_FRACTION,
         heldout_max_package: float = HELDOUT_MAX_PACKAGE):
    """Manifest rows (split, sha256, bytes, root, rel) and its header, for the given roots."""
    files = {}  # root -> [(rel, sha, nbytes)]
    for name, root in sorted(roots.items()):
        # The standard library's folder holds site-packages: leave the other roots out of it.
        skip = tuple(os.path.realpath(r) for n, r in roots.items() if n != name)
        rows = []
        for rel in walk_root(name, root, skip):
            got = read_text(os.path.join(root, rel))
            if got is None:
                continue
            raw, _ = got
            rows.append((rel, hashlib.sha256(raw).hexdigest(), len(raw)))
        files[name] = rows
    heldout = {}
    for name, rows in files.items():
        sizes = {}
        for rel, _, n in rows:
            sizes[package_of(rel)] = sizes.get(package_of(rel), 0) + n
        heldout[name] = choose_heldout(sizes, name, heldout_fraction, heldout_max_package)
    # Splits: held-out packages' files first claim their contents; then training files, once each.
    held_hashes = set()
    out = []
    for name, rows in sorted(files.items()):
        for rel, sha, n in rows:
            if package_of(rel) in heldout[name] and sha not in held_hashes:
                held_hashes.add(sha)
                out.append(("heldout", sha, n, name, rel))
    seen = set(held_hashes)
    for name, rows in sorted(files.items()):
        for rel, sha, n in rows:
            if package_of(rel) not in heldout[name] and sha not in seen:
                seen.add(sha)
                out.append(("train", sha, n, name, rel))
    out.sort(key=lambda r: (r[3], r[4]))
    header = {
        "roots": roots,
        "heldout_packages": heldout,
        "rules": {"max_file_bytes": MAX_FILE_BYTES, "heldout_fraction": heldout_fraction,
                  "heldout_max_package": heldout_max_package, "py_suffixes": PY_SUFFIXES,
                  "header_suffixes": HEADER_SUFFIXES},
        "counts": {s: {"files": sum(1 for r in out if r[0] == s), "bytes": sum(r[2] for r in out if r[0] == s)}
                   for s in ("train", "heldout")},
    }
    return out, header


def write_manifest(rows, header, out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    # mtime=0: the compressed bytes depend on the rows alone.
    with open(os.path.join(out_dir, "manifest.tsv.gz"), "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            for r in rows:
                f.write(("\t".join(str(x) for x in r) + "\n").encode())
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(header, f, indent=1, sort_keys=True)


def read_manifest(data_dir: str):
    with open(os.path.join(data_dir, "manifest.json")) as f:
        header = json.load(f)
    rows = []
    with gzip.open(os.path.join(data_dir, "manifest.tsv.gz"), "rt") as f:
        for line in f:
            split, sha, n, root, rel = line.rstrip("\n").split("\t")
            rows.append((split, sha, int(n), root, rel))
    return rows, header


def load_split(rows, header, split: str, roots: dict[str, str] | None = None):
    """The split's texts in manifest order, each file's bytes checked against its SHA-256."""
    roots = roots or header["roots"]
    texts, bad = [], []
    for s, sha, n, root, rel in rows:
        if s != split:
            continue
        got = read_text(os.path.join(roots[root], rel))
        if got is None or hashlib.sha256(got[0]).hexdigest() != sha:
            bad.append(f"{root}:{rel}")
            continue
        texts.append(got[1])
    if bad:
        raise ValueError(f"corpus: {len(bad)} {split} files missing or changed since the manifest "
                         f"(first: {bad[:3]})")
    return texts


def training_order(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def encode_stream(tokenizer, texts, order=None) -> np.ndarray:
    """uint16 token stream: each document's tokens, then the separator."""
    sep = tokenizer.token_to_id(SEPARATOR)
    if sep is None:
        raise ValueError(f"tokenizer: has no {SEPARATOR} token")
    if tokenizer.get_vocab_size() > 65536:
        raise ValueError("tokenizer: vocabulary does not fit uint16")
    texts = [texts[i] for i in order] if order is not None else list(texts)
    parts = []
    for s in range(0, len(texts), 4096):
        for enc in tokenizer.encode_batch(texts[s:s + 4096], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            parts.append(np.asarray([sep], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def stream_sha(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


def build(data_dir: str, tokenizer, seed: int = 42, roots: dict[str, str] | None = None):
    """Writes train.npy / heldout.npy (uint16 streams) and streams.json; returns the latter's dict."""
    rows, header = read_manifest(data_dir)
    train = load_split(rows, header, "train", roots)
    held = load_split(rows, header, "heldout", roots)
    ts = encode_stream(tokenizer, train, training_order(len(train), seed))
    hs = encode_stream(tokenizer, held)
    np.save(os.path.join(data_dir, "train.npy"), ts)
    np.save(os.path.join(data_dir, "heldout.npy"), hs)
    info = {"seed": seed, "train_tokens": int(ts.size), "heldout_tokens": int(hs.size),
            "train_sha256": stream_sha(ts), "heldout_sha256": stream_sha(hs),
            "train_files": len(train), "heldout_files": len(held),
            "train_bytes": header["counts"]["train"]["bytes"], "heldout_bytes": header["counts"]["heldout"]["bytes"]}
    with open(os.path.join(data_dir, "streams.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def sequences(stream: np.ndarray, seqlen: int) -> np.ndarray:
    """The stream cut into consecutive [n, seqlen] sequences (the tail that does not fill one dropped)."""
    n = stream.size // seqlen
    return stream[: n * seqlen].reshape(n, seqlen)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scan")
    s.add_argument("--out", required=True)
    s.add_argument("--root", action="append", default=[], help="NAME=PATH (default: py, stdlib, inc)")
    b = sub.add_parser("build")
    b.add_argument("--data", required=True)
    b.add_argument("--tokenizer", required=True)
    b.add_argument("--seed", type=int, default=42)
    a = ap.parse_args(argv)
    if a.cmd == "scan":
        roots = dict(x.split("=", 1) for x in a.root) if a.root else default_roots()
        rows, header = scan(roots)
        write_manifest(rows, header, a.out)
        print(json.dumps(header["counts"]))
    else:
        from tokenizers import Tokenizer
        info = build(a.data, Tokenizer.from_file(a.tokenizer), a.seed)
        print(json.dumps(info))


if __name__ == "__main__":
    sys.exit(main())
