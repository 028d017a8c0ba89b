"""Process-level helpers every layer uses: held interrupts, collector pauses, reader futures, environment settings,
tensor byte views.

Ctrl-C and SIGTERM while C++ code calls back into Python: held until the C++ call returns.

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

No cyclic garbage collection while a bounded decode builds many small objects.

CPython starts a collection every 700 container allocations and a full one whenever the long-lived heap
has grown by a quarter, and each full collection walks every tracked object. Decoding and checking a
checkpoint's metadata allocates millions of small, acyclic objects (``.metadata`` of a million tensors:
about six per tensor), so the collector walked the growing heap again and again: a third of the CPU time
of ``describe`` at 300,000 tensors (16.0 s with it, 10.3 s without), and ~10 ms of the ~12 ms a 2 GiB
checkpoint's metadata takes to decode in a process holding torch. Everything allocated meanwhile is
bounded by the input's size (and its limits, :mod:`~dcp_storage.formats.paths`); reference counting
still frees what is dropped.

The collector is process-wide, so pauses are counted across threads: the first pause turns it off (unless
it was already off), and only the end of the last overlapping pause turns it back on. A collector that was
off before the first pause stays off; one that another thread turns off *during* a pause is turned back on
when the pauses end (the pause cannot tell that call from its own).

The ``Future`` a reader's ``read_data`` returns, of whichever kind.

torch's ``StorageReader.read_data`` is typed to return a ``torch.futures.Future`` and ``dcp.load`` calls its
``wait()``. A plugin's reader that returns a ``concurrent.futures.Future`` (what an executor's ``submit``
gives) failed late, inside torch, with ``AttributeError: 'Future' object has no attribute 'wait'``. Here:

* :func:`wait_for` (what the core calls on any reader's result): waits on a torch future, a
  ``concurrent.futures.Future`` or anything with ``wait()``, and raises :class:`FutureTypeError` naming the
  reader and the type to return for anything else;
* :func:`as_torch_future` (exported by the plugin API): a ``concurrent.futures.Future`` as the torch future
  ``dcp.load`` waits on, so a reader can ``return as_torch_future(pool.submit(...))``.

Whole-number settings read from the environment: the one parser for every limit a user may tune.

Byte limits of files read whole (:mod:`dcp_storage.formats.paths`), the lazy-metadata threshold and the
listing bounds (:mod:`dcp_storage.transports.guards`) are read at each use through :func:`count_setting`,
so a process can change one before a load, and a bad value fails naming the variable.

Locks that a forked child can use (:func:`fork_safe`).

A lock held by one of the parent's threads at the ``fork`` stays held in the child, where that thread does not
exist to release it: the child's first use waits forever (a ``DataLoader`` worker forked while a transport's
pool counted a request, or while a save renewed its lease). A lock made through :func:`fork_safe` is made new
in the child, as CPython does for its own module locks.

Raw byte views of tensor memory, so transports can fill tensors in place.

A memoryview over a CPU tensor's bytes lets ``os.preadv`` or a socket read land directly in the
destination, with no intermediate buffer. (``Tensor.numpy()`` would do this too, but numpy is optional
and does not know bfloat16 or float8.)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import gc
import os
import signal
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from dcp_storage.errors import DcpStorageError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FutureTypeError",
    "as_torch_future",
    "count_setting",
    "distinct_ints",
    "fork_safe",
    "gc_paused",
    "held_interrupts",
    "host_buffer",
    "terminate_as_interrupt",
    "wait_for",
    "writable_bytes",
]


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


_L = TypeVar("_L")
_AFTER_FORK: weakref.WeakSet[Any] = weakref.WeakSet()


def fork_safe(lock: _L) -> _L:
    """``lock`` (a ``threading.Lock`` or ``RLock``), made new and free in a child after ``fork``."""
    _AFTER_FORK.add(lock)
    return lock


def _locks_after_fork() -> None:
    for lock in list(_AFTER_FORK):
        lock._at_fork_reinit()  # what CPython's threading module calls on its own locks in a child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_locks_after_fork)


_lock = threading.Lock()
_pauses = 0  # pauses running now, in every thread
_turned_off = False  # whether the first of them turned the collector off (and the last must turn it on)


def _collector_after_fork() -> None:
    """In a child after ``fork``: the pauses were the parent's threads' (which are not here to end them), so
    the collector is on again if a pause turned it off, and the count starts afresh."""
    global _lock, _pauses, _turned_off
    _lock = threading.Lock()
    if _pauses and _turned_off:
        gc.enable()
    _pauses, _turned_off = 0, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_collector_after_fork)


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
            _pauses = max(0, _pauses - 1)  # a block a fork found running in the child's forking thread: at 0
            if _pauses == 0 and _turned_off:
                _turned_off = False
                gc.enable()


_USE = "return a torch.futures.Future (or wrap a concurrent.futures.Future with plugin_api.as_torch_future)"


class FutureTypeError(DcpStorageError, TypeError):
    """A reader's ``read_data`` returned something that is not a future; the message names the reader."""


def wait_for(result: Any, reader: object) -> Any:
    """Wait for what ``reader.read_data`` returned, whichever future type it is; its value."""
    if isinstance(result, concurrent.futures.Future):
        return result.result()
    wait = getattr(result, "wait", None)
    if callable(wait):
        return wait()
    raise FutureTypeError(f"{type(reader).__name__}.read_data returned a {type(result).__name__}: {_USE}")


def as_torch_future(future: concurrent.futures.Future[Any]) -> Any:
    """A ``torch.futures.Future`` completed with ``future``'s result or error, for ``dcp.load`` to wait on."""
    import torch.futures  # torch only when a reader asks: this module sits below every torch import

    out: torch.futures.Future[Any] = torch.futures.Future()

    def done(f: concurrent.futures.Future[Any]) -> None:
        # Whatever happens here must complete ``out``: concurrent.futures logs and drops a callback's error,
        # and the waiter (no timeout of its own) would wait forever. Two cases did that before: a future
        # cancelled before it ran (``exception()`` raises), and an error that is not an ``Exception``
        # (torch's ``set_exception`` refuses a ``SystemExit`` or torch's own ``CheckpointException``).
        try:
            if f.cancelled():
                out.set_exception(
                    concurrent.futures.CancelledError("the read was cancelled before it ran (its pool shut down?)")
                )
                return
            error = f.exception()
            if error is None:
                out.set_result(f.result())
            elif isinstance(error, Exception):
                out.set_exception(error)
            else:
                out.set_exception(_chained(f"{type(error).__name__} in the read: {error}", error))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter instead
            if not out.done():
                out.set_exception(_chained(f"the read's outcome could not be handed over: {exc!r}", exc))

    future.add_done_callback(done)
    return out


def _chained(message: str, cause: BaseException) -> RuntimeError:
    error = RuntimeError(message)
    error.__cause__ = cause
    return error


def count_setting(env: str, default: int, unit: str) -> int:
    """The whole, non-negative number in environment variable ``env`` (``default`` when unset or blank);
    ``ValueError`` naming the variable and ``unit`` for anything else."""
    raw = os.environ.get(env)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r} is not a whole number of {unit}") from None
    if value < 0:
        raise ValueError(f"{env}={raw!r} must not be negative")
    return value


def distinct_ints(values: Any) -> list[int]:
    """``np.unique(values).tolist()`` for an integer array, without a first call of ``np.unique`` in the process,
    which imports ``numpy.ma`` (13-20 ms of a cold load). Small non-negative values (dimension counts, file
    indices) are tallied with ``np.bincount``; others go to ``np.unique``."""
    import numpy as np

    values = np.ravel(values)
    if values.dtype.kind not in "iu" or values.size == 0 or int(values.min()) < 0 or int(values.max()) > 1 << 24:
        return np.unique(values).tolist()  # type: ignore[no-any-return]
    return np.flatnonzero(np.bincount(values)).tolist()  # type: ignore[no-any-return]


def writable_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory.

    The caller must keep ``tensor`` alive while the view is used.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("writable_bytes needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def host_buffer(
    shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype, for_device: torch.device
) -> torch.Tensor:
    """A contiguous host tensor to stage bytes for ``for_device`` (pinned when that is a GPU)."""
    import torch  # heavy: the command line imports this module (held interrupts) and must not import torch

    pin = for_device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)


class HostBufferPool:
    """Host staging tensors handed back once used and handed out again for the same shape and dtype; at most
    ``max_bytes`` of them kept meanwhile.

    Why: a fresh large tensor is a fresh mapping, and its first write faults every page in (3.2 ms per 8 MiB
    here, five times the copy itself). A coordinator that stages 1 GiB of sends in fresh buffers faulted in
    330 MiB of pages per load (88,000 faults); a sharded model's slices repeat a handful of shapes.
    """

    def __init__(self, for_device: torch.device, max_bytes: int) -> None:
        self.for_device = for_device
        self.max_bytes = max_bytes
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._kept = 0

    def take(self, shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host tensor of ``shape`` and ``dtype``: one handed back before, or a new one."""
        free = self._free.get((tuple(shape), dtype))
        if free:
            tensor = free.pop()
            self._kept -= tensor.numel() * tensor.element_size()
            return tensor
        return host_buffer(shape, dtype, self.for_device)

    def give_back(self, tensor: torch.Tensor) -> None:
        """``tensor`` is no longer used by anyone: keep it for a later :meth:`take` while there is room."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._kept + nbytes <= self.max_bytes:
            self._free.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)
            self._kept += nbytes
