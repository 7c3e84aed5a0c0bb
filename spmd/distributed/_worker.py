"""What ``spmdrun`` runs in each rank: the user's script, ended fast on failure.

A script that raises, or calls ``sys.exit(n)`` with ``n != 0``, has its
traceback printed and the process ends at once (``os._exit``), skipping JAX's
exit barrier, so that the launcher and the other ranks see the failure now
instead of after the shutdown timeout. A clean exit goes through JAX's exit
barrier as usual (every rank waits for the others).
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    spawn = sys.modules.get("spmd._spawn")
    if spawn is not None:  # the lines init_process_group's stdout filter still holds (mpiexec's ranks)
        spawn.drain_stdout()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("spmd.distributed._worker: nothing to run\n")
        os._exit(2)
    target, args = argv[0], argv[1:]
    sys.argv = [target, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code is None or code == 0:
            raise
        if not isinstance(code, int):
            sys.stderr.write(f"{code}\n")
            code = 1
        _flush()
        os._exit(code & 0xFF or 1)
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")):
            tb = tb.tb_next  # show the user's frames, not the launcher's
        traceback.print_exception(type(e), e, tb)
        _flush()
        # A PeerError can only come from spmd.distributed._errors, already imported if it was raised.
        errors = sys.modules.get("spmd.distributed._errors")
        os._exit(errors.exit_code_for(e) if errors is not None else 1)


if __name__ == "__main__":
    main()
