"""Run a script that forks, and report whether its child finished: for the tests of what a forked child
inherits (a ``DataLoader`` worker of a process that had read or saved).

A script passed to :func:`run_forking_script` forks, runs its child's part and ``os._exit``-s there, then
calls ``wait_for_child(pid)`` (defined for it), which prints ``child exit N`` or, after ``timeout`` seconds,
kills the child and prints ``child hung``. :func:`run_forking_script` returns that last line.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

__all__ = ["run_forking_script"]

ROOT = Path(__file__).resolve().parents[1]

_WAIT_FOR_CHILD = textwrap.dedent(
    """
    import os as _os, time as _time

    def wait_for_child(child, timeout):
        deadline = _time.monotonic() + timeout
        while _time.monotonic() < deadline:
            done, status = _os.waitpid(child, _os.WNOHANG)
            if done:
                print("child exit", _os.waitstatus_to_exitcode(status), flush=True)
                return
            _time.sleep(0.05)
        _os.kill(child, 9)
        _os.waitpid(child, 0)
        print("child hung", flush=True)
    """
)


def run_forking_script(script: str, *args: str, timeout: float = 120.0) -> str:
    """Run ``script`` in a fresh interpreter; the last line it printed (``child exit 0`` when all went well).
    Raises ``AssertionError`` with its stderr if the script itself failed."""
    proc = subprocess.run(
        [sys.executable, "-c", _WAIT_FOR_CHILD + textwrap.dedent(script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""
