"""The ``spmd-api`` directive: one module's public names (its ``__all__``), each from its docstring.

``.. spmd-api:: spmd.ops`` documents every name of ``spmd.ops.__all__`` with autodoc, in that order.
A name re-exported by several modules (``spmd.Shard`` is ``placements.Shard``) is described once, in
the first module of ``MODULES`` that exports it, and elsewhere is a line linking there, so no object
is described twice. ``missing_docstrings()`` lists public names without a docstring (a test asks for
none).
"""

from __future__ import annotations

import importlib
import inspect

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

# Every public module, in the order a name is given its home (its first module here).
MODULES = (
    "placements",
    "spmd",
    "spmd.tensor",
    "spmd.ops",
    "spmd.parallel",
    "spmd.distributed",
    "spmd.distributed.device_mesh",
    "spmd.distributed.tensor",
    "spmd.distributed.tensor.debug",
    "spmd.testing",
    "models",
)


# Public constants (values have no docstring of their own).
CONSTANTS = {
    "placements.PARTIAL_OPS": "The reduce ops a ``Partial`` placement may carry: "
    "``('sum', 'avg', 'max', 'min', 'product')``.",
    "placements.LATENCY_BYTES": "The planner's latency term: each collective of a plan costs this many bytes "
    "(64 KiB) on top of its traffic, so plans with fewer collectives win on small tensors.",
    "placements.TRANSITIONS": "The transition table: for each legal (source kind, destination kind) of one mesh "
    "dim, its collective, how its bytes are counted, its traffic and the name of its lowering. The planner, "
    "the JAX lowering and the NumPy simulator all read it; a pair absent here is not a step.",
    "spmd.parallel.ROOT": "``'root'``: the name of the unit holding every parameter that no ``units`` pattern "
    "matched (torch's root ``fully_shard``).",
}


def public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_") and not inspect.ismodule(getattr(module, n))]
    return list(names)


def _key(obj):
    return id(obj)


def homes() -> dict[int, str]:
    """id(object) -> the qualified name that describes it (its first module's)."""
    seen: dict[int, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in public_names(module_name):
            obj = getattr(module, name)
            if _documentable(obj):
                seen.setdefault(_key(obj), f"{module_name}.{name}")
    return seen


def _documentable(obj) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(obj) or callable(obj)


def _directive(obj) -> str:
    if inspect.isclass(obj):
        return "autoclass"
    if inspect.isroutine(obj):
        return "autofunction"
    return "autodata"


def missing_docstrings() -> list[str]:
    out = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in public_names(module_name):
            obj = getattr(module, name)
            if not _documentable(obj):
                if f"{module_name}.{name}" not in CONSTANTS:
                    out.append(f"{module_name}.{name}")
                continue
            if not (inspect.getdoc(obj) or "").strip():
                out.append(f"{module_name}.{name}")
    return out


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
