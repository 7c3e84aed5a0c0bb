"""The docs: every ```python block of README.md and docs/ runs as written; the site builds with no warning.

Each block runs alone in a fresh interpreter, in an empty folder outside the repository with only the
packages ``pip install`` gives (``spmd``, ``placements``, ``models``) importable, as a reader's saved
script runs (nothing from ``tests/``), with the environment the getting-started page tells the reader to set
(8 CPU fake devices). A block that imports torch runs
only where torch is installed (CI installs it). What is not meant to run is marked ``text``,
``console`` or ``bash``, never ``python``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]
# The environment of docs/getting-started.md: 8 CPU fake devices, asked for before JAX starts; with the suite's
# compile-time flags (tests/conftest.py: LLVM's -O0 and the older CPU fusion emitters, which leave the
# collectives and the numbers as they are) that halve a block's compiles. Set XLA_FLAGS yourself (with the
# device count) to run the blocks at XLA's defaults.
DOCS_ENV = {"XLA_FLAGS": os.environ["XLA_FLAGS"], "JAX_PLATFORMS": "cpu"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
# Info strings a fenced block may carry; ``python`` blocks run, the others are shown only.
LANGUAGES = {"python", "text", "console", "bash", "json", "toml", "ini", "yaml", "diff", "rst", ""}
BLOCK_TIMEOUT_S = 240  # under pytest-timeout's 300 s; the slowest block (a 3-D train step) takes ~20 s of CPU
HISTORY = ("this stop", "next issue", "rerun_issue", "as measured this", "the seed's eager", "this session")


HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)(?:\s+#+)?\s*$")


class Block(NamedTuple):
    """A top-level fenced block: its fence's line (1-based), info string, code, and the slug of the nearest heading
    above it ("top" before the first)."""

    line: int
    info: str
    code: str
    heading: str


def _slug(title: str) -> str:
    """A heading's anchor as GitHub and MyST's ``myst_heading_anchors`` write it: lower case, no punctuation, a
    hyphen for each space."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _fenced_blocks(path: Path) -> list[Block]:
    """Every top-level fenced block of a markdown file, in order."""
    out, lines, i, heading = [], path.read_text().splitlines(), 0, "top"
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            h = HEADING.match(lines[i])
            heading = _slug(h.group("title")) if h else heading
            i += 1
            continue
        fence, info, start = m.group("fence"), m.group("info").strip(), i + 1
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        out.append(Block(start, info, "\n".join(body) + "\n", heading))
    return out


def _python_blocks() -> list[tuple[str, int, str]]:
    """(name, line, code) of every python block. The name, ``page::heading-slug-N`` (the N-th python block under
    that heading), stays as lines are added above the block (tests/slow_tier.json lists some by it); the line is
    for finding the block."""
    blocks = []
    for page in PAGES:
        ordinal: dict[str, int] = {}
        for b in _fenced_blocks(page):
            if b.info == "python":
                ordinal[b.heading] = ordinal.get(b.heading, 0) + 1
                blocks.append((f"{page.relative_to(ROOT)}::{b.heading}-{ordinal[b.heading]}", b.line, b.code))
    return blocks


BLOCKS = _python_blocks()
HAS_TORCH = importlib.util.find_spec("torch") is not None


def test_blocks_found():
    assert len(BLOCKS) >= 15, [name for name, _, _ in BLOCKS]
    assert len({name for name, _, _ in BLOCKS}) == len(BLOCKS), "two python blocks share a name"


INSTALLED = ("spmd", "placements", "models")  # pyproject's packages: what a reader's script can import


@pytest.mark.parametrize("name,line,code", BLOCKS, ids=[name for name, _, _ in BLOCKS])
def test_python_block_runs(name, line, code, tmp_path):
    if re.search(r"^\s*(import torch|from torch)\b", code, re.M) and not HAS_TORCH:
        pytest.skip("needs torch (pip install -e '.[torch]')")
    site, cwd = tmp_path / "site", tmp_path / "work"  # this checkout's packages (not another install's)
    site.mkdir()
    cwd.mkdir()
    for pkg in INSTALLED:
        (site / pkg).symlink_to(ROOT / pkg, target_is_directory=True)
    env = {**os.environ, **DOCS_ENV, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, f"{name} (line {line}) failed (rc {proc.returncode}):\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"


def test_fences_are_known():
    """No block dodges the runner with another spelling of python (``py``, ``python3``, ``pycon``)."""
    bad = [f"{page.relative_to(ROOT)}:{b.line} ```{b.info}" for page in PAGES for b in _fenced_blocks(page)
           if b.info.split()[0:1] and b.info.split()[0] not in LANGUAGES and not b.info.startswith("{")]
    assert not bad, bad


def test_readme_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; keep it at most 250 and move the rest into docs/."


def test_no_history_in_user_text():
    hits = [f"{p.relative_to(ROOT)}: {w!r}" for p in PAGES for w in HISTORY if w in p.read_text().lower()]
    assert not hits, hits


def test_every_public_name_documented():
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import spmd_names  # the name inventory alone: no Sphinx or docutils needed
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    assert spmd_names.missing_docstrings() == []


@pytest.mark.skipif(importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_parser") is None,
                    reason="the docs extra is not installed (pip install -e '.[docs]')")
def test_docs_build(tmp_path):
    """The site builds with warnings as errors, as ``sphinx-build -W --keep-going -b html docs OUT``."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html",
                           str(DOCS), str(tmp_path / "html")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-5000:]
    html = (tmp_path / "html" / "api" / "spmd.ops.html").read_text()
    assert 'id="spmd.ops.exp"' in html
