"""The lease thread's watch on a save's stack (``_torch.on_thread_stack``) must not deadlock the process.

A lock's renewal thread asks ``sys._current_frames()`` four times a second whether the save is still running.
On CPython 3.11 before 3.11.9 that call holds the runtime's thread-list lock while it makes frame objects; a
collection started there runs finalizers that may hand the GIL over, and a thread starting or ending
meanwhile waits for that lock holding the GIL (CPython gh-106883): every thread stops for good, and no
timeout handler runs (the main thread never gets the GIL back). A CI run of the suite hung with those
symptoms, no timeout report, in a thread-mode manager test (failing saves: pools starting and ending threads
while a lease watched).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from dcp_storage._torch import on_thread_stack

ROOT = Path(__file__).resolve().parents[2]


def test_frames_are_taken_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sys._current_frames
    seen: list[bool] = []

    def recording() -> dict[int, object]:
        seen.append(gc.isenabled())
        return real()

    monkeypatch.setattr(sys, "_current_frames", recording)
    here = sys._getframe()
    was_on = gc.isenabled()
    assert on_thread_stack(threading.get_ident(), here) is True
    assert on_thread_stack(threading.get_ident() + 1, here) is False  # no such thread
    assert seen == [False, False], "sys._current_frames() ran with the cyclic collector on"
    assert gc.isenabled() == was_on, "the collector stayed off"
    gc.disable()  # an application's own choice is kept
    try:
        on_thread_stack(threading.get_ident(), here)
        assert not gc.isenabled()
    finally:
        gc.enable()


STRESS = textwrap.dedent(
    """
    import faulthandler, gc, sys, threading, time
    from dcp_storage._torch import on_thread_stack

    gc.set_threshold(20, 5, 5)  # collections, with finalizers, all the time
    sys.setswitchinterval(1e-6)  # and the GIL handed over inside them
    stop = threading.Event()

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            sum(range(200))

    def watch():
        here = sys._getframe()
        while not stop.is_set():
            on_thread_stack(threading.main_thread().ident, here)

    def short():
        junk = [Cycle() for _ in range(20)]

    for _ in range(2):
        threading.Thread(target=watch, daemon=True).start()
    end, started = time.monotonic() + float(sys.argv[1]), 0
    while time.monotonic() < end:
        faulthandler.dump_traceback_later(20, exit=True)  # no progress for 20 s: the deadlock
        batch = [threading.Thread(target=short) for _ in range(8)]
        for t in batch:
            t.start()
        for t in batch:
            t.join()
        started += len(batch)
    stop.set()
    faulthandler.cancel_dump_traceback_later()
    print("started", started)
    """
)


def test_watching_while_threads_start_and_end_does_not_deadlock() -> None:
    """Before the fix this stress deadlocked within 1-4 s in every run (seven of seven, on 3.11.7)."""
    proc = subprocess.run(
        [sys.executable, "-c", STRESS, "3"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and "started" in proc.stdout, (
        f"rc={proc.returncode}: deadlocked (faulthandler's stacks follow)\n{proc.stderr[-4000:]}"
    )
