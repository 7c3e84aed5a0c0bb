"""Sphinx configuration of the spmd docs: MyST markdown pages, the API reference from docstrings.

Build (warnings are errors, as in CI's ``tests/test_docs.py::test_docs_build``)::

    sphinx-build -W --keep-going -b html docs /tmp/spmd-docs
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's spmd, placements and models, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))
# Importing the library for autodoc must not grab every core: one CPU device is enough to import it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "spmd"
author = "the spmd authors"
copyright = "the spmd authors"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "spmd_api",         # the API pages: every public name of every public module, from its docstring
    "spmd_benchmarks",  # the benchmarks page: tables rendered from benchmarks/results/*.json
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_ext", "README.md"]
root_doc = "index"

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "none"          # signatures carry the names; the docstrings say what they take
autodoc_inherit_docstrings = False  # flax / dataclass parents' docstrings are not ours
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo" if __import__("importlib").util.find_spec("furo") else "alabaster"
html_title = "spmd"
html_static_path = []
