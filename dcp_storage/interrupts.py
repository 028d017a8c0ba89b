"""Ctrl-C and SIGTERM while C++ code calls back into Python: held until the C++ call returns.

torch's zip writer (``torch._C.PyTorchFileWriter``, used by ``torch.save`` and by ``convert``'s streaming
``.pt`` writer) calls the output stream's Python ``write`` from C++. Python runs signal handlers between
bytecodes, so a Ctrl-C landed in that ``write``: the ``KeyboardInterrupt`` crossed the C++ frames as a
``c10::Error``, and the process either aborted (SIGABRT, ``terminate called after throwing an instance of
'c10::Error'``, when it reached a destructor) or reported a misleading ``RuntimeError: [enforce fail at
inline_container.cc:672] unexpected pos``. :func:`held_interrupts` wraps such calls: a SIGINT or SIGTERM
arriving inside is held and delivered again, to the handler that was in force, as soon as the call returns,
where Python code can unwind (``finally`` blocks remove temp files and release locks).

:func:`terminate_as_interrupt` makes SIGTERM raise ``KeyboardInterrupt`` too (the CLI's commands), so a
``kill`` cleans up as Ctrl-C does instead of leaving temp files and a lock behind.

Only the main thread receives signals in Python; elsewhere both are no-ops.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["held_interrupts", "terminate_as_interrupt"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_depth = 0  # nesting of held_interrupts in the main thread (only the main thread changes it)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def held_interrupts() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM are held; once it ends, the first one held is raised again."""
    global _depth
    if not _in_main_thread():
        yield
        return
    if _depth:  # nested: the outer block holds and delivers
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    pending: list[int] = []
    previous: dict[int, Any] = {}

    def hold(signum: int, _frame: Any) -> None:
        pending.append(signum)

    for sig in _SIGNALS:
        old = signal.getsignal(sig)
        if old is not None:  # a handler installed outside Python cannot be restored: leave it alone
            previous[sig] = old
            signal.signal(sig, hold)
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        for sig, old in previous.items():
            signal.signal(sig, old)
        if pending:
            signal.raise_signal(pending[0])  # the handler in force now: KeyboardInterrupt for Ctrl-C


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block (main thread), SIGTERM raises ``KeyboardInterrupt("SIGTERM")``, as Ctrl-C does."""
    if not _in_main_thread():
        yield
        return
    old = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)
