"""The ``benchmark-tables`` directive: tables rendered from ``benchmarks/results/*.json`` at build time.

In a MyST page::

    ```{benchmark-tables} collectives.json
    :path: rows
    :columns: collective, size_bytes=bytes, time_ratio=spmd / hand
    ```

renders the records found under ``path`` (keys joined by ``/``; the whole file when omitted) as
tables. A record is a dict whose leaves are scalars once nested dicts are flattened to dotted keys
(``time_s.spmd``) and collective counts (``{"all-reduce": {"count": 1, "bytes": 4096}}``) are
written ``all-reduce 1x 4,096 B``. A list of records is one table; a dict whose values are records
is one table with the key as its first column; anything else is searched for such groups, each
table titled by its path. ``:columns:`` picks and names columns (``key=Header``); without it every
column is shown. Nothing is pasted by hand: rerun a benchmark and rebuild the docs.
"""

from __future__ import annotations

import json
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MAX_COLUMNS = 16


def _is_collectives(v) -> bool:
    return isinstance(v, dict) and bool(v) and all(
        isinstance(c, dict) and {"count", "bytes"} <= set(c) <= {"count", "bytes", "buffers"} for c in v.values())


def _fmt_collectives(v: dict) -> str:
    return ", ".join(f"{k} {c['count']}x {c['bytes']:,} B" for k, c in v.items()) or "-"


def _flatten(d: dict, prefix: str = "") -> dict | None:
    """Dotted keys -> scalars, or None when ``d`` is not a record."""
    out: dict = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if _is_collectives(v):
            out[key] = _fmt_collectives(v)
        elif isinstance(v, dict):
            if not v:
                out[key] = "-"
                continue
            sub = _flatten(v, key + ".")
            if sub is None:
                return None
            out.update(sub)
        elif isinstance(v, list):
            if not all(isinstance(x, (int, float, str, bool)) or x is None for x in v):
                return None
            out[key] = ", ".join(_cell(x) for x in v)
        else:
            out[key] = v
    return out


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{int(v):,}" if v.is_integer() and abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def _records(node, title: str, accept):
    """Yield (title, [(row name or None, flat record)]) for every group of records under ``node``.

    ``accept(flat_records)`` says whether a group makes a table (else its members are searched)."""
    if isinstance(node, list):
        flat = [_flatten(x) if isinstance(x, dict) else None for x in node]
        if node and all(f is not None for f in flat) and accept(flat):
            yield title, [(None, f) for f in flat]
            return
        for i, x in enumerate(node):
            yield from _records(x, f"{title}[{i}]", accept)
        return
    if not isinstance(node, dict):
        return
    children = {k: v for k, v in node.items() if isinstance(v, dict) and not _is_collectives(v)}
    flat = {k: _flatten(v) for k, v in children.items()}
    recs = [(k, f) for k, f in flat.items() if f is not None]
    if len(recs) >= 2 and accept([f for _, f in recs]):
        yield title, recs
        rest = [k for k in children if flat[k] is None]
    else:
        rest = list(children)
    for k, v in node.items():
        if isinstance(v, list) or k in rest:
            yield from _records(v, f"{title}/{k}" if title else k, accept)


def _width(flat) -> int:
    keys: dict = {}
    for f in flat:
        keys.update(dict.fromkeys(f))
    return len(keys)


def _table(header: list[str], rows: list[list[str]]) -> nodes.table:
    table = nodes.table()
    group = nodes.tgroup(cols=len(header))
    table += group
    for _ in header:
        group += nodes.colspec(colwidth=1)
    head = nodes.thead()
    group += head
    body = nodes.tbody()
    group += body
    for target, cells in ((head, [header]), (body, rows)):
        for cells_of_row in cells:
            row = nodes.row()
            for text in cells_of_row:
                entry = nodes.entry()
                entry += nodes.paragraph(text=text)
                row += entry
            target += row
    return table


class BenchmarkTables(SphinxDirective):
    required_arguments = 1
    option_spec = {"path": directives.unchanged, "columns": directives.unchanged}

    def run(self):
        name = self.arguments[0]
        path = RESULTS / name
        self.env.temp_data.setdefault("spmd_benchmarks_used", set()).add(name)
        self.env.note_dependency(str(path))
        data = json.loads(path.read_text())
        where = self.options.get("path", "")
        for part in filter(None, where.split("/")):
            if isinstance(data, list):
                data = data[int(part)]
            elif part not in data:
                raise self.error(f"benchmark-tables: {name} has no key {part!r} under {where!r}; "
                                 f"its keys there are {sorted(data)}.")
            else:
                data = data[part]
        out: list[nodes.Node] = []
        columns = None
        if "columns" in self.options:
            columns = []
            for spec in self.options["columns"].split(","):
                key, _, label = spec.strip().partition("=")
                columns.append((key.strip(), (label or key).strip()))
        flat = _flatten(data) if isinstance(data, dict) else None
        if flat is not None and columns is not None and all(k in flat for k, _ in columns):
            groups = [(where, [(None, flat)])]  # the columns name one record: a one-row table
        else:
            if columns is None:
                def accept(flat):
                    return _width(flat) <= MAX_COLUMNS
            else:
                def accept(flat):
                    return all(any(k in f for f in flat) for k, _ in columns)
            groups = list(_records(data, where, accept))
            if not groups and flat is not None:
                groups = [(where, [(None, flat)])]
        if not groups:
            raise self.error(f"benchmark-tables: no table of records under {where!r} in {name}.")
        for title, recs in groups:
            named = any(k is not None for k, _ in recs)
            if columns is None:
                keys: dict = {}
                for _, f in recs:
                    keys.update(dict.fromkeys(f))
                cols = [(k, k) for k in keys]
            else:
                cols = columns
                unknown = [k for k, _ in cols if not any(k in f for _, f in recs)]
                if unknown:
                    raise self.error(f"benchmark-tables: {name}{' ' + title if title else ''} has no column "
                                     f"{unknown[0]!r}; its columns are {sorted({c for _, f in recs for c in f})[:20]}.")
            header = ([""] if named else []) + [label for _, label in cols]
            rows = [([k] if named else []) + [_cell(f.get(c)) for c, _ in cols] for k, f in recs]
            if len(groups) > 1 and title:
                out.append(nodes.paragraph(text=f"{name}: {title}"))
            out.append(_table(header, rows))
        caption = nodes.paragraph()
        caption += nodes.emphasis(text=f"From benchmarks/results/{name}" + (f" ({where})" if where else "") + ".")
        out.append(caption)
        return out


class BenchmarkOthers(SphinxDirective):
    """``benchmark-others``: every results file no ``benchmark-tables`` above it on the page rendered, so a
    new benchmark's JSON shows up without editing the page (tables where its records are found)."""

    def run(self):
        used = self.env.temp_data.get("spmd_benchmarks_used", set())
        out: list[nodes.Node] = []
        for path in sorted(RESULTS.glob("*.json")):
            if path.name in used:
                continue
            self.env.note_dependency(str(path))
            data = json.loads(path.read_text())
            out.append(nodes.rubric(text=path.name))
            groups = list(_records(data, "", lambda flat: _width(flat) <= MAX_COLUMNS))
            for title, recs in groups:
                keys: dict = {}
                for _, f in recs:
                    keys.update(dict.fromkeys(f))
                named = any(k is not None for k, _ in recs)
                header = ([""] if named else []) + list(keys)
                rows = [([k] if named else []) + [_cell(f.get(c)) for c in keys] for k, f in recs]
                if title:
                    out.append(nodes.paragraph(text=title))
                out.append(_table(header, rows))
            if not groups:
                top = ", ".join(map(str, data)) if isinstance(data, dict) else f"a list of {len(data)}"
                out.append(nodes.paragraph(text=f"No table of records; its top-level entries: {top}."))
        return out


def setup(app):
    app.add_directive("benchmark-tables", BenchmarkTables)
    app.add_directive("benchmark-others", BenchmarkOthers)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
