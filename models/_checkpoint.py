"""Checkpoints of a training run with orbax-checkpoint.

``Checkpointer(directory)`` keeps numbered steps under ``directory`` (orbax's
``CheckpointManager``): each step holds the train state (a pytree of arrays)
and a small JSON ``meta`` (run config, metrics history). Saves are
asynchronous where orbax offers it: the step returns once the arrays are
copied off the devices, and the files are written in the background.

Guarantees:
- a save is atomic (orbax writes a temporary folder and renames it when
  complete), so an interrupted save never replaces a good checkpoint;
- ``restore`` onto any mesh: pass a target state whose arrays carry the
  shardings wanted (saved on 8 devices, restored on 4 or 2);
- a missing or unreadable checkpoint raises ``CheckpointError`` naming the
  folder and the step, and leaves the files as they are;
- integrity: each step also holds ``checksums/`` (JSON): a digest of every
  array of the state (``_checksum.array_digests``, computed from the global
  value, so it does not depend on the mesh) and of the meta. ``restore`` and
  ``restore_meta`` verify them; a mismatch raises ``CheckpointError`` naming
  the step and the array (or the meta), touches no file and says how to fall
  back to the previous step. A step saved without checksums (by an older
  version) restores with a warning;
- a deletion is atomic too: orbax moves an old step into ``deleting/`` (one
  rename) before its files are removed, so a run killed while deleting never
  leaves a half-deleted step listed as finished. A step folder older than a
  finished one that lacks a file every finished save writes
  (``interrupted_deletions``: a deletion stopped half-way, file by file) is not
  listed; the first ``Checkpointer`` on the folder removes it and says so in
  ``removed``. The latest step missing files is damage, not a deletion (orbax
  deletes old steps only): it stays, and restoring it raises ``CheckpointError``.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp

from models._checksum import array_digests, json_digest

__all__ = ["Checkpointer", "CheckpointError", "abstract_like", "scan", "interrupted_deletions"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, cannot be read, or fails its checksums."""


_ITEMS = ("state", "meta", "checksums")
_DELETING = "deleting"  # orbax's todelete_subdir: a step to delete is renamed here, then removed
_ITEM_FILES = {"state": "_METADATA", "meta": "metadata", "checksums": "metadata"}  # what each item's save writes


def _lacks(step_dir: str) -> str | None:
    """What a step folder lacks of what every finished save writes (orbax's ``_CHECKPOINT_METADATA``, and each
    item it names with its own metadata file); None if nothing."""
    try:
        with open(os.path.join(step_dir, "_CHECKPOINT_METADATA")) as f:
            items = json.load(f).get("item_handlers") or {}
    except (OSError, ValueError, AttributeError):
        return "_CHECKPOINT_METADATA"
    for item in items:
        need = os.path.join(item, _ITEM_FILES.get(item, ""))
        if not os.path.exists(os.path.join(step_dir, need)):
            return need.rstrip("/")
    return None


def interrupted_deletions(directory: str | os.PathLike) -> dict[int, str]:
    """The steps under a checkpoint folder whose deletion stopped half-way, and what each lacks: a step folder
    missing a file every finished save writes, older than a finished step (orbax deletes old steps only)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return {}
    lacks = {s: _lacks(os.path.join(directory, str(s))) for s in ocp.path.step.checkpoint_steps(directory)}
    finished = [s for s, what in lacks.items() if what is None]
    return {s: what for s, what in sorted(lacks.items()) if what is not None and finished and s < max(finished)}


def abstract_like(tree: Any, sharding: Any = None) -> Any:
    """``jax.ShapeDtypeStruct`` leaves for ``tree`` (with ``sharding``, or each leaf's own)."""

    def one(x):
        s = sharding if sharding is not None else getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree.map(one, tree)


def scan(directory: str | os.PathLike) -> tuple[list[int], list[str]]:
    """(finished steps, names of unfinished saves and deletions) under a checkpoint folder; empty if it does not
    exist.

    An unfinished save is orbax's temporary folder (``200.orbax-checkpoint-tmp``) left by a save that was
    killed before it completed; an unfinished deletion a step folder missing files (``interrupted_deletions``).
    Neither is ever restored from.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return [], []
    unfinished = sorted(n for n in os.listdir(directory) if ocp.path.step.TMP_DIR_SUFFIX in n)
    broken = interrupted_deletions(directory)
    steps = sorted(s for s in ocp.path.step.checkpoint_steps(directory) if s not in broken)
    return steps, unfinished + [str(s) for s in broken]


class Checkpointer:
    """Save and restore ``(state, meta)`` every ``save_every`` steps under ``directory``.

    ``max_to_keep`` most recent steps are kept (``None``: all).
    """

    def __init__(self, directory: str | os.PathLike, *, save_every: int = 1, max_to_keep: int | None = 3,
                 async_save: bool = True):
        where = "Checkpointer"
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"{where}: directory={directory!r} must be a path.")
        if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
            raise ValueError(f"{where}: save_every={save_every!r} must be an int >= 1.")
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(
                f"{where}: directory={self.directory!r} exists and is not a folder; give a folder for checkpoints."
            )
        self.save_every = save_every
        # before orbax lists the steps: the half-deleted ones go (one process removes, every one skips them)
        self.removed = self._remove_incomplete() if jax.process_index() == 0 else []
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_every,
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=True,
            todelete_subdir=_DELETING,  # a deletion is one rename (atomic), then _empty_deleting removes it
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

    def __repr__(self) -> str:
        return f"Checkpointer({self.directory!r}, save_every={self.save_every})"

    def _remove_incomplete(self) -> list[str]:
        """Remove the step folders an interrupted deletion left (``interrupted_deletions``) and ``deleting/``;
        one line per step removed, saying why."""
        self._empty_deleting(folder_too=True)
        out = []
        for step, lacks in interrupted_deletions(self.directory).items():
            shutil.rmtree(os.path.join(self.directory, str(step)), ignore_errors=True)
            out.append(f"removed the checkpoint of step {step} in {self.directory!r}: it lacks {lacks} (its "
                       "deletion was interrupted); it is not restored from.")
        return out

    def _empty_deleting(self, *, folder_too: bool = False) -> None:
        """Remove what orbax moved into ``deleting/`` (a step renamed there is no longer listed); the folder too
        with ``folder_too`` (when no save runs: orbax creates it before each rename into it)."""
        trash = os.path.join(self.directory, _DELETING)
        if jax.process_index() == 0 and os.path.isdir(trash):
            for name in os.listdir(trash):
                shutil.rmtree(os.path.join(trash, name), ignore_errors=True)
            if folder_too:
                shutil.rmtree(trash, ignore_errors=True)

    def all_steps(self) -> list[int]:
        broken = interrupted_deletions(self.directory)
        return sorted(s for s in self._manager.all_steps() if s not in broken)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Save at ``step`` if it is a multiple of ``save_every`` (or ``force``); True if it saved.

        A step that is already saved is not written again.
        """
        step = int(step)
        if (step % self.save_every and not force) or step in self._manager.all_steps():
            return False
        # A copy: the save is asynchronous, and the caller goes on appending to its history; orbax must write
        # the meta as it is now, the one the digest is of (seen: a run's own step failing its checksum under load).
        meta = json.loads(json.dumps(meta))
        sums = {"arrays": array_digests(state), "meta": json_digest(meta)}
        self._empty_deleting()  # the steps orbax deleted since the last save
        return bool(self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                                    checksums=ocp.args.JsonSave(sums)),
            force=True,
        ))

    def _step(self, step: int | None, where: str) -> int:
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(
                f"{where}: no checkpoint under {self.directory!r}; train without --resume first, or point --out "
                "at the folder of the run to resume."
            )
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"{where}: no checkpoint for step {step} under {self.directory!r}; saved steps: {steps}.")
        return step

    def _fallback(self, step: int) -> str:
        """How to go back to the step before ``step``."""
        others = [s for s in self.all_steps() if s != step] or "none"
        return (f"it was left untouched. Delete that step folder (or move it out of {self.directory!r}) to resume "
                f"from an earlier step (saved: {others}), or train into a new --out folder.")

    def _unreadable(self, where: str, step: int, e: BaseException) -> CheckpointError:
        path = os.path.join(self.directory, str(step))
        return CheckpointError(
            f"{where}: the checkpoint at {path!r} (step {step}) cannot be read ({type(e).__name__}: "
            f"{_first_line(e)}); {self._fallback(step)}"
        )

    def _corrupt(self, where: str, step: int, what: str) -> CheckpointError:
        path = os.path.join(self.directory, str(step))
        return CheckpointError(
            f"{where}: the checkpoint at {path!r} (step {step}) fails its checksum: {what} is not what was "
            f"saved (the files were damaged or edited); {self._fallback(step)}"
        )

    def _sums(self, step: int, where: str) -> dict | None:
        """The step's saved checksums; None (with a warning) for a step saved without them."""
        if not os.path.isdir(os.path.join(self.directory, str(step), "checksums")):
            warnings.warn(f"{where}: the checkpoint of step {step} under {self.directory!r} has no checksums "
                          "(saved by an older version); it is restored unverified.", stacklevel=3)
            return None
        try:
            sums = self._manager.restore(step, args=ocp.args.Composite(checksums=ocp.args.JsonRestore()))["checksums"]
            if not isinstance(sums, dict) or not isinstance(sums.get("arrays"), dict):
                raise ValueError("the 'checksums' item is not a dict with 'arrays'")
        except Exception as e:
            raise self._unreadable(where, step, e) from e
        return sums

    def _verify_meta(self, meta: dict, sums: dict | None, step: int, where: str) -> None:
        if sums is not None and json_digest(meta) != sums.get("meta"):
            raise self._corrupt(where, step, "the meta (run config and history, in meta/)")

    def _verify_state(self, state: Any, sums: dict | None, step: int, where: str) -> None:
        if sums is None:
            return
        got, want = array_digests(state), sums["arrays"]
        for path in sorted(set(got) | set(want)):
            if got.get(path) != want.get(path):
                shape = (want.get(path) or got.get(path) or "").split(":")[0]
                raise self._corrupt(where, step, f"the array state{path} ({shape}, in state/)")

    def restore_meta(self, step: int | None = None) -> dict:
        """Only the JSON meta saved at ``step`` (default: the latest)."""
        where = "Checkpointer.restore_meta"
        step = self._step(step, where)
        sums = self._sums(step, where)
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            if not isinstance(meta, dict):
                raise ValueError(f"the 'meta' item is {type(meta).__name__}, not a dict")
        except Exception as e:
            raise self._unreadable(where, step, e) from e
        self._verify_meta(meta, sums, step, where)
        return meta

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """The state saved at ``step`` (default: the latest) laid out like ``target``, and its meta.

        ``target`` is a state (or ``abstract_like(state, sharding)``) whose
        leaves give shape, dtype and the sharding to restore onto.
        """
        where = "Checkpointer.restore"
        step = self._step(step, where)
        abstract = target if _is_abstract(target) else abstract_like(target)
        sums = self._sums(step, where)
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
            )
            state, meta = out["state"], out["meta"]
            if not isinstance(meta, dict) or state is None:
                raise ValueError("the checkpoint lacks its 'state' or 'meta' item")
        except Exception as e:  # orbax raises many kinds (FileNotFoundError, ValueError, tensorstore errors)
            raise self._unreadable(where, step, e) from e
        self._verify_meta(meta, sums, step, where)
        self._verify_state(state, sums, step, where)
        return state, meta

    def wait(self) -> None:
        """Block until the background saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
        self._empty_deleting(folder_too=True)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_abstract(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0][:300] if text else "") or repr(e)
