"""The ``spmd-api`` directive: one module's public names (its ``__all__``), each from its docstring.

``.. spmd-api:: spmd.ops`` documents every name of ``spmd.ops.__all__`` with autodoc, in that order.
A name re-exported by several modules is described once, in its home (``spmd_names.homes``), and
elsewhere is a line linking there, so no object is described twice.
"""

from __future__ import annotations

import importlib

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

from spmd_names import CONSTANTS, _directive, _documentable, _key, homes, public_names


class SpmdApi(SphinxDirective):
    required_arguments = 1
    has_content = False

    def run(self):
        module_name = self.arguments[0]
        module = importlib.import_module(module_name)
        where = homes()
        lines: list[str] = [f".. automodule:: {module_name}", "   :no-members:", ""]
        for name in public_names(module_name):
            obj = getattr(module, name)
            qual = f"{module_name}.{name}"
            home = where.get(_key(obj)) if _documentable(obj) else None
            if home is not None and home != qual:
                lines += [f".. py:data:: {qual}", "   :no-index:", "", f"   The same object as :py:obj:`{home}`.", ""]
                continue
            if not _documentable(obj):
                text = CONSTANTS.get(qual)
                if text is None:
                    raise ValueError(f"spmd-api: {qual} is a constant with no entry in CONSTANTS; add one.")
                lines += [f".. py:data:: {qual}", f"   :value: {obj!r}" if len(repr(obj)) < 60 else "", "", f"   {text}", ""]
                continue
            kind = _directive(obj)
            lines.append(f".. {kind}:: {qual}")
            if kind == "autoclass":
                lines.append("   :members:")
            lines.append("")
        content = StringList(lines, source=f"<spmd-api {module_name}>")
        node = nodes.container()
        nested_parse_with_titles(self.state, content, node)
        return node.children


def fences_to_rst(app, what, name, obj, options, lines: list[str]) -> None:
    """Docstrings use markdown fences (```python); autodoc reads reST: make them code-block directives."""
    out: list[str] = []
    fence = None
    for line in lines:
        stripped = line.strip()
        indent = line[: len(line) - len(line.lstrip())]
        if fence is None and stripped.startswith("```"):
            fence = indent
            lang = stripped[3:].strip() or "text"
            out += [f"{indent}.. code-block:: {lang}", ""]
        elif fence is not None and stripped == "```":
            fence = None
            out.append("")
        elif fence is not None:
            out.append(f"{fence}   {line[len(fence):]}" if line.strip() else "")
        else:
            out.append(line)
    lines[:] = out


def setup(app):
    app.add_directive("spmd-api", SpmdApi)
    app.connect("autodoc-process-docstring", fences_to_rst)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
