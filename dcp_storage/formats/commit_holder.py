"""Who holds a save's lock, whether that holder is provably gone, and taking over a stale lock so that one taker wins.

Who holds a save's lock, and whether that holder is provably gone.

A lock (:mod:`.claim`) is a small JSON object naming its holder. Besides the fields shown in messages
(``save_id``, ``writer``, ``host``, ``pid``, ``since``) it records what a later save needs to judge it:

* ``claim``: a random id, unique to this claim (a renewal rewrites the bytes, the id stays);
* ``boot``, ``pidns``, ``started``: the host's boot id, the holder's PID namespace and the process start
  time (``/proc/<pid>/stat`` field 22, clock ticks since boot), so that on the same host a pid that is gone
  or was reused by another process is told from a live holder;
* ``lease_s`` and ``renewed``: the holder promises to rewrite the lock at least every ``lease_s / 3``
  seconds while its save runs (:mod:`.lease`); a lock not renewed for ``lease_s`` seconds is stale, wherever
  its holder runs. This compares the holder's clock with the reader's: hosts must agree on the time to well
  within the lease (NTP does).

:func:`stale_reason` says why a lock is stale, or ``None``: a lock whose fields are missing, malformed or
from an older version is never judged stale (only ``overwrite=True`` replaces it).

Creating a lock so that one save wins, and taking over a stale one so that one taker wins.

:func:`create_exclusive` is the store's create-if-absent (:mod:`dcp_storage.transports.s3_stream`) plus a
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
import json
import logging
import math
import os
import socket
import stat
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from dcp_storage.formats.paths import count_setting
from dcp_storage.transports.protocol import client_identity

__all__ = [
    "DEFAULT_LEASE_S",
    "LEASE_ENV",
    "MARKER_SUFFIX",
    "SETTLE_ENV",
    "claim_id_of",
    "create_exclusive",
    "holder_fields",
    "lease_seconds",
    "parse",
    "read_lock",
    "rewrite_lock",
    "stale_reason",
    "take_over",
]


LEASE_ENV = "DCP_STORAGE_LOCK_LEASE_S"
DEFAULT_LEASE_S = 90
_MAX_LEASE_S = 7 * 86400  # a holder claiming more is not believed (its lock is never judged by its lease)


def lease_seconds() -> int:
    """The lease a new lock promises: ``DCP_STORAGE_LOCK_LEASE_S`` (whole seconds, at least 1), default 90."""
    lease = count_setting(LEASE_ENV, DEFAULT_LEASE_S, "seconds")
    if not 1 <= lease <= _MAX_LEASE_S:
        raise ValueError(f"{LEASE_ENV}={lease} must be between 1 and {_MAX_LEASE_S} seconds")
    return lease


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(4096)
    except OSError:
        return None


def _boot_id() -> str | None:
    raw = _read("/proc/sys/kernel/random/boot_id")
    return raw.strip() or None if raw else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_start(pid: int) -> tuple[int, str] | None:
    """``(start time in clock ticks since boot, state letter)`` of ``pid`` from ``/proc``; ``None`` if absent.

    The command name (field 2) may hold spaces and parentheses: fields are counted after its last ``)``.
    """
    raw = _read(f"/proc/{pid}/stat")
    if not raw or ")" not in raw:
        return None
    rest = raw.rsplit(")", 1)[1].split()
    try:
        return int(rest[19]), rest[0]  # field 22 (starttime) and field 3 (state)
    except (IndexError, ValueError):
        return None


_SELF: dict[int, dict[str, Any]] = {}  # by pid: a forked child computes its own


def _this_process() -> dict[str, Any]:
    pid = os.getpid()
    found = _SELF.get(pid)
    if found is None:
        start = _process_start(pid)
        found = {
            "host": socket.gethostname(),
            "boot": _boot_id(),
            "pidns": _pid_namespace(),
            "pid": pid,
            "started": start[0] if start else None,
        }
        _SELF[pid] = found
    return found


def holder_fields(save_id: str, claim_id: str, writer: str, since: str, lease_s: int) -> dict[str, Any]:
    """The fields of a new lock held by this process (module docstring)."""
    return {
        "save_id": save_id,
        "claim": claim_id,
        "writer": writer,
        "since": since,
        **_this_process(),
        "lease_s": lease_s,
        "renewed": round(time.time(), 3),
    }


def parse(raw: bytes | None) -> dict[str, Any] | None:
    """A lock's fields, or ``None`` for anything that is not a JSON object."""
    if not raw:
        return None
    try:
        fields = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return fields if isinstance(fields, dict) else None


def claim_id_of(raw: bytes | None) -> str | None:
    fields = parse(raw)
    claim = fields.get("claim") if fields else None
    return claim if isinstance(claim, str) and claim else None


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _same_host(fields: dict[str, Any], me: dict[str, Any]) -> bool | None:
    """Whether the holder ran on this host in this PID namespace since its last boot: ``True``; on this host
    before a reboot: ``False`` with a reason given by the caller; ``None``: another host, or unknown."""
    if fields.get("host") != me["host"] or me["boot"] is None or fields.get("boot") is None:
        return None
    if fields.get("boot") != me["boot"]:
        return False
    return fields.get("pidns") == me["pidns"] if me["pidns"] is not None else None


def _dead_on_this_host(fields: dict[str, Any], me: dict[str, Any], is_active: Callable[[str], bool]) -> str | None:
    pid, started = _whole(fields.get("pid")), _whole(fields.get("started"))
    if pid is None or pid <= 0 or started is None:
        return None
    if pid == me["pid"] and started == me["started"]:
        claim = fields.get("claim")
        if isinstance(claim, str) and not is_active(claim):
            return f"its save in this process (pid {pid}) has ended"
        return None
    found = _process_start(pid)
    if found is None:
        return f"its process (pid {pid}) is gone"
    if found[1] in ("Z", "X"):
        return f"its process (pid {pid}) has exited"
    if found[0] != started:
        return f"its process (pid {pid}) is gone; the pid now belongs to another process"
    return None


def stale_reason(
    fields: dict[str, Any] | None, is_active: Callable[[str], bool], now: float | None = None
) -> str | None:
    """Why the lock with ``fields`` no longer protects a running save, or ``None`` (live, or unknown).

    ``is_active(claim_id)``: whether a claim of this process is still held by a running save.
    """
    if fields is None:
        return None
    me = _this_process()
    same = _same_host(fields, me)
    if same is False:
        return f"its host {me['host']} has restarted since"
    if same:
        dead = _dead_on_this_host(fields, me, is_active)
        if dead is not None:
            return dead
    lease, renewed = _number(fields.get("lease_s")), _number(fields.get("renewed"))
    if lease is None or renewed is None or not 0 < lease <= _MAX_LEASE_S:
        return None
    age = (time.time() if now is None else now) - renewed
    if age > lease:
        return f"it was last renewed {age:.0f} s ago, past its {lease:g} s lease"
    return None


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
    a lock only has to outlive its save's process, not the machine (:mod:`dcp_storage.transports.s3_stream`),
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
    try:
        return _create_exclusive(transport, create, path, token)
    except NotImplementedError:  # the store has no create-if-absent (the Transport protocol's create_new)
        pass
    warnings.warn(
        f"{type(transport).__name__} has no create_new(): the lock {transport.url(path)} is checked, then "
        "written, so two saves started at the same moment can both proceed",
        stacklevel=5,
    )
    if transport.exists(path):
        return False
    transport.write_file(path, token)
    return True


def _create_exclusive(transport: Any, create: Callable[[str, bytes], bool] | None, path: str, token: bytes) -> bool:
    """:func:`create_exclusive` through ``create`` (``NotImplementedError`` when there is none)."""
    if create is None:
        raise NotImplementedError
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
        stacklevel=6,
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
