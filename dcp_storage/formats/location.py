"""Where a checkpoint is: a URL bound to a transport, why no checkpoint was found there, and whether a save there
completed.

What every reader and writer of a URL shares: binding the URL to a transport, and reporting on it.

A class using :class:`BoundLocation` sets ``storage_options``, ``transport_config`` and ``_given_transport``
in its constructor, then calls :meth:`~BoundLocation._open` with the URL (again from ``reset`` when DCP
passes a new ``checkpoint_id``). A reader uses :class:`LoadingLocation`, which adds each load's id; a writer uses :class:`SavingLocation`, which adds the save's id and the
rank facts of ``set_up_storage_writer``.

Pickling (``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)`` sends the writer
to a checkpoint process by pickle): what lives only in this process (the transport with its thread pool,
locks, clients and sessions; anything a class lists in ``_process_local``) is left out, and the transport
is opened again, through the factory, from the URL, ``storage_options`` and ``transport_config`` on first
use in the receiving process. ``storage_options`` (credentials included) travel inside the pickle, which
torch sends through a pipe, never through a file. A transport given to the constructor is pickled itself
(the core's and the obstore plugin's leave their pools and clients behind, as here).

Why a reader found no checkpoint of its own format at a URL: a missing bucket, or another format there.

A safetensors file given to ``FsspecReader`` used to fail with ``[Errno 20] Not a directory:
.../model.safetensors/.metadata``, an HF directory with "the checkpoint does not exist", and an HF
directory given to ``BroadcastingTorchSaveReader`` with ``[Errno 21] Is a directory`` and no path. Readers
call :func:`raise_explained` on such an error path, and only there (a healthy load makes no extra
request): it asks whether the bucket exists (:func:`~dcp_storage.transports.access.missing_bucket`), then
probes the URL once and runs every registered sniffer (:mod:`.detection`, the same ones ``open_reader``
uses). If another format wins, the reader raises :class:`~dcp_storage.errors.WrongFormatError` naming it and
the reader to use; otherwise the reader's own error stands.

Telling an interrupted save from a checkpoint: leftovers of a save without its commit marker.

Every writer here commits by making one *commit marker* visible last, after all data is durable:

* DCP native (:class:`~dcp_storage.FsspecWriter`, torch's ``FileSystemWriter``): ``.metadata`` (or
  ``__{rank}.metadata`` for rank-local saves).
* Sharded safetensors (:class:`~dcp_storage.SafetensorsWriter`, ``save_pretrained``, torch's
  ``HuggingFaceStorageWriter``): ``{prefix}.safetensors.index.json``; the shards
  ``{prefix}-0000k-of-0000N.safetensors`` become visible before it.
* Single-file safetensors: the file itself (renamed from a temp file, or one atomic upload).

A killed save leaves *leftovers*: ``*.distcp`` data files, hidden temp files of atomic writes
(``.{name}.{32 hex}.tmp``, local disks only), dcp-storage's manifest ``.dcp_storage.json``, the lock file
``.dcp_storage.lock`` a save holds until its commit (:mod:`dcp_storage.formats.commit_claim`), or HF shards that
no index names. Leftovers without any commit marker are an interrupted save, never a checkpoint: readers
and ``verify`` raise :class:`~dcp_storage.errors.IncompleteCheckpointError` instead of guessing (a
directory of shards without its index would otherwise load as a checkpoint missing some tensors).

torch's ``save_distributed`` layout (``shard-XXXXX-model-...safetensors``) has no marker at all; its files
are taken as they are.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass
from typing import Any, NoReturn

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from dcp_storage.errors import (
    CheckpointNotFoundError,
    DcpStorageError,
    IncompleteCheckpointError,
    LocationMismatchError,
    WrongFormatError,
)
from dcp_storage.formats.paths import (
    DATA_SUFFIX,
    HF_SHARD_RE,
    INDEX_SUFFIX,
    LOCK_RE,
    MANIFEST_RE,
    METADATA_FILE,
    RANK_METADATA_RE,
    SAFETENSORS_SUFFIX,
    TEMP_RE,
)
from dcp_storage.formats.spec import Probe, best_formats, registered_formats, score_formats
from dcp_storage.transports import TransportConfig, bind_transport, open_transport
from dcp_storage.transports.access import missing_bucket
from dcp_storage.transports.guards import begin_load

__all__ = [
    "BoundLocation",
    "Leftovers",
    "LoadingLocation",
    "SavingLocation",
    "commit_marker",
    "explain_missing",
    "find_leftovers",
    "list_all",
    "probe_or_refuse",
    "raise_explained",
    "raise_if_incomplete",
    "remove_stale_temp_files",
    "wrong_format",
]


class BoundLocation:
    """``path`` (the URL as given), ``transport`` and ``root`` (the path on it), ``checkpoint_id``, ``counters``."""

    storage_options: dict[str, Any]
    transport_config: TransportConfig | None
    _given_transport: Any
    # Attributes never pickled (see the module docstring); classes add theirs, and every class's list counts.
    _process_local: tuple[str, ...] = ("transport", "root")

    def _open(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.transport, self.root = bind_transport(
            self.path, self.storage_options, self.transport_config, self._given_transport
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for cls in type(self).__mro__:
            for name in cls.__dict__.get("_process_local", ()):
                state.pop(name, None)
        return state

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes not set: after unpickling, the transport is opened on first use.
        if name in ("transport", "root") and "path" in self.__dict__:
            self._open(self.path)
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @property
    def counters(self) -> dict[str, int]:
        """Requests, bytes and retries so far (see :class:`~dcp_storage.transports.TransportCounters`)."""
        return self.transport.counters.snapshot()


class LoadingLocation(BoundLocation):
    """A reader's :class:`BoundLocation`, with each load's id (``load_id``, stamped on the ``Metadata`` it reads).

    The reader calls :meth:`_open_load` last in its constructor (instead of ``_open``), :meth:`_next_load`
    from ``reset`` and :meth:`_stamp_load` on the ``Metadata`` its ``read_metadata`` returns.
    """

    def _open_load(self, path: str | os.PathLike[str]) -> None:
        self.load_id = uuid.uuid4().hex
        self._open(path)

    def _next_load(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """``reset``: another location when DCP names one, every object pinned anew, and a new load id."""
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self._open(checkpoint_id)
        begin_load(self.transport)  # each object pinned anew to the version this load sees first
        self.load_id = uuid.uuid4().hex

    def _stamp_load(self, metadata: Metadata) -> Metadata:
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata


class SavingLocation(BoundLocation):
    """A writer's :class:`BoundLocation`, with what every save there shares: its id (``save_id``, new on each
    ``reset``) and what ``set_up_storage_writer`` says of this rank (``is_coordinator``, ``rank``,
    ``use_collectives``: ``False`` for a rank-local save).

    The writer calls :meth:`_open_save` last in its constructor (instead of ``_open``) and :meth:`_next_save`
    from ``reset``.
    """

    def _open_save(self, path: str | os.PathLike[str]) -> None:
        self.is_coordinator = False
        self.rank: int | None = None
        self.use_collectives = True
        self.save_id = uuid.uuid4().hex
        self._open(path)

    def _next_save(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """``reset``: another location when DCP names one, and a new save id."""
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self._open(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def _locate_plan(self, plan: Any) -> Any:
        """``prepare_local_plan`` of a collective save: the plan says where this rank writes (the writer's own
        ``storage_data`` kept inside), for :meth:`_check_plan_locations` on the coordinator."""
        if not self.use_collectives:
            return plan
        return dataclasses.replace(plan, storage_data=LocatedPlanData(self._write_location(), plan.storage_data))

    def _check_plan_locations(self, plans: list[Any]) -> list[Any]:
        """``prepare_global_plan``, before anything is written: every rank writes where the coordinator does
        (:class:`~dcp_storage.errors.LocationMismatchError`, raised on every rank by DCP, else); the plans as
        the writer made them. Ranks given different paths would each write their data files to their own path
        and the coordinator's ``.metadata`` would name files that are not beside it: a checkpoint that looks
        complete and is not. With DCP's plan caching (``enable_plan_caching=True``) a rank whose plan did not
        change sends none, so only the ranks whose plans changed are compared."""
        mine = self._write_location()
        for rank, plan in enumerate(plans):
            there = plan.storage_data
            if isinstance(there, LocatedPlanData) and there.location != mine:
                raise LocationMismatchError(
                    f"rank {rank} of this save writes to {there.location}, but the coordinator writes to {mine}: "
                    "every rank of one dcp.save must write to the same checkpoint (pass the same path or "
                    "checkpoint_id on every rank); nothing was written"
                )
        return [
            dataclasses.replace(p, storage_data=p.storage_data.data)
            if isinstance(p.storage_data, LocatedPlanData)
            else p
            for p in plans
        ]

    def _write_location(self) -> str:
        text = self.transport.url(self.root)
        return text.rstrip("/") if "://" in text else os.path.realpath(text)


@dataclass(frozen=True)
class LocatedPlanData:
    """A collective save's local plan ``storage_data`` until the coordinator's ``prepare_global_plan``: where
    the rank writes (compared there), and the writer's own ``storage_data``."""

    location: str
    data: Any = None


# What a reader says when nothing of its format is at the URL: its own words add nothing to the hint.
_NOTHING_THERE = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


def wrong_format(
    transport: Any, path: str, own_format: str, reader: str, error: BaseException | None = None
) -> WrongFormatError | None:
    """:class:`WrongFormatError` if ``path`` holds a checkpoint of a format other than ``own_format``.

    Sniffers look at names and first bytes, and some guess (a directory whose ``.metadata`` cannot be read
    goes to the DCP reader, whose error then names it). So when the reader's own ``error`` was about the
    content (a corrupt file it recognised as its own), that error is kept in the message: it may be the
    real story, and it names the file.
    """
    specs = registered_formats()
    probe = Probe.at(transport, path)
    scores, _failures = score_formats(probe, specs)
    winners = best_formats(scores)
    if len(winners) != 1 or winners[0] == own_format:
        return None
    found = specs[winners[0]]
    use = found.reader or f"dcp_storage.open_reader(url, format={found.name!r})"
    message = (
        f"{transport.url(path)}: this looks like a {found.name} checkpoint, not a {own_format} one, which {reader} "
        f"reads; use dcp_storage.open_reader(url) (it detects the format) or {use}"
    )
    if error is not None and not isinstance(error, _NOTHING_THERE):
        message += f" (if it is not, {reader}'s own error was: {error})"
    return WrongFormatError(message)


def explain_missing(transport: Any, path: str, own_format: str, reader: str, error: BaseException) -> BaseException:
    """The most useful error for a reader of ``own_format`` that failed at ``path`` with ``error``.

    A missing bucket, or another format at ``path``; else ``error`` itself. Probing is a courtesy: if it
    fails (the store is down, the path unreadable), ``error`` stands.
    """
    if isinstance(error, IncompleteCheckpointError):
        return error  # an interrupted save of some format: already the precise answer
    try:
        better = missing_bucket(transport, path) or wrong_format(transport, path, own_format, reader, error)
    except (DcpStorageError, OSError):
        return error
    return better if better is not None else error


def raise_explained(
    transport: Any, path: str, own_format: str, reader: str, error: BaseException, fallback: BaseException | None = None
) -> NoReturn:
    """Raise :func:`explain_missing`'s answer for a reader's failure ``error`` (from an ``except`` block).

    ``fallback`` replaces ``error`` when nothing better is found (an OS error that names no path, say).
    Anything but ``error`` itself is chained to it.
    """
    if isinstance(error, IncompleteCheckpointError):
        raise error  # an interrupted save of some format: already the precise answer
    better = explain_missing(transport, path, own_format, reader, fallback if fallback is not None else error)
    if better is error:
        raise error
    raise better from error


TORCH_DISTRIBUTED_SHARD = "shard-"  # torch's HuggingFaceStorageWriter(save_distributed=True): no index
_NAMES_SHOWN = 4


@dataclass(frozen=True)
class Leftovers:
    """What an interrupted save left at ``url``: file names (relative) by kind, and the missing marker."""

    url: str
    data_files: tuple[str, ...]
    temp_files: tuple[str, ...]
    manifests: tuple[str, ...]
    marker: str
    locks: tuple[str, ...] = ()

    def error(self) -> IncompleteCheckpointError:
        detail = _shown(self.data_files)
        if self.temp_files:
            n = len(self.temp_files)
            detail += f" and {n} temp file{'s' if n != 1 else ''} of unfinished writes{_shown(self.temp_files)}"
        if self.manifests:
            detail += f" and a manifest ({', '.join(self.manifests)})"
        if self.locks:
            detail += f" and the lock of a save that is still running or was interrupted ({', '.join(self.locks)})"
        return IncompleteCheckpointError(self.url, len(self.data_files), self.marker, detail)


def _shown(names: tuple[str, ...]) -> str:
    if not names:
        return ""
    listed = ", ".join(names[:_NAMES_SHOWN]) + (", ..." if len(names) > _NAMES_SHOWN else "")
    return f" ({listed})"


def list_all(transport: Any, path: str, ordered: bool = True) -> list[str]:
    """Every name directly under ``path``, hidden temp files included (``transport.listdir`` hides them);
    sorted unless ``ordered`` is false (a local listing is then as the directory gives it: sorting a
    million names is most of the cost of listing them)."""
    if getattr(transport, "is_local", False):
        try:
            names = os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(names) if ordered else names
    return list(transport.listdir(path))


def _is_single_safetensors(name: str) -> bool:
    """A committed single-file checkpoint (or a torch ``save_distributed`` shard): no index expected."""
    if not name.endswith(SAFETENSORS_SUFFIX) or name.startswith("."):
        return False
    return name.startswith(TORCH_DISTRIBUTED_SHARD) or HF_SHARD_RE.match(name) is None


def commit_marker(names: list[str] | tuple[str, ...]) -> str | None:
    """The first commit marker among ``names`` (a directory's listing), or ``None``: no checkpoint is
    committed there. The checkpoint manager's truth of which steps are complete."""
    for name in names:
        if name == METADATA_FILE or RANK_METADATA_RE.match(name) or name.endswith(INDEX_SUFFIX):
            return name
        if _is_single_safetensors(name):
            return name
    return None


def _has_marker(names: list[str]) -> bool:
    return METADATA_FILE in names or commit_marker(names) is not None  # the common marker found at C speed


def _missing_marker(data: list[str], temps: list[str], manifests: list[str]) -> str:
    """The commit marker the leftovers' writer would have written last."""
    finals = [m.group("name") for m in map(TEMP_RE.match, temps) if m]
    if manifests or any(n.endswith(DATA_SUFFIX) or n == METADATA_FILE for n in data + finals):
        return METADATA_FILE
    for name in data + finals:
        shard = HF_SHARD_RE.match(name)
        if shard:
            return shard.group("prefix") + INDEX_SUFFIX
    for name in finals:
        if name.endswith((INDEX_SUFFIX, SAFETENSORS_SUFFIX)):
            return name
    return METADATA_FILE


def find_leftovers(transport: Any, path: str, names: list[str] | None = None) -> Leftovers | None:
    """The leftovers of an interrupted save at ``path``, or ``None`` (a commit marker, or nothing of a save).

    ``names``: the listing of ``path`` if the caller has one; on a local disk the directory is listed
    again (the transport's listing hides temp files) unless ``names`` already shows a commit marker.
    """
    if names is not None and _has_marker(names):  # a marker in part of the listing is one in all of it
        return None
    if names is None or getattr(transport, "is_local", False):
        names = list_all(transport, path, ordered=False)  # each kind is sorted below
    if _has_marker(names):
        return None
    data = sorted(n for n in names if n.endswith(DATA_SUFFIX) or (HF_SHARD_RE.match(n) and not n.startswith(".")))
    temps = sorted(n for n in names if TEMP_RE.match(n))
    manifests = sorted(n for n in names if MANIFEST_RE.match(n))
    locks = sorted(n for n in names if LOCK_RE.match(n))
    if not (data or temps or manifests or locks):
        return None
    marker = _missing_marker(data, temps, manifests)
    return Leftovers(transport.url(path), tuple(data), tuple(temps), tuple(manifests), marker, tuple(locks))


def raise_if_incomplete(transport: Any, path: str, names: list[str] | None = None) -> None:
    """Raise :class:`IncompleteCheckpointError` if ``path`` holds leftovers of a save but no commit marker."""
    leftovers = find_leftovers(transport, path, names)
    if leftovers is not None:
        raise leftovers.error()


def probe_or_refuse(url: str, storage_options: dict[str, Any] | None = None) -> Any:
    """:meth:`Probe.of` ``url``, refusing an interrupted save before any format sniffs its leftovers.

    Uses the probe's own listing (no extra request on an object store); on a local disk the directory is
    listed once more, because temp files are hidden from the probe (a directory holding only temp files
    even looks like a file to it).
    """

    try:
        probe = Probe.of(url, storage_options)
    except Exception:
        _refuse_local_leftovers(url, storage_options)  # a local directory the probe took for a file
        raise
    if probe.is_dir or (probe.transport.is_local and os.path.isdir(probe.path)):
        raise_if_incomplete(probe.transport, probe.path, list(probe.names))
    return probe


def _refuse_local_leftovers(url: str, storage_options: dict[str, Any] | None) -> None:
    try:
        transport, path = open_transport(url, storage_options)
    except Exception:  # noqa: BLE001 - the caller re-raises its own error
        return
    if getattr(transport, "is_local", False) and os.path.isdir(path):
        raise_if_incomplete(transport, path)
        # Nothing visible in it (the probe would have listed it): an empty directory is no checkpoint.
        raise CheckpointNotFoundError(f"{transport.url(path)}: an empty directory, no checkpoint files in it")


def remove_stale_temp_files(transport: Any, path: str) -> list[str]:
    """Delete the temp files of atomic writes under ``path`` (local disks: a killed save's partial files).

    Only for a save's coordinator before any rank writes (``overwrite=True``): nothing else may be writing
    there then. Object stores have no temp files (an unfinished upload is invisible; see
    :func:`dcp_storage.inspection.abort_stale_uploads`). Returns the names removed.
    """
    if not getattr(transport, "is_local", False):
        return []
    removed = [n for n in list_all(transport, path) if TEMP_RE.match(n)]
    for name in removed:
        transport.remove(transport.join(path, name))
    return removed
