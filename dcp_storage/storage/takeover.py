"""Creating a lock so that one save wins, and taking over a stale one so that one taker wins.

:func:`create_exclusive` is the store's create-if-absent (:mod:`dcp_storage.transports.exclusive`) plus a
check that the store honours it. Some S3-compatible servers ignore ``If-None-Match``: every conditional
PUT then succeeds, two racing saves both "create" the lock, and both write. So on an object store the lock
is first looked for (a save arriving late never writes over a held lock), and after creating it a second
conditional PUT of other bytes must be refused (once per filesystem client: its later saves skip both
requests). If it is accepted, the store ignores the condition: a
warning says so, the lock is written back, and after a settle time (``DCP_STORAGE_LOCK_SETTLE_MS``,
default 1000) it is read again: of saves that raced within that time only the last writer finds its own
lock there and goes on; the others raise :class:`~dcp_storage.errors.CheckpointExistsError`. (Each save
also reads its lock back before its commit: ``Claim.lost``.)

:func:`take_over` replaces a lock judged stale (:func:`~.lock_holder.stale_reason`). Deleting it and
creating it anew would let two takers both win (the second deletes the first's fresh lock), so a taker
first creates the marker ``{lock}.takeover`` with the same create-if-absent (a marker left by a taker that
died is itself judged, and taken over, the same way, one level up); holding it, it reads the lock again
and writes its own only if the lock is still the stale one it judged; then it removes the marker. A
second taker either fails to create the marker, or creates it after the first removed it and finds the
lock changed: exactly one taker wins.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from dcp_storage.formats.limits import count_setting
from dcp_storage.storage.lock_holder import parse, stale_reason
from dcp_storage.transports import client_identity

__all__ = ["MARKER_SUFFIX", "SETTLE_ENV", "create_exclusive", "read_lock", "rewrite_lock", "take_over"]

_log = logging.getLogger(__name__)
READ_LIMIT = 4096  # a lock is ~400 bytes; only this much of whatever is there is read
MARKER_SUFFIX = ".takeover"
SETTLE_ENV = "DCP_STORAGE_LOCK_SETTLE_MS"
# Filesystem clients (one per store and options) whose store refused the probe: their saves skip it. A
# client is never shared between an honest store and one that is not (another endpoint, another client).
_HONOURED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_MAX_DEPTH = 2  # the lock, its marker, the marker's marker: each level needs a taker that died mid-way


def read_lock(transport: Any, path: str) -> bytes | None:
    """The lock's bytes if it is a small regular file: never a FIFO, a device or a symlink (whose target may
    lie outside the checkpoint), never a large read."""
    try:
        if transport.is_local:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                return os.read(fd, READ_LIMIT)
            finally:
                os.close(fd)
        if transport.size(path) > READ_LIMIT:
            return None
        return bytes(transport.read_file(path))
    except (OSError, ValueError):  # gone meanwhile, or unreadable: the holder stays unknown
        return None


def rewrite_lock(transport: Any, path: str, data: bytes) -> None:
    """Replace the lock at ``path`` with ``data``, atomically for readers. On a local disk without ``fsync``:
    a lock only has to outlive its save's process, not the machine (:mod:`dcp_storage.transports.exclusive`),
    and an ``fsync`` during a save can wait behind the save's own dirty data."""
    if not transport.is_local:
        transport.write_file(path, data)
        return
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def create_exclusive(transport: Any, path: str, token: bytes) -> bool:
    """Create ``path`` holding ``token`` if nothing is there: ``True`` if this call did (module docstring)."""
    create = getattr(transport, "create_new", None)
    if create is None:
        warnings.warn(
            f"{type(transport).__name__} has no create_new(): the lock {transport.url(path)} is checked, then "
            "written, so two saves started at the same moment can both proceed",
            stacklevel=5,
        )
        if transport.exists(path):
            return False
        transport.write_file(path, token)
        return True
    if transport.is_local:
        return bool(create(path, token))  # O_EXCL: the kernel's word
    store = client_identity(transport)
    if store is not None and _HONOURED.get(store):
        return bool(create(path, token))  # this client's store refused a probe before
    if transport.exists(path) or not create(path, token):
        return False
    if not create(path, token + b" "):  # other bytes, same claim: must be refused where the lock exists
        with contextlib.suppress(TypeError):  # a filesystem that cannot be weakly referenced: probe each time
            _HONOURED[store] = True
        return True
    warnings.warn(
        f"{transport.url(path)}: the store accepted a create-if-absent write over an existing object (it ignores "
        "If-None-Match); the lock is written, then read back after a settle time, so that of saves racing within "
        f"it one goes on ({SETTLE_ENV} sets the time)",
        stacklevel=5,
    )
    transport.write_file(path, token)
    time.sleep(count_setting(SETTLE_ENV, 1000, "milliseconds") / 1000)
    return read_lock(transport, path) == token


def take_over(transport: Any, path: str, token: bytes, is_active: Callable[[str], bool], depth: int = 0) -> str | None:
    """Replace the stale lock at ``path`` with ``token``: the reason it was stale if this call did, else
    ``None`` (the lock is live, unknown, or another taker won)."""
    raw = read_lock(transport, path)
    reason = stale_reason(parse(raw), is_active)
    if reason is None or depth >= _MAX_DEPTH:
        return None
    marker = path + MARKER_SUFFIX
    if (
        not create_exclusive(transport, marker, token)
        and take_over(transport, marker, token, is_active, depth + 1) is None
    ):
        return None  # another taker holds the marker (or a live one does)
    try:
        if read_lock(transport, path) != raw:
            return None  # renewed, released, or replaced by a taker that was faster
        rewrite_lock(transport, path, token)
    finally:
        try:
            if read_lock(transport, marker) == token:
                transport.remove(marker)
        except Exception as exc:  # noqa: BLE001 - a marker left behind is judged stale later, like a lock
            _log.warning("could not remove the takeover marker %s: %s", transport.url(marker), exc)
    _log.warning("took over the lock %s: %s", transport.url(path), reason)
    return reason
