"""Every relative link in README.md, lab/README.md and docs/*.md resolves, and every bench/results path
the reference pages name exists (docs/journal.md names old logs by commit, so it is checked for links
only).  CPU only, no network: CI runs it with the Python tests (scripts/dev.sh test)."""

import itertools
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md", "lab/README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def _text(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return FENCE.sub("", f.read())


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped,
    spaces to hyphens (underscores stay: GitHub keeps them, as in `layer_idx`)."""
    h = re.sub(r"[`*]", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def _anchors(page):
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", _text(page), re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    bad = []
    for target in LINK.findall(_text(page)):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(ROOT, dest)):
            bad.append(target)
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            bad.append(target + " (no such heading)")
    assert not bad, f"{page}: broken links {bad}"


def _expand(path):
    """a_{x,y}.{json,txt} -> every combination."""
    parts = re.split(r"\{([^}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


@pytest.mark.parametrize("page", [p for p in PAGES if not p.endswith("journal.md")])
def test_cited_results_exist(page):
    bad = []
    for m in re.finditer(r"bench/results/[\w./{},*-]*[\w}/]", _text(page)):
        for path in _expand(m.group(0)):
            if "*" in path:
                continue
            if not os.path.exists(os.path.join(ROOT, path)):
                bad.append(path)
    assert not bad, f"{page}: names results that are not in the tree: {bad}"
