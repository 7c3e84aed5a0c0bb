"""``auto_layout``: every layout of a mesh costed from the cost model (and, on request, measured), ranked;
a ``Layout`` is applied to a model with ``apply_layout``."""

from spmd.parallel.auto._auto import AutoLayout, Candidate, auto_layout
from spmd.parallel.auto._layout import Layout, apply_layout

__all__ = ["auto_layout", "AutoLayout", "Candidate", "Layout", "apply_layout"]
