"""Telling an interrupted save from a checkpoint: leftovers of a save without its commit marker.

Every writer here commits by making one *commit marker* visible last, after all data is durable:

* DCP native (:class:`~dcp_storage.FsspecWriter`, torch's ``FileSystemWriter``): ``.metadata`` (or
  ``__{rank}.metadata`` for rank-local saves).
* Sharded safetensors (:class:`~dcp_storage.SafetensorsWriter`, ``save_pretrained``, torch's
  ``HuggingFaceStorageWriter``): ``{prefix}.safetensors.index.json``; the shards
  ``{prefix}-0000k-of-0000N.safetensors`` become visible before it.
* Single-file safetensors: the file itself (renamed from a temp file, or one atomic upload).

A killed save leaves *leftovers*: ``*.distcp`` data files, hidden temp files of atomic writes
(``.{name}.{32 hex}.tmp``, local disks only), dcp-storage's manifest ``.dcp_storage.json``, the lock file
``.dcp_storage.lock`` a save holds until its commit (:mod:`dcp_storage.storage.claim`), or HF shards that
no index names. Leftovers without any commit marker are an interrupted save, never a checkpoint: readers
and ``verify`` raise :class:`~dcp_storage.errors.IncompleteCheckpointError` instead of guessing (a
directory of shards without its index would otherwise load as a checkpoint missing some tensors).

torch's ``save_distributed`` layout (``shard-XXXXX-model-...safetensors``) has no marker at all; its files
are taken as they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dcp_storage.errors import CheckpointNotFoundError, IncompleteCheckpointError
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
from dcp_storage.formats.spec import Probe
from dcp_storage.transports.factory import open_transport

__all__ = [
    "Leftovers",
    "commit_marker",
    "find_leftovers",
    "list_all",
    "probe_or_refuse",
    "raise_if_incomplete",
    "remove_stale_temp_files",
]

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


def list_all(transport: Any, path: str) -> list[str]:
    """Every name directly under ``path``, hidden temp files included (``transport.listdir`` hides them)."""
    if getattr(transport, "is_local", False):
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
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
    return commit_marker(names) is not None


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
    again anyway, because the transport's listing hides temp files.
    """
    if names is None or getattr(transport, "is_local", False):
        names = list_all(transport, path)
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
