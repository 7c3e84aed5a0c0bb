"""backend="mpi": its errors in one process, and real jobs under MPICH's ``mpiexec`` on 127.0.0.1.

The multi-process check scripts of tests/mp_scripts run unchanged on mpi through
``mpi_run.py`` (``init_process_group()`` joins with ``backend="mpi"``), so the
same collective semantics are checked on both backends; ``mpi_check.py`` holds
what is MPI's own. Skipped without the ``spmd[mpi]`` extra (mpi4py + MPICH).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import spmd.distributed as dist
from spmd._spawn import free_port
from spmd.distributed import _backend
from test_launcher import SCRIPTS, clean_env, rank_results  # noqa: E402

_MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def _needs_mpi():
    pytest.importorskip("mpi4py", reason="the spmd[mpi] extra (mpi4py + mpich) is not installed")
    if _MPIEXEC is None:
        pytest.skip("no mpiexec on PATH or next to the interpreter (pip install 'spmd[mpi]' brings MPICH's)")


def mpiexec(n: int, script: str, *args: str, timeout: float = 120, wrap: bool = True, out_dir: Path | None = None,
            **env: str):
    """``mpiexec -n N python [mpi_run.py] SCRIPT ARGS`` on this host; (returncode, stdout, stderr, seconds).
    With ``out_dir``, each rank's stdout goes to ``out_dir/stdout.<rank>`` instead."""
    cmd = [_MPIEXEC, "-n", str(n)]
    cmd += ["-outfile-pattern", str(out_dir / "stdout.%r")] if out_dir is not None else []
    cmd += [sys.executable]
    cmd += [str(SCRIPTS / "mpi_run.py")] if wrap else []
    cmd += [str(SCRIPTS / script), *args]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env(**env))
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


# --- one process: what backend="mpi" says when it cannot run -----------------------------------
def test_mpi_without_the_extra_names_it(clean):
    clean.setattr(_backend, "_has_mpi4py", lambda: False)
    with pytest.raises(RuntimeError, match=re.escape(
            "init_process_group: backend='mpi' needs mpi4py and an MPI library, which are not installed: "
            "pip install 'spmd[mpi]'")):
        dist.init_process_group("mpi")
    assert not dist.is_mpi_available()
    assert not dist.is_initialized()


def test_mpi_outside_an_mpi_launch_says_how_to_launch(clean):
    pytest.importorskip("mpi4py", reason="the spmd[mpi] extra is not installed")
    for var in _backend._MPI_LAUNCH_VARS:
        clean.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=re.escape(
            "init_process_group: backend='mpi' needs an MPI launch, and this process was not started by one")) as e:
        dist.init_process_group(backend=dist.Backend.MPI)
    assert "mpiexec -n N python script.py" in str(e.value)
    assert dist.is_mpi_available()
    assert not dist.is_initialized()


def test_node_local_rank_under_mpiexec(clean):
    clean.setenv("MPI_LOCALRANKID", "3")
    assert dist.get_node_local_rank() == 3
    clean.setenv("LOCAL_RANK", "1")  # spmdrun's / torchrun's wins
    assert dist.get_node_local_rank() == 1


# --- real jobs under mpiexec ---------------------------------------------------------------------
@pytest.mark.timeout(150)
@pytest.mark.parametrize("nproc", [2, 4])
def test_collectives_match_numpy_on_mpi(tmp_path, nproc):
    _needs_mpi()
    rc, out, err, _ = mpiexec(nproc, "collectives_check.py", str(tmp_path), timeout=140)
    assert rc == 0, err[-3000:]
    names = set().union(*rank_results(tmp_path, nproc))
    for expected in ("rank/world/backend", "all_reduce avg f32", "all_reduce premul_sum", "all_reduce product f32",
                     "all_reduce bxor i32", "all_reduce max bool", "broadcast src=1", "all_gather_into_tensor cat",
                     "reduce_scatter_tensor avg", "all_to_all_single", "batch_isend_irecv ring", "send/recv pairs",
                     "isend/irecv", "group all_reduce", "all_gather_object", "broadcast_object_list",
                     "in place: all_reduce, async all_reduce, broadcast, all_gather buffers",
                     "bad op on one rank raises TypeError before communicating"):
        assert expected in names
    if nproc == 4:
        assert "group of 3 reduce_scatter" in names and "group non-member warns and does nothing" in names


@pytest.mark.timeout(150)
def test_porting_checks_on_mpi(tmp_path):
    """64-bit values, every dtype gloo takes, NaN / -0.0 bits, the torch names, DDP: on mpi."""
    _needs_mpi()
    rc, out, err, _ = mpiexec(2, "porting_check.py", str(tmp_path), timeout=140,
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert rc == 0, err[-3000:]
    names = set().union(*rank_results(tmp_path, 2))
    assert "int64 2**40 + rank summed exactly" in names and "CommDebugMode counts what ran" in names


@pytest.mark.timeout(150)
def test_mpi_semantics_and_spmd_regions(tmp_path):
    """NaN-propagating MAX/MIN, AVG/PREMUL_SUM on every float dtype, in place on torch tensors, MPI
    requests for isend/irecv, groups as communicators, @spmd / DTensor across the MPI ranks."""
    _needs_mpi()
    rc, out, err, _ = mpiexec(4, "mpi_check.py", str(tmp_path), wrap=False, timeout=140)
    assert rc == 0, err[-3000:]
    names = set().union(*rank_results(tmp_path, 4))
    assert {"all_reduce max keeps NaN float32", "@spmd psum across the MPI ranks",
            "recv into a bigger buffer is refused", "async collectives in flight together",
            "barrier (MPI_Ibarrier) times out naming its limit", "this rank listens on loopback only",
            "object collectives in a group (1 MB, MPI bytes)"} <= names


@pytest.mark.timeout(150)
def test_dtensor_across_mpi_ranks(tmp_path):
    _needs_mpi()
    rc, out, err, _ = mpiexec(2, "dtensor_check.py", str(tmp_path), timeout=140)
    assert rc == 0, err[-3000:]
    assert "full_tensor S(0)" in set().union(*rank_results(tmp_path, 2))


@pytest.mark.timeout(120)
def test_seed_examples_under_mpiexec(tmp_path):
    _needs_mpi()
    rc, out, err, _ = mpiexec(4, "seed_examples.py", out_dir=tmp_path)
    assert rc == 0, err[-3000:]
    for r in range(4):
        got = (tmp_path / f"stdout.{r}").read_text().splitlines()
        assert f"Rank {r}/4" in got
        assert "all_reduce [10]" in got
        assert "broadcast [0.0]" in got
        assert "all_gather [[0], [1], [2], [3]]" in got
        assert ("reduce [10]" if r == 0 else f"reduce [{r + 1}]") in got
        assert f"scatter [{float(r)}]" in got
        assert ("gather [[0], [1], [2], [3]]" if r == 0 else "gather []") in got


@pytest.mark.timeout(60)
def test_world_size_disagreeing_with_mpi_is_refused():
    _needs_mpi()
    rc, out, err, took = mpiexec(2, "mpi_check.py", "-", wrap=False, WORLD_SIZE="3", timeout=50)
    assert rc != 0
    assert ("init_process_group: the environment variable WORLD_SIZE=3 disagrees with the MPI launch (world size 2); "
            "unset WORLD_SIZE under mpiexec") in err, err[-3000:]


@pytest.mark.timeout(60)
def test_stuck_collective_on_mpi_ends_every_rank_naming_the_absent():
    _needs_mpi()
    rc, out, err, took = mpiexec(2, "guard.py", "late", SPMD_TIMEOUT="3", timeout=50)
    assert rc != 0
    assert ("all_reduce: rank 0 waited 3 s (the timeout) in all_reduce (call #1 of Group(WORLD)) "
            "(op=sum, dtype=float32, shape=(4,)); ranks [1] did not arrive: rank 1 is not in any collective") in err
    assert "second collective done" not in out
    assert took < 40  # the timeout, not the sleep (60 s)


@pytest.mark.timeout(60)
def test_mismatched_calls_on_mpi_are_refused_in_detail_mode():
    _needs_mpi()
    rc, out, err, took = mpiexec(2, "guard.py", "dtype", SPMD_TIMEOUT="20", TORCH_DISTRIBUTED_DEBUG="DETAIL",
                                 timeout=50)
    assert rc != 0
    says = ("ValueError: all_reduce: the ranks of Group(WORLD) disagree on call #1: rank {me}: all_reduce(op=sum, "
            "dtype={mine}, shape=(4,)); rank {other}: all_reduce(op=sum, dtype={theirs}, shape=(4,)).")
    assert says.format(me=0, mine="float32", other=1, theirs="int32") in err, err[-3000:]
    assert "second collective done" not in out
    assert took < 40


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["raise", "hard"])
def test_a_dead_rank_ends_every_rank_on_mpi(mode):
    _needs_mpi()
    rc, out, err, took = mpiexec(3, "fail.py", mode, SPMD_TIMEOUT="30", timeout=50)
    assert rc != 0
    assert "second all_reduce" not in out
    assert took < 25  # well before the collective's timeout: mpiexec ends the job when a rank dies
    if mode == "raise":
        assert "RuntimeError: boom from rank 2" in err
