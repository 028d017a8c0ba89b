"""The deadline of the storage operation running on this thread, applied to each request in flight.

:class:`~dcp_storage.transports.retry.RetryPolicy` ``deadline`` bounds a whole operation, retries included.
Checking it between attempts is not enough: a server that stalls before its headers, or in the middle of a
body, holds one attempt for as long as the client's own socket timeout (botocore's ``read_timeout``, 60 s
by default, gcsfs's ``sock_read``), and a stall that trickles a byte now and then holds it forever. So
:func:`~dcp_storage.transports.retry.call_with_retry` opens an :func:`operation_deadline` around its
attempts, and every request the transports run on an fsspec event loop goes through :func:`bounded_sync`,
which cancels the request when the operation's time is up and raises :class:`AttemptTimeoutError` (a
``TimeoutError``: transient, so the retry layer then raises its ``TransportError`` naming the URL).

Operations nest (a create-if-absent that reads back its own object): the inner one never outlives the outer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fsspec.asyn import sync

__all__ = ["AttemptTimeoutError", "bounded_call", "bounded_sync", "operation_deadline", "remaining"]

_local = threading.local()


class AttemptTimeoutError(TimeoutError):
    """A request was still unanswered (or its body unfinished) when its operation's deadline passed.

    Internal signal, like a socket timeout: the retry layer gives up on it with a ``TransportError``.
    """


@contextlib.contextmanager
def operation_deadline(seconds: float | None) -> Iterator[None]:
    """Bound the requests made on this thread inside the block to ``seconds`` from now (``None``: no bound)."""
    outer: float | None = getattr(_local, "ends", None)
    ends = outer
    if seconds is not None:
        mine = time.monotonic() + seconds
        ends = mine if outer is None else min(outer, mine)
    _local.ends = ends
    try:
        yield
    finally:
        _local.ends = outer


def remaining() -> float | None:
    """Seconds left to the current operation's deadline on this thread (``None``: no deadline)."""
    ends: float | None = getattr(_local, "ends", None)
    return None if ends is None else ends - time.monotonic()


def bounded_sync(loop: Any, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fsspec.asyn.sync(loop, func, *args, **kwargs)``, cancelled when the operation's deadline passes.

    Without a deadline it is fsspec's ``sync``. With one, the coroutine runs as a task on ``loop`` and this
    thread waits on its future for the time left; on expiry the task is cancelled (which closes the
    request's connection). That costs no extra task per request, unlike ``sync(timeout=...)``, whose
    ``asyncio.wait_for`` wraps every request in one more.
    """
    left = remaining()
    if left is None:
        return sync(loop, func, *args, **kwargs)
    if left <= 0:
        raise AttemptTimeoutError("the operation's deadline passed before this request was sent")
    if loop is None or loop.is_closed():
        raise RuntimeError("Loop is not running")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise NotImplementedError("Calling sync() from within a running loop")
    future = asyncio.run_coroutine_threadsafe(func(*args, **kwargs), loop)
    try:
        return future.result(timeout=left)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise AttemptTimeoutError(
            f"no complete answer within the {left:.1f}s left to the operation's deadline (a stalled server or "
            "connection; RetryPolicy(deadline=...) sets it)"
        ) from None


def bounded_call(fs: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``fs.<name>(*args, **kwargs)``; on an async fsspec filesystem, bounded like :func:`bounded_sync`.

    fsspec's blocking methods wait on the event loop for as long as the request takes: a server that stalls
    holds one attempt for the client's own timeouts (the Azure SDK's read timeout; aiohttp has none). The
    coroutine behind the method (``_name``) is run through :func:`bounded_sync` instead.
    """
    if getattr(fs, "async_impl", False) and hasattr(fs, f"_{name}"):
        return bounded_sync(fs.loop, getattr(fs, f"_{name}"), *args, **kwargs)
    return getattr(fs, name)(*args, **kwargs)
