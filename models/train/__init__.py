"""The training job: a flax model trained on all visible devices, data parallel (dp), fully sharded (fsdp) and
tensor parallel (tp), as ``--mesh`` says.

    python -m models.train                       # transformer sorting digits, 8 CPU fake devices
    python -m models.train --model mlp --steps 300
    python -m models.train --text README.md --steps 200 --out runs/text
    python -m models.train --resume              # continue runs/default from its last checkpoint, its flags

With no ``XLA_FLAGS`` set (and no multi-process launcher), the command line
asks JAX for 8 CPU fake devices before JAX starts. Under ``spmdrun``
(``WORLD_SIZE`` > 1) it joins the process group first; every process runs the
same program and process 0 writes the progress bar, the plot and the metrics.

Outputs under ``--out`` (default ``runs/default``): ``checkpoints/<step>/``
(orbax, with checksums), ``metrics.json`` (config, per-step history, final
evaluation, timing) and ``loss.png``; ``.lock`` while a run holds the folder.

``--resume`` takes the run's flags from its checkpoint (a flag given again must have the saved value; the
mesh, ``--save-every`` and ``--log-every`` may change), says the step it resumed from, and reports the steps it
ran itself; a finished run has nothing to do. Without a terminal (a pipe, a log, ``spmdrun``) the progress
bar is whole lines.

The parts: ``_config`` (the frozen ``Config``, its checks, the mesh spec; no
JAX), ``_programs`` (mesh, task, model, loss, optimizer, batch layout, the
jitted programs), ``_eval`` (held-out accuracy), ``_loop`` (the step loop and
its ``MetricLog``), ``_outdir`` (the ``--out`` lock, what may be replaced, the
outputs), ``_auto`` (``--mesh auto``: ``auto_layout`` picks the layout, which runs as its explicit flags),
``_run`` (``run``, ``restore_state``), ``_cli`` (argparse, ``main``).
Importing this package does not import JAX; its names load on first use.
"""

from __future__ import annotations

from models._lazy import lazy_names

__all__ = ["Config", "run", "main", "parse_args", "build_mesh", "restore_state", "parse_mesh", "cross_entropy",
           "RunLockedError"]

_WHERE = {
    "Config": "models.train._config",
    "parse_mesh": "models.train._config",
    "parse_args": "models.train._cli",
    "main": "models.train._cli",
    "run": "models.train._run",
    "restore_state": "models.train._run",
    "build_mesh": "models.train._programs",
    "cross_entropy": "models.train._programs",
    "RunLockedError": "models.train._outdir",
}


__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
