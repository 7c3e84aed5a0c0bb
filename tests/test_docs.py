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


def _fenced_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line number, info string, code) of every top-level fenced block of a markdown file."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group("fence"), m.group("info").strip(), i + 1
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        out.append((start, info, "\n".join(body) + "\n"))
    return out


def _python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in PAGES:
        for line, info, code in _fenced_blocks(page):
            if info == "python":
                blocks.append((f"{page.relative_to(ROOT)}:{line}", code))
    return blocks


BLOCKS = _python_blocks()
HAS_TORCH = importlib.util.find_spec("torch") is not None


def test_blocks_found():
    assert len(BLOCKS) >= 15, [name for name, _ in BLOCKS]


INSTALLED = ("spmd", "placements", "models")  # pyproject's packages: what a reader's script can import


@pytest.mark.parametrize("name,code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_python_block_runs(name, code, tmp_path):
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
    assert proc.returncode == 0, f"{name} failed (rc {proc.returncode}):\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"


def test_fences_are_known():
    """No block dodges the runner with another spelling of python (``py``, ``python3``, ``pycon``)."""
    bad = [f"{page.relative_to(ROOT)}:{line} ```{info}" for page in PAGES
           for line, info, _ in _fenced_blocks(page)
           if info.split()[0:1] and info.split()[0] not in LANGUAGES and not info.startswith("{")]
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
