"""Claiming a location for one save, so that of two saves to one place exactly one wins.

Checking for ``.metadata`` and then writing is a race: two saves both find nothing, both write the same
file names, and the survivor can be a mix of both. So a save's coordinator, in ``prepare_global_plan``,
before any rank writes a byte:

1. creates the *lock file* ``.dcp_storage.lock`` (``__{rank}.dcp_storage.lock`` for a rank-local save)
   with the store's create-if-absent primitive (:mod:`dcp_storage.transports.exclusive`: ``O_EXCL``,
   S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure ``If-None-Match: *``);
2. only then looks for the commit markers of an existing checkpoint;
3. removes the lock once its own commit marker is written (:meth:`Claim.release`).

Of two saves with ``overwrite=False`` one creates the lock and the other's create fails: it raises
:class:`~dcp_storage.errors.CheckpointExistsError` having written nothing (which is why the lock comes
first: a loser found out only at commit time would already have replaced the winner's data files and
manifest, whose names are fixed by the formats). A save that starts after another one committed creates
the lock, finds the marker, removes its lock and raises the same error.

A save that dies before its commit leaves its lock behind, and from outside a dead save looks exactly like
a running one, so later ``overwrite=False`` saves are refused with the lock's holder (save id, host, pid,
start time) in the message; the same writer object retrying its own failed save takes its lock back, and
``overwrite=True`` takes over any lock. An ``overwrite=True`` save writes the lock unconditionally (it
replaces whatever is there), so an ``overwrite=False`` save starting meanwhile is refused instead of
mixing in. Readers report a lock without a commit marker as an interrupted save
(:mod:`dcp_storage.formats.completeness`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import socket
import stat
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointExistsError
from ..formats.paths import LOCK_FILE
from ..integrity.provenance import writer_descriptor
from ..transports.local_transport import directory_in_the_way

__all__ = ["LOCK_FILE", "Claim", "ClaimingWriter", "claim_location", "lock_name", "refuse_existing"]

_log = logging.getLogger(__name__)
_READ_LIMIT = 4096  # a lock is ~200 bytes; only this much of whatever is there is read for the message
_SHOWN = re.compile(r"[^A-Za-z0-9._:+@/-]")  # what of the holder's fields reaches a message: no control bytes


def lock_name(rank: int | None = None) -> str:
    """``.dcp_storage.lock``, or ``__{rank}.dcp_storage.lock`` for a rank-local save."""
    return LOCK_FILE if rank is None else f"__{rank}{LOCK_FILE}"


@dataclass(frozen=True)
class Claim:
    """A lock this save holds: ``path`` on ``transport``, holding ``token`` (unique to the save)."""

    transport: Any
    path: str
    token: bytes
    took_over: bool = False  # overwrite=True found another save's lock there and replaced it

    def lost(self) -> CheckpointExistsError | None:
        """The error to raise if the lock no longer holds this save's token (another save took it over, or
        removed it); ``None`` while this save still holds it. Checked just before a commit: a save whose
        location was taken over must not commit over the save that took it."""
        if _read_lock(self.transport, self.path) == self.token:
            return None
        return CheckpointExistsError(
            f"{self.transport.url(self.path)}: another save took this location over while this one was writing "
            f"({_holder(self.transport, self.path)}); this save was not committed. Save again with "
            "overwrite=True to replace that save's checkpoint, or save to another path"
        )

    def release(self) -> None:
        """Remove the lock, after the commit marker is written.

        A failure is logged, not raised: the checkpoint is committed, and a lock beside a commit marker
        only makes later ``overwrite=False`` saves say "a checkpoint already exists", which is true.
        """
        try:
            self.transport.remove(self.path)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            _log.warning("could not remove the lock %s after the commit: %s", self.transport.url(self.path), exc)


def refuse_existing(transport: Any, markers: Iterable[str]) -> None:
    """Raise :class:`CheckpointExistsError` naming the first of ``markers`` (commit markers) that exists."""
    for path in markers:
        if transport.exists(path):
            raise CheckpointExistsError(
                f"{transport.url(path)}: a checkpoint already exists here; pass overwrite=True to replace it "
                "or save to another path"
            )


def claim_location(
    transport: Any,
    lock_path: str,
    *,
    save_id: str,
    overwrite: bool,
    markers: Iterable[str] | Callable[[], Iterable[str]],
    previous: Claim | None = None,
    rivals: Callable[[], Iterable[str]] | None = None,
) -> Claim:
    """Take the lock at ``lock_path`` for the save ``save_id`` (module docstring: the protocol).

    ``markers``: the commit markers whose presence means a checkpoint exists, or a function listing them
    (called after the lock is created, so a listing sees what any save that lost the race committed).
    ``previous``: a claim an earlier attempt of the same writer took and never released (a failed save),
    which it may take back. ``rivals``: lists the locks of saves of another kind that would write the same
    files (a collective save and a rank-local one: ``.dcp_storage.lock`` against ``__{rank}.dcp_storage.lock``);
    asked after this lock exists, so of two such saves at least one sees the other's lock.
    Raises :class:`CheckpointExistsError` (``overwrite=False``) if another save holds the lock or a rival
    lock, or a marker exists; nothing is written then, and the lock is not left behind.
    """
    if getattr(transport, "is_local", False) and os.path.isdir(lock_path) and not os.path.islink(lock_path):
        raise directory_in_the_way(transport.url(lock_path))  # no save made it: neither waiting nor overwrite helps
    token = _token(save_id)
    claim = Claim(transport, lock_path, token)
    if overwrite:
        create = getattr(transport, "create_new", None)
        if create is None or not create(lock_path, token):
            transport.write_file(lock_path, token)  # replaces whatever lock is there (a stale one, usually)
            return Claim(transport, lock_path, token, took_over=True)
        return claim
    if not _create(transport, lock_path, token, previous):
        refuse_existing(transport, _listed(markers))  # a committed save that could not remove its lock: say so
        raise CheckpointExistsError(_held_message(transport, lock_path))
    try:
        refuse_existing(transport, _listed(markers))
        for rival in rivals() if rivals is not None else ():
            if transport.exists(rival):
                raise CheckpointExistsError(_held_message(transport, rival))
    except BaseException:
        claim.release()
        raise
    return claim


def _listed(markers: Iterable[str] | Callable[[], Iterable[str]]) -> list[str]:
    return list(markers() if callable(markers) else markers)


def _token(save_id: str) -> bytes:
    holder = {
        "save_id": save_id,
        "writer": writer_descriptor(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return json.dumps(holder, sort_keys=True).encode()


def _create(transport: Any, path: str, token: bytes, previous: Claim | None) -> bool:
    create = getattr(transport, "create_new", None)
    if create is None:
        warnings.warn(
            f"{type(transport).__name__} has no create_new(): the lock {transport.url(path)} is checked, then "
            "written, so two saves started at the same moment can both proceed",
            stacklevel=4,
        )
        if transport.exists(path):
            created = False
        else:
            transport.write_file(path, token)
            created = True
    else:
        created = create(path, token)
    if created:
        return True
    if previous is not None and previous.path == path and _read_lock(transport, path) == previous.token:
        transport.write_file(path, token)  # this writer's own lock from a save that failed: take it back
        return True
    return False


def _read_lock(transport: Any, path: str) -> bytes | None:
    """The lock's bytes if it is a small regular file: never a FIFO, a device or a symlink (whose target may
    lie outside the checkpoint), never a large read."""
    try:
        if transport.is_local:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                return os.read(fd, _READ_LIMIT)
            finally:
                os.close(fd)
        if transport.size(path) > _READ_LIMIT:
            return None
        return bytes(transport.read_file(path))
    except (OSError, ValueError):  # gone meanwhile, or unreadable: the holder stays unknown
        return None


def _held_message(transport: Any, path: str) -> str:
    return (
        f"{transport.url(path)}: another save holds this location ({_holder(transport, path)}); it is still "
        "running, or it stopped before its commit. Wait for it, pass overwrite=True to replace whatever is there "
        "(the lock included), or save to another path"
    )


def _holder(transport: Any, path: str) -> str:
    """Who holds the lock at ``path``, as far as its bytes tell (printable characters only)."""
    holder = "its holder is unknown"
    raw = _read_lock(transport, path)
    try:
        fields = json.loads(raw) if raw else None
    except (ValueError, RecursionError):  # not JSON, or nested past json's recursion limit: holder unknown
        fields = None
    if isinstance(fields, dict):
        keys = ("save_id", "writer", "host", "pid", "since")
        shown = {k: _SHOWN.sub("?", str(fields.get(k, "?")))[:64] for k in keys}
        holder = (
            f"save {shown['save_id']} by {shown['writer']} on host {shown['host']}, pid {shown['pid']}, "
            f"since {shown['since']}"
        )
    return holder


class ClaimingWriter:
    """What a writer mixes in to claim its location: :meth:`_take_claim` in ``prepare_global_plan`` (on the
    coordinator, before any rank writes), :meth:`_release_claim` in ``finish`` after the commit marker.

    The writer sets ``transport``, ``save_id`` and ``overwrite``. The claim outlives a failed save on
    purpose: the next attempt of the same writer takes it back (``previous`` of :func:`claim_location`).
    """

    transport: Any
    save_id: str
    overwrite: bool
    _claim: Claim | None = None
    _process_local: tuple[str, ...] = ("_claim",)  # a pickled copy (a checkpoint process) starts without one

    def _take_claim(
        self,
        lock_path: str,
        markers: Iterable[str] | Callable[[], Iterable[str]],
        rivals: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self._claim = claim_location(
            self.transport,
            lock_path,
            save_id=self.save_id,
            overwrite=self.overwrite,
            markers=markers,
            previous=self._claim,
            rivals=rivals,
        )

    def _claim_lost(self) -> CheckpointExistsError | None:
        """Whether another save took this save's lock over meanwhile (:meth:`Claim.lost`); ``None`` on ranks
        that hold no claim (only the coordinator does)."""
        claim = self._claim
        if claim is None:
            return None
        lost = claim.lost()
        if lost is not None:
            self._claim = None  # the lock is another save's now: never released or taken back by this writer
        return lost

    def _confirm_claim(self) -> None:
        """Raise :class:`CheckpointExistsError` before a commit if another save took the lock over."""
        lost = self._claim_lost()
        if lost is not None:
            raise lost

    def _release_claim(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.release()
