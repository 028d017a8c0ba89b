"""No cyclic garbage collection while a bounded decode builds many small objects.

CPython starts a collection every 700 container allocations and a full one whenever the long-lived heap
has grown by a quarter, and each full collection walks every tracked object. Decoding and checking a
checkpoint's metadata allocates millions of small, acyclic objects (``.metadata`` of a million tensors:
about six per tensor), so the collector walked the growing heap again and again: a third of the CPU time
of ``describe`` at 300,000 tensors (16.0 s with it, 10.3 s without), and ~10 ms of the ~12 ms a 2 GiB
checkpoint's metadata takes to decode in a process holding torch. Everything allocated meanwhile is
bounded by the input's size (and its limits, :mod:`~dcp_storage.formats.limits`); reference counting
still frees what is dropped.

The collector is process-wide, so pauses are counted across threads: the first pause turns it off (unless
it was already off), and only the end of the last overlapping pause turns it back on. A collector that was
off before the first pause stays off; one that another thread turns off *during* a pause is turned back on
when the pauses end (the pause cannot tell that call from its own).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["gc_paused"]

_lock = threading.Lock()
_pauses = 0  # pauses running now, in every thread
_turned_off = False  # whether the first of them turned the collector off (and the last must turn it on)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block (unless it is already off), and restore it after."""
    global _pauses, _turned_off
    with _lock:
        if _pauses == 0:
            _turned_off = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _turned_off:
                _turned_off = False
                gc.enable()
