"""Claiming a location for one save (exactly one of two saves wins), and retiring what an ``overwrite=True`` save
replaces.

Claiming a location for one save, so that of two saves to one place exactly one wins.

Checking for ``.metadata`` and then writing is a race: two saves both find nothing, both write the same
file names, and the survivor can be a mix of both. So a save's coordinator, in ``prepare_global_plan``,
before any rank writes a byte:

1. creates the *lock file* ``.dcp_storage.lock`` (``__{rank}.dcp_storage.lock`` for a rank-local save)
   with the store's create-if-absent primitive (:mod:`dcp_storage.transports.s3_stream`: ``O_EXCL``,
   S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure ``If-None-Match: *``);
2. only then looks for the commit markers of an existing checkpoint;
3. removes the lock once its own commit marker is written (:meth:`Claim.release`).

Of two saves with ``overwrite=False`` one creates the lock and the other's create fails: it raises
:class:`~dcp_storage.errors.CheckpointExistsError` having written nothing (which is why the lock comes
first: a loser found out only at commit time would already have replaced the winner's data files and
manifest, whose names are fixed by the formats). A save that starts after another one committed creates
the lock, finds the marker, removes its lock and raises the same error.

A save that dies before its commit leaves its lock behind. The lock names its holder (:mod:`.lock_holder`:
host, boot, pid and process start time, a lease it renews while the save runs, :mod:`.lease`), so a later
``overwrite=False`` save tells a dead holder from a running one: a lock whose process is gone on this host
(or whose pid now belongs to another process), whose save in this very process has ended, or whose lease
ran out without a renewal (any host) is taken over (:mod:`.takeover`: one taker wins), and the taker's data
files get names of their own (as after an ``overwrite=True`` over files), so a late write of the dead save
cannot land under the new metadata. Any other lock refuses the save with its holder in the message; the
same writer object retrying its own failed save takes its lock back, and ``overwrite=True`` takes over any
lock. An ``overwrite=True`` save writes the lock unconditionally (it replaces whatever is there), so an
``overwrite=False`` save starting meanwhile is refused instead of mixing in. Readers report a lock without
a commit marker as an interrupted save (:mod:`dcp_storage.formats.location`).

Retiring the files an ``overwrite=True`` save replaces, only once the new checkpoint is committed.

A save killed at any moment must leave the location loading as the old checkpoint or as the new one,
never as neither. So the old checkpoint is left whole until the new commit marker is in place:

1. before any rank writes (:func:`prepare_dcp_overwrite`): only what no checkpoint uses goes, the temp
   files of a killed save (local disks); the new data files get names the old ones cannot have (the
   writer's per-save tag), so nothing of the old checkpoint is rewritten;
2. the commit: the new ``.metadata`` replaces the old one in one step (a rename, or one PUT);
3. after it (:func:`retire_unreferenced`): every data file the committed ``.metadata`` does not name, the
   old checkpoint's and any killed save's leftovers alike (they were never part of a checkpoint: readers
   find files through ``.metadata`` only).

Nothing is removed through a link that leads out of the checkpoint (:func:`refuse_links_out`): a prefix
strategy's directory that is a symlink to another checkpoint would otherwise have that checkpoint's files
retired. Safetensors has fixed file names; :func:`retire_safetensors` and the writer say what it can keep.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dcp_storage.errors import CheckpointExistsError, WrongPathTypeError
from dcp_storage.formats.commit_holder import (
    claim_id_of,
    create_exclusive,
    holder_fields,
    lease_seconds,
    parse,
    read_lock,
    rewrite_lock,
    take_over,
)
from dcp_storage.formats.commit_lease import Renewal, forget, is_active, pending
from dcp_storage.formats.location import remove_stale_temp_files
from dcp_storage.formats.paths import DATA_SUFFIX, HF_SHARD_RE, LOCK_FILE, TEMP_RE, single_name
from dcp_storage.integrity.manifest import writer_descriptor
from dcp_storage.transports.local import directory_in_the_way

__all__ = [
    "Claim",
    "ClaimingWriter",
    "LOCK_FILE",
    "claim_location",
    "hold_stale_lock",
    "lock_name",
    "prepare_dcp_overwrite",
    "refuse_existing",
    "refuse_links_out",
    "retire_safetensors",
    "retire_unreferenced",
    "unreferenced_data_files",
]


_log = logging.getLogger(__name__)
_SHOWN = re.compile(r"[^A-Za-z0-9._:+@/-]")  # what of the holder's fields reaches a message: no control bytes
_read_lock = read_lock  # the name the tests and older callers use


def lock_name(rank: int | None = None) -> str:
    """``.dcp_storage.lock``, or ``__{rank}.dcp_storage.lock`` for a rank-local save."""
    return LOCK_FILE if rank is None else f"__{rank}{LOCK_FILE}"


@dataclass(frozen=True)
class Claim:
    """A lock this save holds: ``path`` on ``transport``, created holding ``token`` (unique to the save;
    its ``claim`` id stays while renewals rewrite the other fields)."""

    transport: Any
    path: str
    token: bytes
    took_over: bool = False  # another save's lock was there (overwrite=True, or a stale one) and was replaced
    renewal: Renewal | None = field(default=None, compare=False, repr=False)

    @property
    def claim_id(self) -> str | None:
        return claim_id_of(self.token)

    def holds(self) -> bool:
        """Whether the lock still carries this claim (read from the store)."""
        raw = read_lock(self.transport, self.path)
        return raw == self.token if self.claim_id is None else claim_id_of(raw) == self.claim_id

    def lost(self) -> CheckpointExistsError | None:
        """The error to raise if the lock no longer holds this save's claim (another save took it over, or
        removed it); ``None`` while this save still holds it. Checked just before a commit: a save whose
        location was taken over must not commit over the save that took it."""
        if self.holds():
            return None
        return CheckpointExistsError(
            f"{self.transport.url(self.path)}: another save took this location over while this one was writing "
            f"({_holder(self.transport, self.path)}); this save was not committed. Save again with "
            "overwrite=True to replace that save's checkpoint, or save to another path"
        )

    def stop_renewing(self) -> None:
        if self.renewal is not None:
            self.renewal.stop()
        elif self.claim_id is not None:
            forget(self.claim_id)

    def release(self) -> None:
        """Stop renewing and remove the lock (after the commit marker is written), if it is still ours.

        A failure is logged, not raised: the checkpoint is committed, and a lock beside a commit marker
        only makes later ``overwrite=False`` saves say "a checkpoint already exists", which is true.
        """
        self.stop_renewing()
        try:
            if self.holds():  # never another save's lock, taken over meanwhile
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
    The returned claim is renewed in the background until it is released or its save ends (:mod:`.lease`).
    """
    if getattr(transport, "is_local", False) and os.path.isdir(lock_path) and not os.path.islink(lock_path):
        raise directory_in_the_way(transport.url(lock_path))  # no save made it: neither waiting nor overwrite helps
    lease = lease_seconds()
    fields = _fields(save_id, lease)
    token = _encode(fields)
    with pending(fields["claim"]):
        claim = _acquire(transport, lock_path, token, overwrite, previous)
        if claim is None:
            refuse_existing(transport, _listed(markers))  # a committed save that could not remove its lock: say so
            raise CheckpointExistsError(_held_message(transport, lock_path))
        if not overwrite:
            try:
                refuse_existing(transport, _listed(markers))
                for rival in rivals() if rivals is not None else ():
                    if transport.exists(rival):
                        raise CheckpointExistsError(_held_message(transport, rival))
            except BaseException:
                claim.release()
                raise
        renewal = Renewal(
            fields["claim"],
            fields,
            lease / 3,
            read_id=lambda: claim_id_of(read_lock(transport, lock_path)),
            write=lambda data: rewrite_lock(transport, lock_path, data),
            encode=_encode,
            remove=lambda: claim.release(),
        )
        claim = Claim(transport, lock_path, token, claim.took_over, renewal)
        renewal.start()
    return claim


def _acquire(transport: Any, path: str, token: bytes, overwrite: bool, previous: Claim | None) -> Claim | None:
    """Create the lock, or take back this writer's own, or take over a stale one (``overwrite=False``);
    ``overwrite=True`` replaces any lock. ``None``: another save holds it."""
    if overwrite:
        if create_exclusive(transport, path, token):
            return Claim(transport, path, token)
        transport.write_file(path, token)  # replaces whatever lock is there (a stale one, usually)
        return Claim(transport, path, token, took_over=True)
    for _attempt in range(2):  # twice: a lock released between the create and the read is created anew
        if create_exclusive(transport, path, token):
            return Claim(transport, path, token)
        raw = read_lock(transport, path)
        if previous is not None and previous.path == path and _same_claim(raw, previous):
            rewrite_lock(transport, path, token)  # this writer's own lock from a save that failed: take it back
            return Claim(transport, path, token)
        if raw is not None:
            if take_over(transport, path, token, is_active) is not None:
                return Claim(transport, path, token, took_over=True)
            return None
    return None


def hold_stale_lock(transport: Any, path: str) -> tuple[Claim | None, str]:
    """For ``verify --cleanup``: take over the lock at ``path`` if it is stale (as a save would, so a save
    starting meanwhile and this call never both win), to be released by the caller after removing what
    the dead save left. ``(claim, why it was stale)``, or ``(None, who holds it)`` for a live or unknown
    holder (nothing is changed then)."""
    fields = _fields("cleanup", lease_seconds())
    token = _encode(fields)
    with pending(fields["claim"]):
        reason = take_over(transport, path, token, is_active)
    if reason is None:
        return None, _holder(transport, path)
    return Claim(transport, path, token, took_over=True), reason


def _same_claim(raw: bytes | None, claim: Claim) -> bool:
    return raw == claim.token if claim.claim_id is None else claim_id_of(raw) == claim.claim_id


def _listed(markers: Iterable[str] | Callable[[], Iterable[str]]) -> list[str]:
    return list(markers() if callable(markers) else markers)


def _fields(save_id: str, lease: int) -> dict[str, Any]:
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return holder_fields(save_id, uuid.uuid4().hex, writer_descriptor(), since, lease)


def _encode(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True).encode()


def _held_message(transport: Any, path: str) -> str:
    return (
        f"{transport.url(path)}: another save holds this location ({_holder(transport, path)}); it is still "
        "running, or it stopped before its commit (its lock is taken over once its holder is provably gone: "
        "its process ended on this host, or it stopped renewing its lease). Wait for it, pass overwrite=True to "
        "replace whatever is there (the lock included), or save to another path"
    )


def _holder(transport: Any, path: str) -> str:
    """Who holds the lock at ``path``, as far as its bytes tell (printable characters only)."""
    fields = parse(read_lock(transport, path))
    if not isinstance(fields, dict):
        return "its holder is unknown"
    keys = ("save_id", "writer", "host", "pid", "since", "lease_s")
    shown = {k: _SHOWN.sub("?", str(fields.get(k, "?")))[:64] for k in keys}
    return (
        f"save {shown['save_id']} by {shown['writer']} on host {shown['host']}, pid {shown['pid']}, "
        f"since {shown['since']}, lease {shown['lease_s']} s"
    )


class ClaimingWriter:
    """What a writer mixes in to claim its location: :meth:`_take_claim` in ``prepare_global_plan`` (on the
    coordinator, before any rank writes), :meth:`_release_claim` in ``finish`` after the commit marker.

    The writer sets ``transport``, ``save_id`` and ``overwrite``. The lock outlives a failed save on
    purpose (no hook tells the writer that another rank failed), but stops being renewed when the save's
    call returns (:mod:`.lease`): the next attempt of the same writer takes it back (``previous`` of
    :func:`claim_location`), any save in this process takes it over, and elsewhere once its lease runs out.
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
        if self._claim is not None:
            self._claim.stop_renewing()  # an earlier save's (it failed): only this new one runs now
        self._claim = claim_location(
            self.transport,
            lock_path,
            save_id=self.save_id,
            overwrite=self.overwrite,
            markers=markers,
            previous=self._claim,
            rivals=rivals,
        )
        weakref.finalize(self, self._claim.stop_renewing)  # a writer dropped mid-save stops renewing

    @contextlib.contextmanager
    def _claimed(
        self,
        lock_path: str,
        markers: Iterable[str] | Callable[[], Iterable[str]],
        rivals: Callable[[], Iterable[str]] | None = None,
    ) -> Iterator[None]:
        """:meth:`_take_claim`, then the rest of ``prepare_global_plan``: if that fails, the lock is released
        (no rank has written anything yet)."""
        self._take_claim(lock_path, markers, rivals)
        try:
            yield
        except BaseException:
            self._release_claim()
            raise

    def _claim_lost(self) -> CheckpointExistsError | None:
        """Whether another save took this save's lock over meanwhile (:meth:`Claim.lost`); ``None`` on ranks
        that hold no claim (only the coordinator does)."""
        claim = self._claim
        if claim is None:
            return None
        lost = claim.lost()
        if lost is not None:
            claim.stop_renewing()
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


_DCP_DATA_FILE = re.compile(rf"^__(\d+)_.*{re.escape(DATA_SUFFIX)}$")  # ours and torch's FileSystemWriter's; (1): rank


def refuse_links_out(transport: Any, root: str, directories: Iterable[str]) -> None:
    """Raise :class:`~dcp_storage.errors.WrongPathTypeError` if a data directory under ``root`` (local disks)
    is, or passes through, a symlink that leads outside the checkpoint: a save would write into, and retire
    the files of, whatever lies there (torch's writer deletes nothing; neither may ours)."""
    if not getattr(transport, "is_local", False):
        return  # object stores have no links
    real_root = os.path.realpath(root)
    for where in sorted(set(directories) - {""}):
        path = transport.join(root, where)
        real = os.path.realpath(path)
        if os.path.commonpath([real_root, real]) != real_root:
            raise WrongPathTypeError(
                f"{transport.url(path)}: this data directory of the checkpoint is a symlink leading outside it "
                f"(to {real}); a save would write into, and retire files of, whatever lies there. Nothing was "
                "written or removed: remove the link, or save to another path"
            )


def _data_files(transport: Any, root: str, rank: int | None, directories: Iterable[str]) -> list[str]:
    """Relative names of the data files under ``root`` and ``directories`` (a rank-local save: its rank's)."""
    found = []
    for where in ["", *sorted(set(directories) - {""})]:
        folder = transport.join(root, where) if where else root
        for name in transport.listdir(folder):
            data_file = _DCP_DATA_FILE.match(name)
            if data_file and (rank is None or data_file.group(1) == str(rank)):
                found.append(f"{where}/{name}" if where else name)
    return found


def prepare_dcp_overwrite(
    transport: Any, root: str, rank: int | None, own_lock: str, directories: Iterable[str] = ()
) -> bool:
    """Before an ``overwrite=True`` save writes: remove a killed save's temp files (local disks; not for a
    rank-local save, ``rank`` set, whose fellow ranks may be writing theirs), and nothing else.

    Returns whether the location held anything but the save's own lock (``own_lock``, a name): then the
    new data files must not reuse the old names (see :class:`~dcp_storage.FsspecWriter`).
    """
    names = transport.listdir(root)
    held = any(name != own_lock for name in names) or bool(_data_files(transport, root, rank, directories))
    if rank is None:
        remove_stale_temp_files(transport, root)
    return held


def unreferenced_data_files(
    transport: Any, root: str, referenced: Iterable[str], rank: int | None = None, directories: Iterable[str] = ()
) -> list[str]:
    """The data files under ``root`` (and ``directories``) that ``referenced`` (relative names) does not name."""
    keep = set(referenced)
    return [name for name in _data_files(transport, root, rank, directories) if name not in keep]


def retire_unreferenced(
    transport: Any,
    root: str,
    referenced: Iterable[str],
    rank: int | None,
    directories: Iterable[str] = (),
    markers: Iterable[str] = (),
) -> list[str]:
    """After the commit: remove ``markers`` (metadata files that would shadow the new one), then every data
    file the committed ``.metadata`` does not name (``referenced``); returns the data files removed."""
    for path in markers:
        transport.remove(path)
    gone = unreferenced_data_files(transport, root, referenced, rank, directories)
    for name in gone:
        transport.remove(transport.join(root, name))
    return gone


def retire_safetensors(
    transport: Any, root: str, prefix: str, index: str, extra: str, keep: Iterable[str] = (), *, marker: bool = True
) -> None:
    """Remove the ``index`` file (``marker``), then ``{prefix}.safetensors`` and its shards, ``extra`` and stale
    temp files, except the names in ``keep`` (the files a committed save just wrote)."""
    kept = set(keep)
    if marker and index not in kept:
        transport.remove(transport.join(root, index))  # first: the old checkpoint stops looking complete
    names = transport.listdir(root)
    if transport.is_local:
        with contextlib.suppress(FileNotFoundError):
            names = sorted(set(names) | set(os.listdir(root)))  # listdir hides temp files
    for name in names:
        if name in kept:
            continue
        temp = TEMP_RE.match(name)  # a killed save's temp file of one of ours
        if _is_ours(name, prefix) or (temp is not None and _is_ours(temp.group("name"), prefix)) or name == extra:
            transport.remove(transport.join(root, name))


def _is_ours(name: str, prefix: str) -> bool:
    """Whether ``name`` is ``{prefix}.safetensors`` or one of the ``{prefix}-0000k-of-0000N`` shards."""
    shard = HF_SHARD_RE.match(name)
    return name == single_name(prefix) or (shard is not None and shard.group("prefix") == prefix)
