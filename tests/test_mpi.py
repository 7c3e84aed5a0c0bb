"""backend="mpi": its errors in one process, and real jobs under MPICH's ``mpiexec`` on 127.0.0.1.

The multi-process check scripts of tests/mp_scripts run unchanged on mpi through
``mpi_run.py`` (``init_process_group()`` joins with ``backend="mpi"``), so the
same collective semantics are checked on both backends; ``mpi_check.py`` holds
what is MPI's own. Skipped without the ``spmd[mpi]`` extra (mpi4py + MPICH).
"""

from __future__ import annotations

import importlib.util
import os
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
from spmd import run
from test_launcher import ROOT, SCRIPTS, clean_env, rank_results  # noqa: E402

_MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def _needs_mpi():
    pytest.importorskip("mpi4py", reason="the spmd[mpi] extra (mpi4py + mpich) is not installed")
    if _MPIEXEC is None:
        pytest.skip("no mpiexec on PATH or next to the interpreter (pip install 'spmd[mpi]' brings MPICH's)")


def mpiexec(n: int, scripts: list[str], *, timeout: float = 120, wrap: bool = True, out_dir: Path | None = None,
            start: bool = False, **env: str):
    """``mpiexec -n N python mpi_run.py SCRIPT ARGS [+ SCRIPT ARGS ...]`` on this host (``scripts`` from
    :func:`_chain`); (returncode, stdout, stderr, seconds), or with ``start`` the running job for
    :func:`finish`. With ``out_dir`` each rank's stdout goes to ``out_dir/stdout.<rank>``."""
    cmd = [_MPIEXEC, "-n", str(n)]
    cmd += ["-outfile-pattern", str(out_dir / "stdout.%r")] if out_dir is not None else []
    cmd += [sys.executable]
    cmd += [str(SCRIPTS / "mpi_run.py")] if wrap else []
    cmd += scripts
    job = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(**env)),
           time.monotonic())
    return job if start else finish(job, timeout)


def finish(job, timeout: float):
    """Wait for a job :func:`mpiexec` started; (returncode, stdout, stderr, seconds)."""
    proc, t0 = job
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the job did not end within {timeout} s:\n{err[-3000:]}") from None
    return proc.returncode, out, err, time.monotonic() - t0


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
# Each job runs many check scripts one after the other (mpi_run.py SCRIPT ARGS + SCRIPT ARGS ...): one
# launch, one import of JAX and one JAX runtime per world size. The failure modes end their job, so each
# has its own; they run side by side (they mostly wait).
def _chain(*scripts: tuple[str, ...]) -> list[str]:
    """mpi_run.py's arguments for ``(script, *args)`` each (a script path relative to tests/mp_scripts, or absolute)."""
    out: list[str] = []
    for s in scripts:
        out += (["+"] if out else []) + [str(SCRIPTS / s[0]) if not Path(s[0]).is_absolute() else s[0], *s[1:]]
    return out


@pytest.mark.timeout(300)
def test_one_job_of_4_ranks_runs_every_check_on_mpi(tmp_path):
    """On 4 ranks: the shared collective checks (as on gloo), the porting checks (64-bit values, every dtype
    gloo takes, NaN / -0.0 bits, the torch names, DDP), the seed's examples unchanged, MPI's own semantics
    (NaN-propagating MAX/MIN, narrow floats, torch tensors in place, groups as communicators, @spmd and
    DTensor across the MPI ranks), the fast path and async requests, a wrong WORLD_SIZE and DETAIL mode."""
    _needs_mpi()
    d = {k: tmp_path / k for k in ("coll", "porting", "mpi", "fast", "stdout")}
    d["stdout"].mkdir()
    rc, out, err, _ = mpiexec(4, _chain(("porting_check.py", str(d["porting"])), ("collectives_check.py", str(d["coll"])),
                                        ("mpi_check.py", str(d["mpi"])), ("seed_examples.py",),
                                        ("mpi_fast_check.py", str(d["fast"]))),
                              out_dir=d["stdout"], timeout=280, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert rc == 0, err[-3000:]
    names = set().union(*rank_results(d["coll"], 4))
    for expected in ("rank/world/backend", "all_reduce avg f32", "all_reduce premul_sum", "all_reduce product f32",
                     "all_reduce bxor i32", "all_reduce max bool", "broadcast src=1", "all_gather_into_tensor cat",
                     "reduce_scatter_tensor avg", "all_to_all_single", "batch_isend_irecv ring", "send/recv pairs",
                     "isend/irecv", "group all_reduce", "all_gather_object", "broadcast_object_list",
                     "in place: all_reduce, async all_reduce, broadcast, all_gather buffers",
                     "bad op on one rank raises TypeError before communicating", "group of 3 reduce_scatter",
                     "group non-member warns and does nothing"):
        assert expected in names
    names = set().union(*rank_results(d["porting"], 4))
    for must in ("int64 all_reduce sum", "bfloat16 all_gather", "uint64 send/recv", "complex128 broadcast",
                 "int64 2**40 + rank summed exactly", "CommDebugMode counts what ran", "Counter arrives as Counter",
                 "TCPStore add is atomic across ranks", "monitored_barrier names the late rank",
                 "DDP 3 steps == one process on the whole batch"):
        assert must in names
    names = set().union(*rank_results(d["mpi"], 4))
    assert {"all_reduce max keeps NaN float32", "@spmd psum across the MPI ranks", "DTensor full_tensor",
            "recv into a bigger buffer is refused", "async collectives in flight together",
            "async list collectives return before the peers call",
            "barrier (MPI_Ibarrier) times out naming its limit", "this rank listens on loopback only",
            "object collectives in a group (1 MB, MPI bytes)"} <= names
    assert len(set().union(*rank_results(d["fast"], 4))) == 8
    for r in range(4):  # the seed's examples, as their comments say
        got = (d["stdout"] / f"stdout.{r}").read_text().splitlines()
        assert f"Rank {r}/4" in got
        assert "all_reduce [10]" in got
        assert "broadcast [0.0]" in got
        assert "all_gather [[0], [1], [2], [3]]" in got
        assert ("reduce [10]" if r == 0 else f"reduce [{r + 1}]") in got
        assert f"scatter [{float(r)}]" in got
        assert ("gather [[0], [1], [2], [3]]" if r == 0 else "gather []") in got


@pytest.mark.timeout(200)
def test_one_job_of_2_ranks_dtensor_fast_path_and_a_torch_program(tmp_path):
    """On 2 ranks: DTensors across the MPI ranks, the fast path, and (with torch installed) the torch tutorial
    program ported by changing its import, printing what it prints under torch (tutorial.expected)."""
    _needs_mpi()
    from test_porting import PROGRAMS, ported, program_lines

    scripts = [("dtensor_check.py", str(tmp_path / "dt")), ("mpi_fast_check.py", str(tmp_path / "fast"))]
    torch_here = importlib.util.find_spec("torch") is not None
    if torch_here:
        scripts.append((str(ported(PROGRAMS / "tutorial.py", tmp_path)),))
    (tmp_path / "stdout").mkdir()
    rc, out, err, _ = mpiexec(2, _chain(*scripts), timeout=180, out_dir=tmp_path / "stdout", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
    assert rc == 0, err[-3000:]
    assert "full_tensor S(0)" in set().union(*rank_results(tmp_path / "dt", 2))
    assert len(set().union(*rank_results(tmp_path / "fast", 2))) == 8
    if torch_here:
        out = "\n".join(f"[rank{r}]: {line}" for r in range(2)
                        for line in (tmp_path / "stdout" / f"stdout.{r}").read_text().splitlines())
        # as under torchrun, but mpiexec is not torchelastic
        want = [line.replace("launched True", "launched False")
                for line in (PROGRAMS / "tutorial.expected").read_text().splitlines()]
        assert program_lines(out) == want


@pytest.mark.timeout(150)
def test_failures_on_mpi_end_every_rank_and_spmdrun_relaunches():
    """Side by side (they mostly wait): a stuck collective (a fast-path call) ends every rank naming the absent
    one, within the timeout, and so does the wait() of an async all_gather whose call returned at once; a rank that raises or dies ends the job at once (mpiexec ends the others); and
    ``spmdrun --backend mpi`` runs a job whose rank fails, says so, and relaunches it, which then succeeds."""
    _needs_mpi()
    jobs = {"stuck": mpiexec(2, _chain(("guard.py", "late")), start=True, SPMD_TIMEOUT="3"),
            "stuck async": mpiexec(2, _chain(("mpi_async_late.py",)), start=True, SPMD_TIMEOUT="3"),
            "raise": mpiexec(3, _chain(("fail.py", "raise")), start=True, SPMD_TIMEOUT="30"),
            "hard": mpiexec(3, _chain(("fail.py", "hard")), start=True, SPMD_TIMEOUT="30")}
    # spmdrun starts mpiexec (no RANK: MPI gives it); init_process_group() joins on mpi (SPMD_BACKEND);
    # lines prefixed by rank; the restart count reaches the script (SPMD_RESTART_COUNT)
    jobs["spmdrun"] = (subprocess.Popen([sys.executable, "-m", "spmd.run", "--backend", "mpi", "--nproc-per-node", "2",
                                         "--max-restarts", "1", str(SCRIPTS / "fail.py"), "restart"],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                                        cwd=ROOT), time.monotonic())
    done = {name: finish(job, timeout=120) for name, job in jobs.items()}
    rc, out, err, took = done["stuck"]
    assert rc != 0
    assert ("all_reduce: rank 0 waited 3 s (the timeout) in all_reduce (call #1 of Group(WORLD)) "
            "(op=sum, dtype=float32, shape=(4,)); ranks [1] did not arrive: rank 1 is not in any collective") in err
    assert "second collective done" not in out
    assert took < 45  # the timeout, not the sleep (60 s)
    rc, out, err, took = done["stuck async"]  # the call returned; its wait() is what times out
    assert rc != 0
    assert "returned pending=True" in out and "wait returned" not in out
    assert ("all_gather: rank 0 waited 3 s (the timeout) for all_gather (call #1 of Group(WORLD)) "
            "(axis=0, tiled=False, dtype=float32, shape=(2,), async_op=True) to complete; ranks [1] did not all take "
            "part.") in err, err[-3000:]
    assert took < 45
    for mode in ("raise", "hard"):
        rc, out, err, took = done[mode]
        assert rc != 0
        assert "second all_reduce" not in out
        assert took < 30  # well before the collective's timeout: mpiexec ends the job when a rank dies
    assert "RuntimeError: boom from rank 2" in done["raise"][2]
    rc, out, err, took = done["spmdrun"]
    assert rc == 0, err[-3000:]
    text = out + err
    assert "[rank1]: RuntimeError: boom from rank 1 on attempt 0" in text
    assert "spmdrun: mpiexec's job of 2 ranks failed with exit code 1" in err
    assert "spmdrun: restarting all ranks (restart 1 of 1)" in err
    for r in range(2):
        assert f"[rank{r}]: attempt 1" in text and f"[rank{r}]: second all_reduce [2.0, 2.0, 2.0, 2.0]" in text


@pytest.mark.timeout(120)
def test_fingerprint_every_call_checked_on_mpi(tmp_path):
    """The per-call check on mpi, in one job: a different op (rank 0 on the cached fast path), shape, dtype,
    collective or root at a warm call raises on both ranks naming each rank's call, moves no data and leaves the
    group usable; then the same job with check_collectives=False, where the different op raises nothing; then ranks
    whose settings differ, which refuse to join."""
    _needs_mpi()
    on, off, mixed = tmp_path / "on", tmp_path / "off", tmp_path / "mixed"
    rc, out, err, _ = mpiexec(2, _chain(("fingerprint_check.py", str(on)), ("fingerprint_check.py", str(off), "off"),
                                        ("fingerprint_check.py", str(mixed), "mixed")), SPMD_TIMEOUT="20")
    assert rc == 0, err[-3000:]
    for names in rank_results(on, 2):
        assert {"op differs", "shape differs", "dtype differs", "collective differs", "root differs",
                "async op differs", "usable at the end"} <= names
    for names in rank_results(off, 2):
        assert {"off: a different op raises nothing", "off: joined again after destroy"} <= names
    for names in rank_results(mixed, 2):
        assert {"mixed settings refused", "not joined after the refusal", "runtime as before the refusal"} <= names


@pytest.mark.timeout(150)
def test_gloo_connection_lines_dropped_under_mpiexec():
    """mpiexec passes the ranks' output on as it is (the multi-node launch): a program compiled across the
    processes (its collectives on gloo) prints no gloo connection line, under mpiexec or spmdrun --backend mpi,
    unless SPMD_VERBOSE=1."""
    _needs_mpi()
    jobs = {"quiet": mpiexec(2, _chain(("gloo_quiet.py",)), start=True),
            "verbose": mpiexec(2, _chain(("gloo_quiet.py",)), start=True, SPMD_VERBOSE="1"),
            "spmdrun": (subprocess.Popen([sys.executable, "-m", "spmd.run", "--backend", "mpi", "--nproc-per-node", "2",
                                          str(SCRIPTS / "gloo_quiet.py")], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT),
                        time.monotonic())}
    done = {name: finish(job, timeout=140) for name, job in jobs.items()}
    for name, (rc, out, err, _) in done.items():
        assert rc == 0, err[-3000:]
        assert out.count("full [1.0, 1.0, 2.0, 2.0]") == 2, out
        gloo = [line for line in (out + err).splitlines() if "[Gloo]" in line]
        if name == "verbose":
            assert len(gloo) == 2 and all("is connected to 1 peer ranks" in line for line in gloo), gloo
        else:
            assert gloo == [], gloo


def test_spmdrun_backend_mpi_is_one_node():
    with pytest.raises(SystemExit):
        run.parse_args(["--backend", "mpi", "--nnodes", "2", "--master-addr", "127.0.0.1", "x.py"])


def test_backend_none_under_mpiexec_and_spmdrun_backend_mpi_choose_mpi(clean):
    pytest.importorskip("mpi4py", reason="the spmd[mpi] extra is not installed")
    for var in ("RANK", "SPMD_BACKEND", *_backend._MPI_LAUNCH_VARS):
        clean.delenv(var, raising=False)
    assert _backend.resolve_backend(None).name == "gloo"
    clean.setenv("PMI_RANK", "0")  # started by mpiexec, not by spmdrun / torchrun
    assert _backend.resolve_backend(None).name == "mpi"
    assert _backend.resolve_backend("gloo").name == "gloo"  # a backend named is the one used
    clean.setenv("RANK", "0")
    assert _backend.resolve_backend(None).name == "gloo"
    clean.setenv("SPMD_BACKEND", "mpi")  # spmdrun --backend mpi: the script's CPU backend runs on MPI
    assert _backend.resolve_backend("gloo").name == "mpi" and _backend.resolve_backend(None).name == "mpi"


def test_mpich_settings_before_mpi_starts(clean):
    """Loopback only when every rank runs here; sleeping waits with more ranks here than cores; the user's win."""
    from spmd.distributed import _mpi

    cores = len(os.sched_getaffinity(0))
    for var in ("UCX_NET_DEVICES", "FI_TCP_IFACE", "MPIR_CVAR_ENABLE_HEAVY_YIELD"):
        clean.delenv(var, raising=False)
    clean.setenv("MPI_LOCALNRANKS", str(cores))
    clean.setenv("PMI_SIZE", str(cores))
    _mpi.prepare_environment()
    assert (os.environ["UCX_NET_DEVICES"], os.environ["FI_TCP_IFACE"]) == ("lo", "lo")
    assert "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in os.environ  # one rank per core: spin (lower latency)
    clean.setenv("MPI_LOCALNRANKS", str(cores + 1))
    clean.setenv("UCX_NET_DEVICES", "eth0")
    _mpi.prepare_environment()
    assert os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1" and os.environ["UCX_NET_DEVICES"] == "eth0"
    clean.setenv("MPIR_CVAR_ENABLE_HEAVY_YIELD", "0")
    _mpi.prepare_environment()
    assert os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "0"
