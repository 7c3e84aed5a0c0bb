"""Tensor-parallel styles under torch's names and semantics, for ``parallelize_module``.

A style says, for one submodule, how its parameters are cut over the ``tp`` mesh dim and in which layouts
its activations enter and leave it, as ``torch.distributed.tensor.parallel``'s styles do. ``ParallelStyle``
is the protocol the library calls (its methods below); the built-ins are ordinary subclasses of it, and a
user's own subclass is applied, trained, costed and ranked the same way:

- ``ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))``: the output features are cut
  (a ``Dense`` / nnx ``Linear`` kernel ``(in, out)`` is ``Shard(1)``, its bias ``Shard(0)``; an ``Embed``
  table is cut on its embedding dim); the input is made ``Replicate`` (all-gathered when it arrives
  ``Shard(1)`` under sequence parallelism); the output stays cut on the features, or is redistributed to
  ``output_layouts`` (``Replicate``: all-gathered).
- ``RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())``: the input features are cut
  (kernel ``Shard(0)``, bias whole; an ``Embed`` table is cut on the vocabulary, its input ids whole); the
  output, a partial sum over ``tp``, is reduced once: all-reduced to ``Replicate`` or reduce-scattered to
  ``Shard(1)`` (sequence parallelism).
- ``SequenceParallel(sequence_dim=1)``: a norm (any module whose parameters stay whole) runs on the
  device's positions: input and output ``Shard(sequence_dim)``; its parameters ``Replicate``.
- ``PrepareModuleInput`` / ``PrepareModuleOutput``: only activations: the layouts a module's inputs
  (outputs) arrive in and the ones it (its caller) needs.

The model runs in global view over ``tp`` (see ``spmd.parallel.styles._hooks``): every activation keeps its
global shape, and a layout is a sharding constraint. So code that reshapes by the *global* head count runs
unchanged, and ``use_local_output`` is accepted for porting but changes nothing: the next module sees the
global array either way.

A plan key may also name a module's method: ``"embed.attend": ColwiseParallel(output_layouts=Replicate())``
runs a tied output projection (linen ``Embed.attend``) column-parallel on the vocabulary, the table's rows
(with ``"embed": RowwiseParallel()``, the vocabulary-parallel lookup, or alone): each device computes its
vocabulary's logits; ``Replicate`` gathers them (the loss then needs no collective), ``Shard(-1)`` keeps
them cut (the user's loss in global view: XLA reduces per token).

``dim=`` names the kernel dim to cut explicitly: needed for module types the styles do not know (Hugging
Face's ``FlaxConv1D`` stores its kernel ``(out, in)``: ``ColwiseParallel(dim=0)``) and for a
``DenseGeneral`` whose first output axis is not the one to cut (heads of a ``(D, 3, H, hd)`` kernel:
``dim=2``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Mapping

from placements import Partial, Placement, Replicate, Shard

CP_DIM = "cp"  # the mesh dim the step cuts the batch's sequence over (spmd.parallel.context._calls)

__all__ = ["ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
           "ParallelStyle", "KNOWN_LINEAR", "KNOWN_EMBED"]

KNOWN_LINEAR = ("Dense", "DenseGeneral", "Linear", "LinearGeneral")  # linen Dense/DenseGeneral, nnx Linear
KNOWN_EMBED = ("Embed",)  # linen and nnx Embed


def _check_layout(style: str, arg: str, value: Any, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, Partial):
        raise ValueError(f"{style}: {arg}={value!r}: an activation layout here is Shard(d) or Replicate(); a "
                         "Partial activation is reduced by the style itself (RowwiseParallel's output).")
    if not isinstance(value, (Shard, Replicate)):
        raise TypeError(f"{style}: {arg}={value!r} must be Shard(d) or Replicate() (from placements or spmd).")


def _check_layouts(style: str, arg: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _check_layout(style, f"{arg}[{i}]", v)  # None: not a tensor input, left alone
        return
    _check_layout(style, arg, value)


def _check_dim(style: str, dim: Any) -> None:
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
        raise TypeError(f"{style}: dim={dim!r} must be an int (a dim of the module's kernel, negative from the end) "
                        "or None (the style's default for the module type).")


def _check_bool(style: str, arg: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{style}: {arg}={value!r} must be a bool.")


class ParallelStyle:
    """A parallel style, as torch's: how one module runs over the tensor-parallel mesh dim. Subclass it.

    A style owns (a) its parameters' placements over ``tp`` and (b) the layouts its activations arrive in,
    are computed in and leave in; the library derives every collective from those layouts (the lowering
    table of ``placements``) and writes it out, in the step and in its communication table alike. The
    built-in styles are ordinary subclasses. The methods the library calls, with their defaults (a style
    that replicates its module's parameters and leaves its activations as they come):

    - ``param_placements(module_path, params, module_type=None) -> {name: Placement}``: the placement over
      tp of each of the module's own parameters (``params``: ``{name: global shape}``; ``Shard(d)`` or
      ``Replicate()``). Called when the plan is made (``module_type`` None: types are not in a parameter
      tree) and at the module's first call with its class name (a style may refuse a type there, with a
      ``ValueError`` naming the fix).
    - ``input_layouts_for(module_type) -> (given, desired)``: the layout the first positional input arrives
      in, and the one the module's computation needs (``Shard(d)`` / ``Replicate()``; None: as it comes).
      ``Shard(d) -> Replicate`` is an all-gather; ``Replicate -> Shard(d)`` a local slice; a ``Replicate``
      floating input of a local computation has its gradient all-reduced (Megatron's ``f``).
    - ``output_layouts_for(module_type) -> (given, desired)``: the layout the computation produces and the
      one the caller receives: ``Partial()`` (partial sums: all-reduced to ``Replicate``, reduce-scattered
      to ``Shard(d)``, Megatron's ``g``), ``Shard(-1)`` (the output features, cut where the module's kernel is
      cut: all-gathered to ``Replicate``), ``Shard(d)`` or ``Replicate()``. A ``bias`` parameter whole over
      tp is added once, after a ``Partial`` output's reduction.
    - ``kwarg_layouts() -> ({keyword: given}, {keyword: desired})``: keyword inputs' layouts (global view).
    - ``runs_on_blocks() -> bool``: True: the module runs on this device's tp blocks of its parameters and
      input, in a region manual over tp, every collective between the layouts above written out; every
      parameter whole over tp it reads has its gradient all-reduced. False: it runs in global view and the
      layouts are sharding constraints (``PrepareModuleInput`` / ``PrepareModuleOutput``).
    - ``map_layouts(fn) -> ParallelStyle``: the style with the activation layouts it names *between*
      modules (a sequence or batch cut, not its features) mapped by ``fn`` (``weight_stationary_plan``
      moves ``Shard(1)`` to ``Shard(0)``); the default names none.

    - ``run_call(call) -> output``: the module's call under the style (torch's ``_apply``: what a style installs
      around the module's forward). The default is the above: the layouts, every collective between them
      written out by the library. ``fully_shard``'s unit (``FullyShardUnit``: its parameters gathered before the
      call, their gradients reduce-scattered) and activation checkpointing (``ActivationCheckpoint``: the call
      under ``jax.checkpoint``) and ``ExpertParallel`` (its tokens exchanged over ep) override it; the hooks hand
      every intercepted call to the first style that applies to it (a unit's, then checkpointing's, then the one
      on ep, then the tensor-parallel one), and ``call.apply`` runs the module's own code, where the next style
      applies in turn.

    ``cuts_kernel``: True where the style only applies to a module holding a kernel of 2+ dims or an
    ``Embed`` table (``parallelize_module`` refuses it elsewhere, naming the modules under it that hold one).
    """

    cuts_kernel: ClassVar[bool] = False

    def param_placements(self, module_path: str, params: Mapping[str, tuple[int, ...]],
                         module_type: str | None = None) -> dict[str, Placement]:
        return {name: Replicate() for name in params}

    def input_layouts_for(self, module_type: str | None) -> tuple[Any, Any]:
        """``(given, desired)`` layouts of the positional inputs: one layout for the first input, or a tuple."""
        return None, None

    def output_layouts_for(self, module_type: str | None) -> tuple[Any, Any]:
        return None, None

    def kwarg_layouts(self) -> tuple[dict, dict]:
        return {}, {}

    def runs_on_blocks(self) -> bool:
        return True

    def map_layouts(self, fn: Callable[[Any], Any]) -> ParallelStyle:
        return self

    def run_call(self, call: Any) -> Any:
        """``call`` (a ``spmd.parallel.styles._hooks.ModuleCall``) run under this style; default: its layouts."""
        return call.with_layouts(self)

    def activation_layouts(self) -> list:
        """The layouts ``map_layouts`` reaches (derived: override ``map_layouts``)."""
        seen: list = []

        def record(x):
            seen.append(x)
            return x

        self.map_layouts(lambda x: _map_nested(x, record))
        return seen

    def __str__(self) -> str:
        return repr(self)


def _map_nested(layout: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` on every layout in ``layout`` (a layout, None, or a tuple / list / dict of them)."""
    if layout is None:
        return None
    if isinstance(layout, (tuple, list)):
        return type(layout)(_map_nested(x, fn) for x in layout)
    if isinstance(layout, dict):
        return {k: _map_nested(v, fn) for k, v in layout.items()}
    return fn(layout)


def _cut_bias(params: Mapping[str, tuple], kernel: Placement) -> Placement:
    """A column-parallel bias follows its kernel's cut output axis (a kernel ``(in..., out...)``: the trailing
    dims; stored ``(out, in)``, as FlaxConv1D's: the one dim of the cut size)."""
    if "bias" not in params:
        return Replicate()
    bshape = tuple(params["bias"])
    if "kernel" not in params or not isinstance(kernel, Shard):
        return Shard(0) if len(bshape) >= 1 and "kernel" not in params else Replicate()
    kshape = tuple(params["kernel"])
    kd = kernel.dim % len(kshape)
    bd = kd - (len(kshape) - len(bshape))
    if bd < 0 or bshape[bd] != kshape[kd]:
        same = [d for d in range(len(bshape)) if bshape[d] == kshape[kd]]
        bd = same[0] if len(same) == 1 else None
    return Shard(bd) if bd is not None and bd >= 0 else Replicate()


def _kernel_dim(style: str, path: str, module_type: str | None, shape: tuple[int, ...], dim: int | None,
                default: int) -> int:
    if dim is None and module_type is not None and module_type not in KNOWN_LINEAR + KNOWN_EMBED:
        raise ValueError(
            f"{style}: module {path!r} is a {module_type}, a module type the style does not know (it knows "
            f"{', '.join(KNOWN_LINEAR + KNOWN_EMBED)}); say which kernel dim to cut: {style}(dim=d) with d a dim of "
            f"its kernel of shape {shape} (for a kernel stored (out, in), as FlaxConv1D's: ColwiseParallel(dim=0), "
            "RowwiseParallel(dim=1)).")
    d = default if dim is None else dim
    if not -len(shape) <= d < len(shape):
        raise ValueError(f"{style}: dim={d} is out of range for the kernel of {path!r} of shape {shape}; use a dim in "
                         f"[{-len(shape)}, {len(shape) - 1}].")
    return d % len(shape)


@dataclass(frozen=True)
class _KernelStyle(ParallelStyle):
    """Colwise's and Rowwise's arguments (torch's) and their checks: they differ in the kernel dim they cut."""

    cuts_kernel: ClassVar[bool] = True

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True
    dim: int | None = None

    def __post_init__(self):
        w = type(self).__name__
        _check_layout(w, "input_layouts", self.input_layouts)
        _check_layout(w, "output_layouts", self.output_layouts)
        _check_bool(w, "use_local_output", self.use_local_output)
        _check_dim(w, self.dim)


@dataclass(frozen=True)
class ColwiseParallel(_KernelStyle):
    """torch's ``ColwiseParallel``: cut the output features (see the module doc)."""

    def param_placements(self, module_path, params, module_type=None):
        out = {name: Replicate() for name in params}
        for name in ("embedding", "kernel"):  # an Embed table (vocab, features): the features are its output
            if name in params:
                shape = tuple(params[name])
                out[name] = Shard(_kernel_dim("ColwiseParallel", module_path, module_type, shape, self.dim,
                                              1 if name == "embedding" else -1))
        if "bias" in params:
            out["bias"] = _cut_bias(params, out.get("kernel"))
        return out

    def input_layouts_for(self, module_type):
        desired = Replicate()
        return (self.input_layouts or Replicate()), desired

    def output_layouts_for(self, module_type):
        return Shard(-1), (self.output_layouts or Shard(-1))

    def map_layouts(self, fn):
        return replace(self, input_layouts=_map_nested(self.input_layouts, fn))


@dataclass(frozen=True)
class RowwiseParallel(_KernelStyle):
    """torch's ``RowwiseParallel``: cut the input features; the output reduced once (see the module doc)."""

    def param_placements(self, module_path, params, module_type=None):
        out = {name: Replicate() for name in params}  # the bias: added once after the reduction
        for name in ("kernel", "embedding"):  # kernel (in, out): the input rows; Embed (vocab, features): the vocab
            if name in params:
                out[name] = Shard(_kernel_dim("RowwiseParallel", module_path, module_type, tuple(params[name]),
                                              self.dim, 0))
        return out

    def input_layouts_for(self, module_type):
        if module_type in KNOWN_EMBED:  # token ids arrive whole
            return (self.input_layouts or Replicate()), Replicate()
        return (self.input_layouts or Shard(-1)), Shard(-1)

    def output_layouts_for(self, module_type):
        return Partial(), (self.output_layouts or Replicate())

    def map_layouts(self, fn):
        return replace(self, output_layouts=_map_nested(self.output_layouts, fn))


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """torch's ``SequenceParallel``: the module runs on the device's positions; its parameters stay whole."""

    sequence_dim: int = 1
    use_local_output: bool = False

    def __post_init__(self):
        if isinstance(self.sequence_dim, bool) or not isinstance(self.sequence_dim, int):
            raise TypeError(f"SequenceParallel: sequence_dim={self.sequence_dim!r} must be an int.")
        _check_bool("SequenceParallel", "use_local_output", self.use_local_output)

    def input_layouts_for(self, module_type):
        return Shard(self.sequence_dim), Shard(self.sequence_dim)

    def output_layouts_for(self, module_type):
        return Shard(self.sequence_dim), Shard(self.sequence_dim)

    def map_layouts(self, fn):
        moved = fn(Shard(self.sequence_dim))
        return replace(self, sequence_dim=moved.dim) if isinstance(moved, Shard) else self


@dataclass(frozen=True)
class PrepareModuleInput(ParallelStyle):
    """torch's ``PrepareModuleInput``: the layouts a module's inputs arrive in, and the ones it needs."""

    input_layouts: Any = None
    desired_input_layouts: Any = None
    input_kwarg_layouts: Any = None
    desired_input_kwarg_layouts: Any = None
    use_local_output: bool = False

    def __post_init__(self):
        w = "PrepareModuleInput"
        _check_layouts(w, "input_layouts", self.input_layouts)
        _check_layouts(w, "desired_input_layouts", self.desired_input_layouts)
        for arg in ("input_kwarg_layouts", "desired_input_kwarg_layouts"):
            v = getattr(self, arg)
            if v is not None and not isinstance(v, dict):
                raise TypeError(f"{w}: {arg}={v!r} must be a dict of keyword name -> Shard(d)/Replicate().")
            for k, p in (v or {}).items():
                _check_layout(w, f"{arg}[{k!r}]", p)
        if (self.input_layouts is None) != (self.desired_input_layouts is None) or (
                isinstance(self.input_layouts, (tuple, list)) and len(self.input_layouts) != len(
                    self.desired_input_layouts if isinstance(self.desired_input_layouts, (tuple, list)) else ())):
            raise ValueError(f"{w}: input_layouts={self.input_layouts!r} and desired_input_layouts="
                             f"{self.desired_input_layouts!r} must both be given, with one entry per input.")
        _check_bool(w, "use_local_output", self.use_local_output)

    def input_layouts_for(self, module_type):
        return self.input_layouts, self.desired_input_layouts

    def kwarg_layouts(self):
        return dict(self.input_kwarg_layouts or {}), dict(self.desired_input_kwarg_layouts or {})

    def runs_on_blocks(self):
        return False

    def map_layouts(self, fn):
        return replace(self, input_layouts=_map_nested(self.input_layouts, fn),
                       desired_input_layouts=_map_nested(self.desired_input_layouts, fn),
                       input_kwarg_layouts=_map_nested(self.input_kwarg_layouts, fn),
                       desired_input_kwarg_layouts=_map_nested(self.desired_input_kwarg_layouts, fn))


@dataclass(frozen=True)
class PrepareModuleOutput(ParallelStyle):
    """torch's ``PrepareModuleOutput``: the layouts a module's outputs are in, and the ones its caller needs."""

    output_layouts: Any = None
    desired_output_layouts: Any = None
    use_local_output: bool = True

    def __post_init__(self):
        w = "PrepareModuleOutput"
        _check_layouts(w, "output_layouts", self.output_layouts)
        _check_layouts(w, "desired_output_layouts", self.desired_output_layouts)
        if self.output_layouts is None or self.desired_output_layouts is None:
            raise ValueError(f"{w}: give both output_layouts and desired_output_layouts (got {self.output_layouts!r}, "
                             f"{self.desired_output_layouts!r}).")
        _check_bool(w, "use_local_output", self.use_local_output)

    def output_layouts_for(self, module_type):
        return self.output_layouts, self.desired_output_layouts

    def runs_on_blocks(self):
        return False

    def map_layouts(self, fn):
        return replace(self, output_layouts=_map_nested(self.output_layouts, fn),
                       desired_output_layouts=_map_nested(self.desired_output_layouts, fn))

