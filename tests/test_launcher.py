"""spmdrun and spmd.spawn with real processes on 127.0.0.1.

Process start-up is the cost (about 1-2 s per rank on this machine), so each
run checks many things at once: tests/mp_scripts/collectives_check.py checks
every collective against NumPy on every rank and writes what it found.
Every wait has a timeout; a time bound is asserted only as a "did not hang" limit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spmd._spawn import free_port
from spmd.distributed._errors import PEER_EXIT_CODE
from spmd.run import _JAX_VICTIM_MARKERS as JAX_VICTIM_MARKERS

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "mp_scripts"
_DROP = ("XLA_FLAGS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
         "SPMD_DEVICES_PER_PROC", "SPMD_TIMEOUT", "SPMD_HEARTBEAT_TIMEOUT")


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def spmdrun(*args: str, timeout: float = 120, env: dict | None = None, exe: list[str] | None = None):
    """Run ``python -m spmd.run ARGS`` (or ``exe ARGS``); (returncode, stdout, stderr, seconds)."""
    t0 = time.monotonic()
    p = subprocess.run([*(exe or [sys.executable, "-m", "spmd.run"]), *args], capture_output=True, text=True,
                       timeout=timeout, env=env or clean_env(), cwd=ROOT)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def lines_of(out: str, rank: int) -> list[str]:
    tag = f"[rank{rank}]: "
    return [line[len(tag):] for line in out.splitlines() if line.startswith(tag)]


def pids_in(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"\]: pid (\d+)", text)]


def assert_gone(pids: list[int]) -> None:
    assert pids, "the script printed no pids"
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} is still alive"


def rank_results(out_dir: Path, nproc: int) -> list[set[str]]:
    """The names each rank checked (tests/mp_scripts/_checks.py wrote them to ``rank{r}.json``); fails with
    every failed check's name and detail."""
    names = []
    for r in range(nproc):
        results = json.loads((out_dir / f"rank{r}.json").read_text())
        bad = [f"{x['name']}: {x['detail']}" for x in results if not x["ok"]]
        assert not bad, f"rank {r}:\n" + "\n".join(bad)
        names.append({x["name"] for x in results})
    return names


def jax_ended_it(stderr: str) -> bool:
    """Whether JAX's runtime ended this rank because another rank died (the markers spmdrun knows)."""
    return any(marker in stderr for marker in JAX_VICTIM_MARKERS)


# --- the seed's examples, as a user runs them ---------------------------------------------------
@pytest.mark.timeout(120)
def test_seed_examples_on_4_ranks():
    # The console script, as a user types it (pip install puts it next to the interpreter).
    script = Path(sys.executable).parent / "spmdrun"
    assert script.exists(), f"{script} is missing: pip install -e . installs the spmdrun console script"
    rc, out, err, _ = spmdrun("--standalone", "--nproc-per-node", "4", str(SCRIPTS / "seed_examples.py"),
                              exe=[str(script)])
    assert rc == 0, err[-3000:]
    for r in range(4):
        got = lines_of(out, r)
        assert f"Rank {r}/4" in got
        assert "all_reduce [10]" in got  # 1+2+3+4
        assert "broadcast [0.0]" in got
        assert "all_gather [[0], [1], [2], [3]]" in got
        assert ("reduce [10]" if r == 0 else f"reduce [{r + 1}]") in got
        assert f"scatter [{float(r)}]" in got
        assert ("gather [[0], [1], [2], [3]]" if r == 0 else "gather []") in got  # torch: [] off dst


# --- every collective against NumPy ------------------------------------------------------------
@pytest.mark.timeout(150)
@pytest.mark.parametrize("nproc,devices", [(2, 1), (4, 2)])
def test_collectives_match_numpy(tmp_path, nproc, devices):
    rc, out, err, _ = spmdrun("--standalone", "--nproc-per-node", str(nproc), "--devices-per-proc", str(devices),
                              str(SCRIPTS / "collectives_check.py"), str(tmp_path), timeout=140)
    assert rc == 0, err[-3000:]
    names = set().union(*rank_results(tmp_path, nproc))
    for expected in ("all_reduce product f32", "all_reduce bxor i32", "broadcast src=1", "all_gather_into_tensor cat",
                     "reduce_scatter_tensor avg", "all_to_all_single", "batch_isend_irecv ring", "send/recv pairs",
                     "group all_reduce", "all_gather_object", "broadcast_object_list", "all_gather_object pickle opt-in"):
        assert expected in names
    if nproc == 4:
        assert "group of 3 reduce_scatter" in names and "group non-member warns and does nothing" in names


# --- meshes and DTensor across processes ------------------------------------------------------
_DTENSOR_1 = ("from_local shape", "to_local", "full_tensor S(0)", "redistribute S(0)->R to_local",
              "redistribute S(0)->S(1) to_local", "redistribute S(0)->S(1) full", "Partial(sum) full_tensor",
              "Partial(sum) -> S(0) to_local", "Partial(max) full_tensor", "uneven to_local", "uneven full_tensor",
              "uneven S(0)->S(1) full")  # the checks of dtensor_check.py with one device per process
_DTENSOR_2 = ("2-D mesh over all processes", "distribute_tensor full_tensor", "redistribute SS->RS full",
              "redistribute SS->RR full", "uneven SS full_tensor", "uneven SS->S(1)R full",
              "from_local S(0)R, 2 devices per process", "from_local refuses a Shard inside a process")  # two


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices", [1, 2])
def test_dtensor_across_processes(tmp_path, devices):
    rc, out, err, _ = spmdrun("--standalone", "--nproc-per-node", "2", "--devices-per-proc", str(devices),
                              str(SCRIPTS / "dtensor_check.py"), str(tmp_path), timeout=110)
    assert rc == 0, err[-3000:]
    for names in rank_results(tmp_path, 2):
        assert names == {"mesh spans all processes", *(_DTENSOR_1 if devices == 1 else _DTENSOR_2)}


# --- failures that never hang -------------------------------------------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode,code,says", [
    ("raise", 1, "RuntimeError: boom from rank 2"),
    pytest.param("exit", 3, None, marks=pytest.mark.slow),  # sys.exit: reported as os._exit ("hard") is; slow tier
    ("hard", 7, None),
])
def test_rank_failing_mid_collective_stops_all(mode, code, says):
    rc, out, err, took = spmdrun("--standalone", "--nproc-per-node", "3", "--stop-timeout", "3",
                                 str(SCRIPTS / "fail.py"), mode, timeout=80)
    assert rc == code, err[-3000:]
    assert re.search(rf"spmdrun: rank 2 \(local rank 2, pid \d+\) failed with exit code {code} after", err), err[-3000:]
    assert "spmdrun: last lines of rank 2:" in err
    if says:
        assert says in err.split("last lines of rank 2:")[1]
    assert "second all_reduce" not in out
    assert took < 60
    assert_gone(pids_in(out))


@pytest.mark.timeout(60)
def test_restart_relaunches_all_ranks():
    rc, out, err, _ = spmdrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                              str(SCRIPTS / "fail.py"), "restart", timeout=50)
    assert rc == 0, err[-3000:]
    assert "spmdrun: restarting all ranks (restart 1 of 1)" in err
    for r in range(2):
        got = lines_of(out, r)
        assert "attempt 0" in got and "attempt 1" in got
        assert "second all_reduce [2.0, 2.0, 2.0, 2.0]" in got


@pytest.mark.timeout(60)
def test_sigterm_is_forwarded_and_nothing_is_left():
    p = subprocess.Popen([sys.executable, "-m", "spmd.run", "--standalone", "--nproc-per-node", "2", "--stop-timeout", "2",
                          str(SCRIPTS / "fail.py"), "sleep"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=clean_env(), cwd=ROOT)
    seen, deadline = [], time.monotonic() + 40
    while time.monotonic() < deadline:  # wait until both ranks sleep after their collectives
        line = p.stdout.readline()
        seen.append(line)
        if sum("second all_reduce" in s for s in seen) == 2 or not line:
            break
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "spmdrun: got SIGTERM; stopping all ranks" in err
    assert_gone(pids_in("".join(seen) + out))


@pytest.mark.timeout(60)
def test_ranks_die_with_a_killed_launcher():
    p = subprocess.Popen([sys.executable, "-m", "spmd.run", "--standalone", "--nproc-per-node", "2",
                          str(SCRIPTS / "fail.py"), "sleep"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, env=clean_env(), cwd=ROOT)
    seen, deadline = [], time.monotonic() + 40
    while time.monotonic() < deadline and sum("second all_reduce" in s for s in seen) < 2:
        line = p.stdout.readline()
        if not line:
            break
        seen.append(line)
    pids = pids_in("".join(seen))
    p.kill()  # SIGKILL: spmdrun cannot clean up; PR_SET_PDEATHSIG must
    p.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.1)
    assert len(pids) == 2
    assert_gone(pids)


@pytest.mark.timeout(60)
def test_port_taken_fails_fast_with_a_clear_message():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, out, err, took = spmdrun("--nproc-per-node", "2", "--master-port", str(port), "--stop-timeout", "2",
                                     str(SCRIPTS / "fail.py"), "ok", timeout=50)
    assert rc == 1
    assert f"could not start the coordinator on port {port} (already in use?)" in err, err
    assert "spmdrun: rank 0 (local rank 0" in err
    assert took < 40
    assert_gone(pids_in(out))


def _ranks_by_hand(world: int, nproc: int, port: int, *args: str, **env: str) -> list[subprocess.CompletedProcess]:
    """Start ``nproc`` ranks of fail.py with MASTER_*/RANK/WORLD_SIZE set by hand (no launcher)."""
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "fail.py"), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                            WORLD_SIZE=str(world), **env))
             for r in range(nproc)]
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.mark.timeout(90)
def test_wrong_world_size_ends_every_rank_within_the_timeout():
    t0 = time.monotonic()
    done = _ranks_by_hand(3, 2, free_port(), "ok", SPMD_TIMEOUT="3")
    took = time.monotonic() - t0
    for r, p in enumerate(done):
        assert p.returncode == 1, p.stderr[-2000:]
        assert (f"init_process_group: rank {r} timed out after 3 s waiting for all 3 ranks to join the coordinator"
                in p.stderr)
        assert "check that WORLD_SIZE=3 is the number of processes launched" in p.stderr
    assert took < 40


@pytest.mark.timeout(60)
def test_unreachable_coordinator_times_out_with_a_clear_message():
    port = free_port()
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(SCRIPTS / "fail.py"), "ok"], capture_output=True, text=True, timeout=50,
                       cwd=ROOT, env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="1",
                                               WORLD_SIZE="2", SPMD_TIMEOUT="2"))
    assert p.returncode == 1
    assert (f"TimeoutError: init_process_group: rank 1 could not reach the coordinator (rank 0) at 127.0.0.1:{port} "
            "within 2 s") in p.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(90)
def test_dead_peer_without_launcher_ends_the_others():
    # No spmdrun to stop anyone: the survivor's collective breaks, it says so and exits.
    t0 = time.monotonic()
    done = _ranks_by_hand(2, 2, free_port(), "hard", SPMD_HEARTBEAT_TIMEOUT="3", SPMD_TIMEOUT="30")
    assert done[1].returncode == 7
    assert done[0].returncode != 0
    # Inside the collective gloo breaks at once; had rank 0 not reached it yet, the coordination
    # service ends it after the heartbeat timeout. Either way it says why.
    assert (done[0].returncode == PEER_EXIT_CODE and "all_reduce: the collective failed on rank 0 in all_reduce "
            "(call #1 of Group(WORLD)); another rank most likely died" in done[0].stderr
            ) or jax_ended_it(done[0].stderr), done[0].stderr
    assert time.monotonic() - t0 < 45


@pytest.mark.timeout(60)
def test_two_nodes_on_loopback():
    # Two spmdrun invocations, as on two machines: --nnodes 2 --node-rank i --master-addr/--master-port.
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "spmd.run", "--nnodes", "2", "--node-rank", str(i),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                               str(SCRIPTS / "fail.py"), "ok"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=clean_env(), cwd=ROOT) for i in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=50))
    finally:
        for p in procs:
            p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-2000:]
        assert "second all_reduce [2.0, 2.0, 2.0, 2.0]" in lines_of(out, i)  # global rank i on node i


@pytest.mark.timeout(90)
def test_dead_peer_while_others_idle_is_noticed_by_the_heartbeat():
    # No launcher, no collective in flight: JAX's coordination service misses the dead rank's
    # heartbeats and ends the others (SPMD_HEARTBEAT_TIMEOUT), long before their 60 s sleep ends.
    t0 = time.monotonic()
    done = _ranks_by_hand(2, 2, free_port(), "idle", SPMD_HEARTBEAT_TIMEOUT="3", SPMD_TIMEOUT="30")
    assert done[1].returncode == 7
    assert done[0].returncode != 0
    assert jax_ended_it(done[0].stderr), done[0].stderr[-2000:]
    assert time.monotonic() - t0 < 40


# --- the console script and spawn ----------------------------------------------------------------
@pytest.mark.timeout(130)
def test_spawn_runs_fn_per_rank_and_reports_a_failure():
    # ~20 s alone (two spawns of 4 processes); the limit only catches a hang on a loaded machine
    p = subprocess.run([sys.executable, str(SCRIPTS / "spawn_demo.py")], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=clean_env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(line for line in p.stdout.splitlines() if line.startswith("spawned")) == [
        "spawned rank 0/4 identical True matches reference True"] + [f"spawned rank {r}/4 identical True" for r in (1, 2, 3)]
    assert sum(line.startswith("Epoch ") for line in p.stdout.splitlines()) == 10
    assert "caught ProcessRaisedException from process 1: ValueError: bad rank 1" in p.stdout


def test_parse_args_checks_its_input(capsys):
    from spmd.run import parse_args

    a = parse_args(["--nproc_per_node", "4", "--standalone", "train.py", "--lr", "0.1"])
    assert (a.nproc_per_node, a.standalone, a.script, a.script_args) == (4, True, "train.py", ["--lr", "0.1"])
    for bad, says in ((["--nproc-per-node", "0", "x.py"], "--nproc-per-node=0 must be >= 1"),
                      (["--nnodes", "2", "--node-rank", "2", "x.py"], "--node-rank=2 must be in [0, 1]"),
                      (["--standalone", "--nnodes", "2", "x.py"], "--standalone runs on one node"),
                      # the cause is the host name, not the port (issue 21.8)
                      (["--master-addr", "no.such.host.invalid", "x.py"],
                       "--master-addr='no.such.host.invalid' does not resolve to an address (")):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert says in capsys.readouterr().err


def test_spmdrun_checks_the_script_before_starting_ranks(tmp_path, monkeypatch):
    # A missing script, a directory, an unknown module: one clear line from the launcher, no rank started
    # (each rank printed Python's error and the launcher said only "stopped ranks").
    from spmd.run import parse_args, target_problem

    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "train.py").write_text("")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "__init__.py").write_text("")
    (tmp_path / "lib" / "util.py").write_text("")
    monkeypatch.chdir(tmp_path)
    cwd = str(tmp_path)
    for argv, says in (
            (["nosuch.py"], f"the script 'nosuch.py' does not exist (relative to the working directory {cwd}); give "
                            "the path of the Python file every rank runs"),
            (["train"], "give the path of the Python file every rank runs, or -m train to run the module 'train'"),
            (["tools"], "the script 'tools' is a directory without a __main__.py (it holds train.py); give the "
                        "Python file in it that every rank runs, or add a __main__.py"),
            (["-m", "nosuch"], f"-m nosuch: no module named 'nosuch' on the ranks' path (the working directory {cwd}, "
                               "then PYTHONPATH and site-packages); check the name, run spmdrun from the directory "
                               "that holds it, or add that directory to PYTHONPATH"),
            (["-m", "lib.nosuch"], "-m lib.nosuch: no module named 'lib.nosuch' on the ranks' path"),
            (["-m", "lib"], "-m lib: 'lib' is a package without a __main__ module, so it cannot run; name a module "
                            "in it (-m lib.train) or add lib/__main__.py"),
            (["-m", "lib.util.x"], "-m lib.util.x: 'lib.util' is a module, not a package, so it holds no module 'x'"),
            (["-m", "tools/train.py"], "-m 'tools/train.py' is not a module name (dotted Python names, such as "
                                       "pkg.train); to run a file, drop -m and give its path")):
        assert says in (target_problem(parse_args(["--standalone", *argv])) or "no problem found"), argv
    for fine in (["tools/train.py"], ["app"], ["-m", "lib.util"], ["-m", "spmd.distributed._worker"]):
        assert target_problem(parse_args(["--standalone", *fine])) is None, fine
    # end to end: exit code 2, the line, and no rank started
    rc, out, err, _ = spmdrun("--standalone", "--nproc-per-node", "2", "-m", "nosuch", timeout=60,
                              env=clean_env(PYTHONPATH=str(ROOT)))
    assert rc == 2
    assert err.startswith("spmdrun: error: -m nosuch: no module named 'nosuch' on the ranks' path"), err
    assert "[rank" not in out + err and "stopped ranks" not in err


def test_help_shows_each_flag_spelling_once(capsys):
    from spmd.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--nnodes NNODES, --nnodes NNODES" not in out and "--nnodes NNODES " in out
    assert "--nproc-per-node NPROC_PER_NODE, --nproc_per_node NPROC_PER_NODE" in out  # torchrun's two spellings
    assert not re.search(r"(--[\w-]+ [A-Z_]+), \1\b", out), out


@pytest.mark.timeout(60)
def test_unresolvable_master_addr_is_named_by_every_rank():
    # Started by hand (no spmdrun to check it first): each rank says the name does not resolve, at once.
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "fail.py"), "ok"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=clean_env(MASTER_ADDR="no.such.host.invalid", MASTER_PORT=str(free_port()),
                                            RANK=str(r), WORLD_SIZE="2", SPMD_TIMEOUT="20"))
             for r in (0, 1)]
    try:
        done = [p.communicate(timeout=50) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, (_, err)) in enumerate(zip(procs, done)):
        assert p.returncode == 1, err[-2000:]
        assert (f"ValueError: init_process_group: rank {r} cannot use MASTER_ADDR='no.such.host.invalid': the host "
                "name does not resolve to an address (") in err, err[-2000:]
        assert "already in use" not in err and "within 20 s" not in err


# --- quiet by default (issue 21.6) -----------------------------------------------------------------
def test_gloo_connection_lines_are_recognised():
    from spmd.run import _chatter

    assert _chatter(b"[Gloo] Rank 5 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n")
    # a communicator short of peers is news, and is passed on
    assert not _chatter(b"[Gloo] Rank 5 is connected to 6 peer ranks. Expected number of connected peer ranks is : 7\n")
    assert not _chatter(b"[Gloo] something else\n")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["default", pytest.param("--verbose", marks=pytest.mark.slow), "SPMD_VERBOSE=1"])
def test_gloo_connection_lines_only_when_asked(how):
    flags = ["--verbose"] if how == "--verbose" else []
    env = clean_env(SPMD_VERBOSE="1") if how == "SPMD_VERBOSE=1" else clean_env()
    rc, out, err, _ = spmdrun("--standalone", "--nproc-per-node", "2", *flags, str(SCRIPTS / "fail.py"), "ok",
                              timeout=60, env=env)
    assert rc == 0, err[-3000:]
    assert sum("second all_reduce" in line for line in out.splitlines()) == 2
    gloo = [line for line in (out + err).splitlines() if "[Gloo]" in line]
    if how == "default":
        assert gloo == []
    else:  # the same run prints them (so the default's silence is the filter's doing)
        assert gloo and all("is connected to 1 peer ranks" in line for line in gloo), gloo


@pytest.mark.timeout(120)
def test_gloo_connection_lines_dropped_by_ranks_started_without_spmdrun():
    # Ranks started by hand (as on several nodes, or by srun): no launcher filters their output, so each rank
    # drops gloo's lines itself; SPMD_VERBOSE=1 keeps them.
    quiet = _ranks_by_hand(2, 2, free_port(), "ok")
    loud = _ranks_by_hand(2, 2, free_port(), "ok", SPMD_VERBOSE="1")
    for p in quiet + loud:
        assert p.returncode == 0, p.stderr[-2000:]
        assert "second all_reduce [2.0, 2.0, 2.0, 2.0]" in p.stdout
    assert [line for p in quiet for line in (p.stdout + p.stderr).splitlines() if "[Gloo]" in line] == []
    assert all("[Gloo] Rank" in p.stdout and "is connected to 1 peer ranks" in p.stdout for p in loud)


# --- collectives that would hang or disagree (issue 10.3, 10.4, 10.9) ------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,state", [
    # the sleeping rank is running, unless JAX aborted it when rank 0 (the coordination service) left
    ("late", r"is still running: busy elsewhere or hung|then was killed by SIGABRT \(exit code -6\)"),
    ("stop", re.escape("is stopped: SIGSTOP or a debugger")),
])
def test_rank_that_never_arrives_is_named(mode, state):
    # Rank 1 sleeps (or SIGSTOPs itself) instead of calling all_reduce: rank 0 gives up after the
    # timeout naming it, and spmdrun blames rank 1, not the rank that gave up.
    rc, out, err, took = spmdrun("--standalone", "--nproc-per-node", "2", "--stop-timeout", "2",
                                 str(SCRIPTS / "guard.py"), mode, timeout=50, env=clean_env(SPMD_TIMEOUT="3"))
    assert rc == PEER_EXIT_CODE, err[-3000:]
    assert ("all_reduce: rank 0 waited 3 s (the timeout) in all_reduce (call #1 of Group(WORLD)) "
            "(op=sum, dtype=float32, shape=(4,)); ranks [1] did not arrive: rank 1 is not in any collective") in err
    assert re.search(rf"spmdrun: rank 1 \(local rank 1, pid \d+\) did not arrive at the collective its peers waited "
                     rf"in \(it ({state})\)", err), err[-3000:]
    assert "second collective done" not in out
    assert took < 30
    assert_gone(pids_in(out))


@pytest.mark.timeout(60)
def test_different_collectives_time_out_naming_each_other():
    # Without the per-call check (SPMD_CHECK_COLLECTIVES=0) two different collectives meet in gloo and hang: the
    # timeout ends them, naming each other's call (with the check they raise at once: test_fingerprint_*).
    rc, out, err, took = spmdrun("--standalone", "--nproc-per-node", "2", "--stop-timeout", "2",
                                 str(SCRIPTS / "guard.py"), "mismatch", timeout=50,
                                 env=clean_env(SPMD_TIMEOUT="6", SPMD_CHECK_COLLECTIVES="0"))
    assert rc == PEER_EXIT_CODE, err[-3000:]
    # Each rank names the other's call. A rank whose timeout has not yet come when the first one ends (under
    # load they enter up to seconds apart) sees its collective break instead, and says so.
    saw = {0: ("ranks [1] did not arrive: rank 1 is in the same call with a different signature: "
               "all_gather(axis=0, tiled=False, dtype=float32, shape=(4,))"),
           1: "ranks [0] did not arrive: rank 0 is in the same call with a different signature: all_reduce(op=sum"}
    broke = {0: "all_reduce: the collective failed on rank 0 in all_reduce (call #1 of Group(WORLD)); another rank "
                "most likely died or left the job",
             1: "all_gather: the collective failed on rank 1 in all_gather (call #1 of Group(WORLD)); another rank "
                "most likely died or left the job"}
    assert saw[0] in err or saw[1] in err, err[-3000:]
    for r in (0, 1):
        assert saw[r] in err or broke[r] in err, err[-3000:]
    assert took < 30
    assert_gone(pids_in(out))


@pytest.mark.timeout(60)
def test_different_ops_on_a_first_call_report_the_real_wait():
    # sum on rank 0, max on rank 1: rank 0 names both calls and ends; rank 1 may lose the coordination service
    # (rank 0 hosts it) before it reads rank 0's call, and must then say so, not that it waited its timeout.
    rc, out, err, _ = spmdrun("--standalone", "--nproc-per-node", "2", "--stop-timeout", "2",
                              str(SCRIPTS / "guard.py"), "ops", timeout=50, env=clean_env(SPMD_TIMEOUT="20"))
    assert rc != 0
    assert ("ValueError: all_reduce: the ranks of Group(WORLD) disagree on call #0: rank 0: all_reduce(op=sum, "
            "dtype=float32, shape=(4,)); rank 1: all_reduce(op=max, dtype=float32, shape=(4,)).") in err, err[-3000:]
    assert "waited 20 s (the timeout)" not in err, err[-3000:]
    for line in lines_of(err, 1):
        if "PeerError: " in line:  # the exception's line (not the traceback's source line)
            assert re.search(r"rank 1 stopped waiting after \d+\.\d s \(of its 20 s timeout\) for ranks \[0\] to "
                             r"reach all_reduce \(call #0 of Group\(WORLD\)\): the coordination service stopped "
                             r"answering \(", line), line
    assert_gone(pids_in(out))


@pytest.mark.timeout(60)
def test_detail_mode_checks_signatures_across_ranks():
    # float32 on rank 0, int32 on rank 1: without the check rank 1 gets garbage; with it, both ranks fail at once.
    rc, out, err, took = spmdrun("--standalone", "--nproc-per-node", "2", "--stop-timeout", "2",
                                 str(SCRIPTS / "guard.py"), "dtype", timeout=50,
                                 env=clean_env(SPMD_TIMEOUT="20", TORCH_DISTRIBUTED_DEBUG="DETAIL"))
    assert rc == 1, err[-3000:]
    says = ("ValueError: all_reduce: the ranks of Group(WORLD) disagree on call #1: rank {me}: all_reduce(op=sum, "
            "dtype={mine}, shape=(4,)); rank {other}: all_reduce(op=sum, dtype={theirs}, shape=(4,)).")
    assert says.format(me=0, mine="float32", other=1, theirs="int32") in err
    assert "second collective done" not in out
    assert took < 30  # at once, not after the timeout
    assert_gone(pids_in(out))


@pytest.mark.timeout(120)
def test_fingerprint_every_call_checked_on_gloo(tmp_path):
    # Three jobs side by side. After the group's first call, without DETAIL: a different op, shape, dtype,
    # collective or root on rank 1 raises on both ranks naming each rank's call, moves no data, and the group stays
    # usable; with check_collectives=False the different op raises nothing; ranks whose settings differ refuse to
    # join (fingerprint_check.py checks on every rank).
    modes = {"checked": [], "off": ["off"], "mixed": ["mixed"]}
    jobs = {m: subprocess.Popen([sys.executable, "-m", "spmd.run", "--standalone", "--nproc-per-node", "2",
                                 "--stop-timeout", "2", str(SCRIPTS / "fingerprint_check.py"), str(tmp_path / m), *a],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=clean_env(SPMD_TIMEOUT="30")) for m, a in modes.items()}
    try:
        done = {m: p.communicate(timeout=110) for m, p in jobs.items()}
    finally:
        for p in jobs.values():
            p.kill()
    want = {"checked": {"op differs", "shape differs", "dtype differs", "collective differs", "root differs",
                        "async op differs", "usable at the end"},
            "off": {"off: a different op raises nothing", "off: joined again after destroy"},
            "mixed": {"mixed settings refused", "not joined after the refusal", "runtime as before the refusal",
                      "no join after the shutdown"}}
    for m, p in jobs.items():
        assert p.returncode == 0, done[m][1][-3000:]
        assert all(want[m] <= names for names in rank_results(tmp_path / m, 2)), m


# --- the coordinator's front door (issue 10.8, 10.12) ----------------------------------------------
def _listening_addresses(pids: list[int]) -> set[str]:
    """Local addresses of the TCP sockets in LISTEN state held by ``pids`` (Linux /proc)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.add(cols[1].rsplit(":", 1)[0])
    return found


@pytest.mark.timeout(90)
def test_coordinator_on_loopback_refuses_outsiders_and_other_jobs(tmp_path):
    port, release = free_port(), tmp_path / "release"
    first = subprocess.Popen([sys.executable, "-m", "spmd.run", "--nproc-per-node", "2", "--master-port", str(port),
                              str(SCRIPTS / "fail.py"), "linger", str(release)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT)
    try:
        seen, deadline = [], time.monotonic() + 40
        while time.monotonic() < deadline and sum("second all_reduce" in s for s in seen) < 2:
            seen.append(first.stdout.readline())
        pids = pids_in("".join(seen))
        loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::ffff:127.0.0.1
        assert _listening_addresses(pids) <= loopback, _listening_addresses(pids)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # an outsider
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert s.recv(200).startswith(b"NO this port hosts an spmd job's coordinator")
        rc, _, err, _ = spmdrun("--nproc-per-node", "2", "--master-port", str(port), "--stop-timeout", "2",
                                str(SCRIPTS / "fail.py"), "ok", timeout=50)
        assert rc == 1
        # whichever of its ranks knocks first is refused by the running job's door, by name
        assert re.search(r"init_process_group: rank [01] was refused by the process on 127\.0\.0\.1:", err), err
        assert "this port hosts another job (SPMD_JOB_ID=" in err
        release.touch()
        out, err1 = first.communicate(timeout=40)
    finally:
        first.kill()
    assert first.returncode == 0, err1[-2000:]  # the first job never noticed
    assert sum("after linger [2.0, 2.0, 2.0, 2.0]" in line for line in out.splitlines()) == 2


@pytest.mark.timeout(90)
def test_ranks_disagreeing_on_world_size_or_rank_get_clear_errors():
    def run(ranks_worlds, port):
        procs = []
        for r, w in ranks_worlds:
            procs.append(subprocess.Popen([sys.executable, str(SCRIPTS / "fail.py"), "ok"], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                          env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                                        WORLD_SIZE=str(w), SPMD_TIMEOUT="4")))
            time.sleep(0.5)  # the first one is rank 0 of the port
        try:
            return [(p.communicate(timeout=60)[1], p.returncode) for p in procs]
        finally:
            for p in procs:
                p.kill()

    done = run([(0, 2), (1, 3)], free_port())  # was: a C++ abort
    assert all(code == 1 and "was started with WORLD_SIZE=3 but rank 0 (pid" in err for err, code in done), done
    assert "init_process_group: rank 1 was refused by the process on 127.0.0.1:" in done[1][0]
    done = run([(0, 2), (0, 2)], free_port())  # two RANK=0: was a C++ abort
    # whichever binds the port first is rank 0 of the job (the 0.5 s head start is not a guarantee on a loaded
    # host): the other is refused naming the running one, and the first waits out its timeout for rank 1
    refused = [err for err, _ in done if "ValueError: init_process_group: rank 0 of this job is already running (pid "
               in err and "two processes were given RANK=0" in err]
    waited = [err for err, _ in done if "timed out after 4 s waiting for all 2 ranks" in err]
    assert [code for _, code in done] == [1, 1] and len(refused) == len(waited) == 1, [e[-2000:] for e, _ in done]


@pytest.mark.parametrize("kwargs,exc,says", [
    ({"fn": lambda rank: None}, TypeError, "spawn: fn=<function"),
    ({"fn": print, "devices_per_proc": "x"}, TypeError, "spawn: devices_per_proc='x' must be an int >= 1 (or None)."),
    ({"fn": print, "start_method": "thread"}, ValueError, "spawn: start_method='thread' is not one of this platform's"),
    ({"fn": print, "stop_timeout": -1}, ValueError, "spawn: stop_timeout=-1 must be positive"),
])
def test_spawn_checks_its_input_before_starting_processes(kwargs, exc, says):
    import spmd

    with pytest.raises(exc, match=re.escape(says)):
        spmd.spawn(**kwargs)


# --- back-to-back jobs on one fixed port (issue 21.7) ----------------------------------------------
@pytest.mark.timeout(120)
def test_back_to_back_jobs_on_one_fixed_port():
    # The torch tutorials' way: MASTER_PORT fixed, one program right after another. The first job's connections
    # to the port linger in TIME_WAIT; the coordinator's socket must set SO_REUSEADDR (as torch's store does) or
    # the second job's rank 0 cannot bind and its peers wait out their timeout.
    port = free_port()
    for attempt in (1, 2):
        rc, out, err, _ = spmdrun("--nproc-per-node", "2", "--master-port", str(port), "--stop-timeout", "2",
                                  str(SCRIPTS / "fail.py"), "ok", timeout=50, env=clean_env(SPMD_TIMEOUT="15"))
        assert rc == 0, f"job {attempt} on port {port}:\n{err[-3000:]}"
        assert "already in use" not in err
        assert sum("second all_reduce [2.0, 2.0, 2.0, 2.0]" in line for line in out.splitlines()) == 2, out
        assert_gone(pids_in(out))
