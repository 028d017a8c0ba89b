"""Keeping a held lock alive while its save runs, and letting it go when the save ends.

Each claim (:mod:`.claim`) gets a :class:`Renewal`: one daemon thread, ``dcp-storage-lease``, that rewrites
the lock with a fresh ``renewed`` time every ``lease_s / 3`` seconds (one small PUT or file replace: 30 s
at the default 90 s lease), first checking that the lock still carries this claim's id (a lock taken over
meanwhile is never written back; the save then refuses to commit). It stops, and the claim stops counting
as *active* in this process (:func:`is_active`, which :func:`~.lock_holder.stale_reason` asks), when:

* the save commits (:meth:`Renewal.stop` from ``Claim.release``);
* the save's ``torch.distributed.checkpoint`` call returns or raises: the thread watches the calling
  thread's stack for the outermost frame of ``state_dict_saver`` that was there when the lock was taken
  (sync saves, thread-mode and process-mode ``async_save`` alike), so a failed save's lock is no longer
  renewed and a retry in the same process takes it over at once;
* the writer holding the claim is garbage-collected, or takes a new claim.

Signals: on ``SIGINT`` the locks of saves running on the main thread are removed, then
``KeyboardInterrupt`` is raised there as Python's default handler does (the save unwinds and removes its
temp files; torch reports it wrapped in its ``CheckpointException``). On ``SIGTERM`` every lock this
process holds is removed, then the default action ends the process (exit status 143; the temp files of
the interrupted writes stay, for ``verify --cleanup`` or the next save to remove). The handlers are
installed, from the main thread, only over Python's defaults, never over an application's own.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from dcp_storage._torch import on_thread_stack, save_frame
from dcp_storage.runtime import fork_safe

__all__ = ["Renewal", "active_claims", "forget", "is_active", "pending"]

_log = logging.getLogger(__name__)
_POLL_S = 0.25  # how often the thread looks whether the save has ended

_ACTIVE: dict[str, Renewal | None] = {}  # claim id -> its renewal (None: being taken)
_ACTIVE_LOCK = fork_safe(threading.RLock())  # re-entrant: a signal handler runs on the main thread, maybe inside it


def is_active(claim_id: str) -> bool:
    """Whether this process holds the claim ``claim_id`` for a save that is still running (or taking it)."""
    with _ACTIVE_LOCK:
        if claim_id not in _ACTIVE:
            return False
        renewal = _ACTIVE[claim_id]
    return renewal is None or renewal.running()  # asked now: the thread may not have looked yet


def active_claims() -> list[str]:
    with _ACTIVE_LOCK:
        return list(_ACTIVE)


@contextlib.contextmanager
def pending(claim_id: str) -> Iterator[None]:
    """Count ``claim_id`` as active while it is being taken (a rival in this process must not judge it
    ended); on an error it stops counting."""
    with _ACTIVE_LOCK:
        _ACTIVE[claim_id] = None
    try:
        yield
    except BaseException:
        with _ACTIVE_LOCK:
            _ACTIVE.pop(claim_id, None)
        raise


def forget(claim_id: str) -> None:
    """Stop counting ``claim_id`` as active (a claim released without a renewal of its own)."""
    with _ACTIVE_LOCK:
        if _ACTIVE.get(claim_id, 0) is None:
            del _ACTIVE[claim_id]


class Renewal:
    """Renews one lock every ``interval`` seconds (module docstring). ``read_id()`` returns the claim id the
    lock carries now (``None``: gone or unreadable); ``write(data)`` replaces it; ``encode(fields)`` gives its
    bytes; ``remove()`` deletes it (only if it is still this claim's)."""

    def __init__(
        self,
        claim_id: str,
        fields: dict[str, Any],
        interval: float,
        read_id: Callable[[], str | None],
        write: Callable[[bytes], None],
        encode: Callable[[dict[str, Any]], bytes],
        remove: Callable[[], None],
    ) -> None:
        self.claim_id = claim_id
        self.renewals = 0
        self.lost = False
        self._fields = dict(fields)
        self._interval = interval
        self._read_id, self._write, self._encode, self._remove = read_id, write, encode, remove
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._frame = save_frame()
        self._ended = False
        self._owner = threading.get_ident()
        self.on_main_thread = threading.current_thread() is threading.main_thread()

    def start(self) -> Renewal:
        with _ACTIVE_LOCK:
            _ACTIVE[self.claim_id] = self
        if self.on_main_thread:
            _install_handlers()
        self._thread = threading.Thread(target=self._run, name="dcp-storage-lease", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing, and stop counting the claim as active; waits for the thread (never itself)."""
        self._stop.set()
        with _ACTIVE_LOCK:
            if _ACTIVE.get(self.claim_id) is self:
                del _ACTIVE[self.claim_id]
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def running(self) -> bool:
        """Not stopped, and its save's call (if one was found) is still on its thread's stack."""
        frame = self._frame  # read before _ended: the thread sets _ended, then drops the frame
        if self._ended or self._stop.is_set():
            return False
        return frame is None or on_thread_stack(self._owner, frame)

    def release_now(self) -> None:
        """From a signal handler: stop, and remove the lock."""
        self.stop()
        try:
            self._remove()
        except Exception as exc:  # noqa: BLE001 - the process is going down; say so and go on
            _log.warning("could not remove the lock of claim %s on a signal: %s", self.claim_id, exc)

    def _run(self) -> None:
        due = time.monotonic() + self._interval
        try:
            while not self._stop.wait(min(_POLL_S, max(0.0, due - time.monotonic()))):
                if self._frame is not None and not on_thread_stack(self._owner, self._frame):
                    return  # the save returned or raised without committing: stop renewing
                if time.monotonic() >= due:
                    if not self._renew():
                        return
                    due = time.monotonic() + self._interval
        finally:
            self._ended = True
            self._frame = None  # a finished frame holds its locals (the state dict): let them go
            with _ACTIVE_LOCK:
                if _ACTIVE.get(self.claim_id) is self:
                    del _ACTIVE[self.claim_id]

    def _renew(self) -> bool:
        try:
            if self._read_id() != self.claim_id:
                self.lost = True  # taken over (or removed): never write it back
                _log.warning(
                    "the lock of claim %s was taken over by another save; this save will not commit", self.claim_id
                )
                return False
            self._fields["renewed"] = round(time.time(), 3)
            self._write(self._encode(self._fields))
            self.renewals += 1
        except Exception as exc:  # noqa: BLE001 - a failed renewal is retried; the lease has slack for two
            _log.warning("could not renew the lock of claim %s: %s", self.claim_id, exc)
        return True


# ------------------------------------------------------------------------------------ signals
_INSTALLED: dict[int, Any] = {}  # signal number -> the handler ours replaced


def _install_handlers() -> None:
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    for signum, default in defaults.items():
        try:
            current = signal.getsignal(signum)
            if current is _on_signal or current is not default:
                continue  # ours already, or the application's own: leave it
            signal.signal(signum, _on_signal)
            _INSTALLED[signum] = default
        except (ValueError, OSError):  # not the main thread of the main interpreter
            continue


def _on_signal(signum: int, frame: Any) -> None:
    with _ACTIVE_LOCK:
        renewals = [r for r in _ACTIVE.values() if r is not None]
    # SIGINT interrupts the main thread only: the saves of other threads go on. SIGTERM ends the process.
    for renewal in [r for r in renewals if r.on_main_thread] if signum == signal.SIGINT else renewals:
        renewal.release_now()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, _INSTALLED.get(signum, signal.SIG_DFL))
    signal.raise_signal(signum)  # the default action: the process ends by SIGTERM, as it would have
