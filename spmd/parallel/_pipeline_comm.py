"""What a pipelined step communicates, analytically (the table) and in compiled HLO (the pairs)."""

from __future__ import annotations

import re

import numpy as np

__all__ = ["STAGES", "REST", "pipeline_communication", "format_pipeline_communication", "hlo_permute_pairs"]

STAGES, REST = "stages", "rest"  # the stored tree: the stacked unit parameters, the others by path


def pipeline_communication(pm, lay, accum_steps: int) -> dict:
    """What one step communicates per device, in ``spmd.parallel.hlo_executed_collectives``' terms (scalars
    aside): one ``collective-permute`` per tick with sends each way, moving one micro-batch's activation
    (``B / (M x data) x T x D`` elements) over each of ``pairs`` stage boundaries (``M x (stages - 1)`` each way per
    pipeline); one all-reduce of the stage gradients over the data dims and one of the other gradients over
    pp and the data dims. Plus the schedule's bubble and activation slots."""
    s = pm.schedule
    act = lay.act
    n_data = int(np.prod([pm.mesh.size(d) for d in pm.data_dims])) if pm.data_dims else 1
    ops = {k: sum(1 for p in s.sends(k) if p) * accum_steps for k in ("F", "B")}
    pairs = {k: v * accum_steps for k, v in s.transfers().items()}

    def nbytes(x):
        return int(np.prod(x.shape)) * x.dtype.itemsize

    ab = nbytes(act)
    stored = lay.stored_shapes()
    st = stored[STAGES]
    cut = [rel for rel in lay.rel if lay.fsdp_dim(rel) is not None]
    whole = sum(nbytes(st[rel]) for rel in lay.rel if rel not in cut) // s.pp
    gathered = sum(nbytes(st[rel]) for rel in cut) // s.pp  # a rank's stages, full over fsdp
    n_other = n_data // (lay.n_fsdp or 1)
    rest_bytes = sum(nbytes(x) for x in stored[REST].values())
    ar = rest_bytes + (whole if n_data > 1 else 0) + (gathered // lay.n_fsdp if cut and n_other > 1 else 0)
    return {
        "collective-permute": {"count": ops["F"] + ops["B"], "bytes": (ops["F"] + ops["B"]) * ab,
                               "pairs": pairs, "ops": {"forward": ops["F"], "backward": ops["B"]}},
        "all-reduce": {"bytes": ar},
        "all-gather": {"bytes": gathered, "buffers": len(cut)},
        "reduce-scatter": {"bytes": gathered, "buffers": len(cut)},
        "schedule": s.name, "pp": s.pp, "num_microbatches": s.num_microbatches, "stages_per_rank": s.stages_per_rank,
        "activation_shape": tuple(act.shape), "activation_bytes": ab, "bubble": s.bubble, "bubble_formula": s.formula,
        "activation_slots": max(s.x_slots), "gradient_slots": max(s.g_slots),
        "activation_bound_bytes": (max(s.x_slots) + max(s.g_slots)) * ab,
    }


def hlo_permute_pairs(text: str, n_replicas: int = 1) -> int:
    """Source-target pairs of the collective-permutes in HLO ``text``, per pipeline (``n_replicas``: data
    replicas, each its own pairs in one op); loop bodies counted once."""
    pairs = 0
    for line in text.splitlines():
        if re.search(r"collective-permute(-start)?\(", line):
            m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
            pairs += m[1].count("{") if m else 0
    return pairs // n_replicas


def format_pipeline_communication(c: dict) -> str:
    cp = c["collective-permute"]
    return (f"pipeline {c['schedule']} pp={c['pp']} M={c['num_microbatches']} v={c['stages_per_rank']}: "
            f"{cp['pairs']['forward']} activation + {cp['pairs']['backward']} gradient transfers of "
            f"{c['activation_shape']} per pipeline (M x (stages - 1) each way) in {cp['count']} collective-permutes "
            f"({cp['bytes']} bytes); all-reduce {c['all-reduce']['bytes']} bytes; bubble {c['bubble']:.4f} (formula "
            f"{c['bubble_formula']:.4f}); {c['activation_slots']} activation + {c['gradient_slots']} gradient slots "
            f"per rank ({c['activation_bound_bytes']} bytes)")
