"""Loops in a compiled program's cost: XLA's ``cost_analysis()`` counts a ``while`` body once, whatever its
trip count, so a model whose blocks run under ``nn.scan`` / ``lax.scan`` (and a step that accumulates in a
loop) reads as one block's work. ``loop_extra`` reads the optimized HLO text: for every ``while`` whose trip
count XLA knows (``backend_config`` ``known_trip_count``), its body's flops and bytes accessed counted as
XLA's cost analysis counts them, and returns what the other ``n - 1`` trips add (nested loops multiplied
through). Counted per instruction, as ``HloCostAnalysis`` does:

- **flops**: a ``dot`` ``2 x`` its output elements ``x`` its contracted size; an elementwise arithmetic op (and
  ``compare``, ``select``, ``clamp``, ``convert``) one per output element, a transcendental (``exp``, ``log``,
  ``tanh``, ...) none (XLA counts those apart); a ``reduce`` one per input element; a fusion, ``call``,
  ``conditional`` branch (the largest) or nested ``while`` by the computations it calls;
- **bytes accessed**: each instruction of the body (fusions whole) its operands' and output's bytes, the
  tuple plumbing (``parameter``, ``get-tuple-element``, ``tuple``, ``bitcast``, ``constant``) none.

A loop traced under the named scope ``ON_CHIP`` is a fused kernel written as a loop over tiles (the planning
kernel of ``jax.nn.dot_product_attention(implementation="cudnn")``, ``spmd.parallel.auto._fused``): on the GPU
its tiles' intermediates (the scores, their softmax, a tile's gradients) live in on-chip memory, so of its body
only what crosses to the device's memory counts: what it reads of the loop's carried and invariant buffers (the
tiles it slices out of them, or a whole operand read) and what it writes back into the carry (an updated
tile). XLA:CPU's count of its body once (every intermediate read and written) is replaced by that, times the
trips: Llama 3 8B (seq 8192, 32 heads) had 1.9e11 bytes a layer in its attention loops so counted, about two
thirds of the step's, where FlashAttention moves a few GB (Dao et al. 2022, Theorem 2: ``O(T^2 d^2 / M)``).
"""

from __future__ import annotations

import math
import re

__all__ = ["loop_extra", "ON_CHIP"]

ON_CHIP = "spmd_on_chip"  # the named scope of a loop whose tiles stay on chip (see the module doc)

_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "sign", "compare",
                "select", "clamp", "convert", "and", "or", "not", "xor", "remainder", "floor", "ceil",
                "round-nearest-even", "round-nearest-afz", "shift-left", "shift-right-logical",
                "shift-right-arithmetic", "is-finite", "power", "atan2"}
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "iota"}
_ITEM = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) (?:\(.*\) -> .*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")


def _arrays(typ: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(typ) if dt in _ITEM]


def _bytes(typ: str) -> int:
    return sum(_ITEM[dt] * math.prod(s) for dt, s in _arrays(typ))


def _elements(typ: str) -> int:
    return sum(math.prod(s) for _, s in _arrays(typ))


def _parse(text: str) -> dict:
    """``{computation: [(name, type, opcode, rest)]}`` of an HLO module's text."""
    comps, cur = {}, None
    for line in text.splitlines():
        if cur is None:
            m = _COMP.match(line)
            if m and not line.startswith(" "):
                cur = comps.setdefault(m[1], [])
            continue
        if line.startswith("}"):
            cur = None
            continue
        m = _INSTR.match(line)
        if m:
            cur.append((m[1], m[2], m[3], m[4]))
    return comps


def _operands(rest: str) -> list[str]:
    """The ``%name`` operands of an instruction (before its attributes)."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _attr(rest: str, key: str) -> list[str]:
    m = re.search(rf"\b{key}=\{{?([^}},]*(?:,\s*%[\w.\-]+)*)\}}?", rest)
    return re.findall(r"%?([\w.\-]+)", m[1]) if m else []


class _Cost:
    def __init__(self, text: str):
        self.comps = _parse(text)
        self.types = {c: {n: t for n, t, _, _ in ins} for c, ins in self.comps.items()}
        self.memo: dict = {}

    def _moved(self, comp: str, typ: str, op: str, rest: str) -> float:
        """Bytes an instruction reads and writes: its output and operands, but of an operand only sliced (a
        ``dynamic-slice``'s, or a fusion parameter whose users all slice it) the slices, and of one updated in
        place (a ``dynamic-update-slice``'s buffer) and that output, the update."""
        types, ops = self.types.get(comp, {}), _operands(rest)
        if op == "dynamic-slice":
            return 2.0 * _bytes(typ)
        if op == "dynamic-update-slice" and len(ops) > 1:
            return 2.0 * _bytes(types.get(ops[1], ""))
        if op != "fusion":
            return _bytes(typ) + sum(_bytes(types.get(o, "")) for o in ops)
        called = (_attr(rest, "calls") or [""])[0]
        inner = self.comps.get(called, [])
        params = {int(m[1]): n for n, _, o, r in inner if o == "parameter" and (m := re.match(r"(\d+)\)", r))}
        itypes = self.types.get(called, {})
        out = _bytes(typ)
        root = inner[-1] if inner else None
        if root is not None and root[2] == "dynamic-update-slice":
            rops = _operands(root[3])
            out = _bytes(itypes.get(rops[1], "")) if len(rops) > 1 else out
        total = out
        for i, o in enumerate(ops):
            part = self._param_read(called, params.get(i))
            total += _bytes(types.get(o, "")) if part is None else part
        return total

    def _param_read(self, called: str, p: str | None, mixed: bool = False) -> float | None:
        """Bytes a fusion (computation ``called``) reads of its parameter ``p``: of one only sliced, the slices;
        of one only updated in place (a ``dynamic-update-slice``'s buffer), none (the update is the output's); with
        ``mixed``, of one both sliced and updated in place (a tile read, changed and written back), the slices;
        else None (read whole)."""
        inner, itypes = self.comps.get(called, []), self.types.get(called, {})
        users = [(u, uo, ur) for u, _, uo, ur in inner if p is not None and p in _operands(ur)]
        sliced = [uo in ("dynamic-slice", "slice") for _, uo, _ in users]
        updated = [uo == "dynamic-update-slice" and _operands(ur)[0] == p for _, uo, ur in users]
        if not users or not all(a or b for a, b in zip(sliced, updated)) or (any(sliced) and any(updated)
                                                                              and not mixed):
            return None
        return float(sum(_bytes(itypes.get(u, "")) for (u, _, _), a in zip(users, sliced) if a))

    def kernel_bytes(self, body: str) -> tuple[float, float]:
        """``(per trip, once)``: the bytes an ``ON_CHIP`` loop's ``body`` moves to and from the device's memory
        (see the module doc): of the body parameter's elements (``get-tuple-element``: the carried and invariant
        buffers) what each instruction reads (a tile it slices out, else the whole), and of the carry's new
        values (the root tuple's operands) what is written (a tile updated in place: the update). An invariant
        buffer read whole (passed through the carry unchanged: what XLA hoisted out of the body, a tile-sized
        fill or mask the kernel makes in registers) is read once, not every trip."""
        ins = self.comps.get(body, [])
        types = self.types.get(body, {})
        index = {n: int(m[1]) for n, _, o, r in ins if o == "get-tuple-element" and (m := re.search(r"index=(\d+)", r))}
        root = _operands(ins[-1][3]) if ins and ins[-1][2] == "tuple" else []
        invariant = {n for n, i in index.items() if i < len(root) and root[i] == n}
        written = set(root) - set(index)
        trip = once = 0.0

        def read(o: str, nbytes: float) -> None:
            nonlocal trip, once
            if o in invariant and nbytes >= _bytes(types.get(o, "")):
                once += nbytes
            else:
                trip += nbytes

        for name, typ, op, rest in ins:
            if op in _FREE:
                continue
            ops = _operands(rest)
            if op == "dynamic-slice":
                if ops and ops[0] in index:
                    trip += _bytes(typ)
                continue
            if op == "dynamic-update-slice" and len(ops) > 1:
                trip += _bytes(types.get(ops[1], "")) if name in written else 0.0
                continue
            if op != "fusion":
                for o in ops:
                    if o in index:
                        read(o, _bytes(types.get(o, "")))
                trip += _bytes(typ) if name in written else 0.0
                continue
            called = (_attr(rest, "calls") or [""])[0]
            inner = self.comps.get(called, [])
            params = {int(m[1]): n for n, _, o, r in inner if o == "parameter" and (m := re.match(r"(\d+)\)", r))}
            itypes = self.types.get(called, {})
            for i, o in enumerate(ops):
                if o in index:
                    part = self._param_read(called, params.get(i), mixed=True)
                    if part is None:  # read whole
                        read(o, _bytes(types.get(o, "")))
                    else:
                        trip += part
            if name in written:
                last = inner[-1] if inner else None
                rops = _operands(last[3]) if last is not None and last[2] == "dynamic-update-slice" else []
                trip += _bytes(itypes.get(rops[1], "")) if len(rops) > 1 else _bytes(typ)
        return trip, once

    def cost(self, comp: str, unrolled: bool, top: bool = True) -> tuple[float, float]:
        """(flops, bytes) of ``comp``: its loops' bodies once (``unrolled=False``, XLA's count) or trip-count
        times; bytes only at the top level of a computation (a fusion's inside moves nothing)."""
        key = (comp, unrolled, top)
        if key in self.memo:
            return self.memo[key]
        flops = nbytes = 0.0
        types = self.types.get(comp, {})
        for name, typ, op, rest in self.comps.get(comp, []):
            if op in _FREE:
                continue
            if top and op != "while":  # a loop's own tuple moves nothing: its body's instructions do
                nbytes += self._moved(comp, typ, op, rest)
            if op == "dot":
                ops = _operands(rest)
                lhs = _arrays(types.get(ops[0], "")) if ops else []
                dims = [int(d) for d in re.findall(r"\d+", (re.search(r"lhs_contracting_dims=\{([^}]*)\}", rest)
                                                              or [None, ""])[1])]
                k = math.prod(lhs[0][1][d] for d in dims) if lhs else 1
                flops += 2 * _elements(typ) * k
            elif op in _ELEMENTWISE:
                flops += _elements(typ)
            elif op == "reduce":
                ops = _operands(rest)
                flops += sum(_elements(types.get(o, "")) for o in ops[:max(len(ops) // 2, 1)])
            elif op == "fusion" or op == "call":
                for c in _attr(rest, "calls") or _attr(rest, "to_apply"):
                    flops += self.cost(c, unrolled, top=False)[0]
            elif op == "conditional":
                branches = _attr(rest, "branch_computations") or (_attr(rest, "true_computation")
                                                                   + _attr(rest, "false_computation"))
                got = [self.cost(c, unrolled, top) for c in branches]
                if got:
                    f, b = max(got)
                    flops += f
                    nbytes += b if top else 0.0
            elif op == "while":
                body = _attr(rest, "body")
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
                f, b = self.cost(body[0], unrolled, top) if body else (0.0, 0.0)
                times = int(n[1]) if (n and unrolled) else 1
                flops += times * f
                if unrolled and body and ON_CHIP in rest and top:  # a fused kernel's loop: its tiles on chip
                    trip, once = self.kernel_bytes(body[0])
                    nbytes += times * trip + once
                else:
                    nbytes += times * b if top else 0.0
        self.memo[key] = (flops, nbytes)
        return flops, nbytes


def loop_extra(text: str) -> tuple[float, float]:
    """(flops, bytes accessed) the loops of the HLO module ``text`` add beyond one trip each (see the module
    doc): 0 for a program without a ``while`` of known trip count. The bytes are negative where an ``ON_CHIP``
    loop's trips move less than XLA's count of its body once."""
    if " while(" not in text or "known_trip_count" not in text:
        return 0.0, 0.0
    c = _Cost(text)
    entry = next((m[1] for m in re.finditer(r"^ENTRY %?([\w.\-]+)", text, re.M)), None)
    if entry is None:
        return 0.0, 0.0
    full, once = c.cost(entry, True), c.cost(entry, False)
    return max(full[0] - once[0], 0.0), full[1] - once[1]
