"""Every exception of the project, and getting ours back out of torch's ``CheckpointException``.

The project's exception hierarchy.

Every error raised on purpose derives from :class:`DcpStorageError`, which derives from
:class:`Exception`, so callers can catch "anything this library refused" in one clause. Subclasses also
derive from the builtin exception that matches their meaning (``FileNotFoundError``, ``FileExistsError``,
``ValueError``, ``OSError``), so code written against builtins keeps working.

Messages name the file, the key and the reason, and where there is one, the fix. They quote names from the
checkpoint, so every message is escaped (:func:`dcp_storage.text.printable`) when the error is made: no
control character from a checkpoint reaches a terminal or a log through ``str(error)``. Fields kept on an
error (``path``, ``keys``, ...) stay exact. Secrets inside a URL in a message (a presigned signature, a SAS
``sig=``, a password) are masked there too.

``unwrap``: the library's own error from inside torch's ``CheckpointException``.

``dcp.load`` / ``dcp.save`` run each rank's planning and I/O steps inside torch's collectives, which catch
whatever a reader, writer or planner raised on any rank and raise a ``CheckpointException`` on every rank
instead. That class derives from ``BaseException`` (``except Exception`` misses it), and keeps each rank's
exception and traceback in ``failures``. :func:`unwrap` digs ours out: the lowest rank whose failure is (or
was caused by) a :class:`~dcp_storage.errors.DcpStorageError`, else the lowest rank's failure; anything else
is returned as is. It never imports torch (``failures`` is read by duck typing), so it sits with the errors.
"""

from __future__ import annotations

from dcp_storage.text import printable, redact_urls

__all__ = [
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "CrossOriginRedirectError",
    "DcpStorageError",
    "FileTooLargeError",
    "IncompleteCheckpointError",
    "ListingTooLongError",
    "LocationMismatchError",
    "NonTensorStateError",
    "ObjectChangedError",
    "RankMismatchError",
    "ShapeMismatchError",
    "StaleManifestWarning",
    "StorageAccessError",
    "StorageFullError",
    "StorageOptionsError",
    "TargetError",
    "TransportError",
    "UnknownExtensionError",
    "UnknownFormatError",
    "UnsafeCheckpointError",
    "UnsupportedDtypeError",
    "UnsupportedKeyError",
    "WrongFormatError",
    "WrongPathTypeError",
    "failing_ranks",
    "unwrap",
]


class DcpStorageError(Exception):
    """Base class of every error dcp-storage raises on purpose."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        # Escaped here, once for every subclass: a message is formed from fields a checkpoint controls; and the
        # secrets a (presigned) URL in it may carry are masked (:func:`~dcp_storage.text.redact_urls`).
        super().__init__(*(printable(redact_urls(a)) if isinstance(a, str) else a for a in args), **kwargs)


class UnsafeCheckpointError(DcpStorageError):
    """A checkpoint asked to import or call something outside the allow-list.

    Raised before the payload runs: the unpickler refuses the global instead of resolving it.
    """

    def __init__(self, path: str, forbidden: str, detail: str = "") -> None:
        self.path = path
        self.forbidden = forbidden
        self.detail = detail
        msg = f"{path}: refusing to unpickle forbidden global {forbidden!r}"
        if detail:
            msg += f" ({detail})"
        msg += "; the file may be malicious, nothing from it was executed"
        super().__init__(msg)

    def __reduce__(self) -> tuple[object, ...]:  # crosses processes (DCP gathers rank errors by pickle)
        return (type(self), (self.path, self.forbidden, self.detail))


class CheckpointNotFoundError(DcpStorageError, FileNotFoundError):
    """A file the checkpoint needs does not exist (metadata, a data file, the checkpoint itself)."""


class IncompleteCheckpointError(CheckpointNotFoundError):
    """A location holds leftovers of a save (data files, temp files, a manifest) but no commit marker.

    Every writer here commits by writing one marker last (DCP: ``.metadata``; sharded safetensors: the
    index), so leftovers without it are an interrupted save, never a checkpoint. It derives from
    :class:`CheckpointNotFoundError` (and so ``FileNotFoundError``), not :class:`CorruptCheckpointError`:
    the save never completed, so there is no checkpoint at that path, and resume logic written as "no
    checkpoint here: fall back to the previous one" must treat it exactly like a missing one. Corruption
    means a *committed* checkpoint lost bytes, which is a different alarm.
    """

    def __init__(self, url: str, data_files: int, marker: str, detail: str = "") -> None:
        self.url = url
        self.data_files = data_files
        self.marker = marker
        self.detail = detail
        msg = f"incomplete checkpoint: {url} has {data_files} data files{detail} but no {marker} (an interrupted save?)"
        msg += "; save again with overwrite=True to replace it, or load an earlier checkpoint"
        super().__init__(msg)

    def __reduce__(self) -> tuple[object, ...]:  # crosses processes (DCP gathers rank errors by pickle)
        return (type(self), (self.url, self.data_files, self.marker, self.detail))


class BucketNotFoundError(CheckpointNotFoundError):
    """The bucket (or Azure container) a URL names does not exist, so nothing under it can either.

    Raised on load (a checkpoint cannot be there) and on save: writers never create buckets unless asked
    (``create_bucket=True``), so a typo in a bucket name fails instead of saving into a new bucket.
    """

    def __init__(self, url: str, bucket: str, noun: str = "bucket", fix: str = "") -> None:
        self.url = url
        self.bucket = bucket
        self.noun = noun
        self.fix = fix
        msg = f"{url}: the {noun} {bucket!r} does not exist"
        if fix:
            msg += f"; {fix}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[object, ...]:  # crosses processes (DCP gathers rank errors by pickle)
        return (type(self), (self.url, self.bucket, self.noun, self.fix))


class CheckpointExistsError(DcpStorageError, FileExistsError):
    """A save would clobber an existing checkpoint and ``overwrite=False`` was asked for."""


class WrongPathTypeError(DcpStorageError, FileExistsError):
    """Something that is no part of a checkpoint sits where a save must write: a file where the checkpoint
    directory (or one above it) goes, a directory where a file of the checkpoint or its lock goes. Nothing is
    removed on the user's behalf; the message names the path and says to remove it or save elsewhere."""


class LocationMismatchError(DcpStorageError, ValueError):
    """The ranks of one ``dcp.load`` were given different checkpoints: the coordinator read one checkpoint's
    metadata, and this rank would read another's data with it (a silent mix). The message names both."""


class RankMismatchError(DcpStorageError, ValueError):
    """The ranks of one ``dcp.load`` or ``dcp.save`` disagree on how to run it (readers with different read
    strategies, a planner whose ``finish_plan`` changed one rank's plan where the others rely on it): what
    would otherwise leave ranks waiting in different collectives. The message names the ranks and what each
    one has."""


class CorruptCheckpointError(DcpStorageError, ValueError):
    """A file exists but its bytes do not match what the metadata promises (truncated, garbled)."""


class StaleManifestWarning(RuntimeWarning):
    """A checkpoint's ``.dcp_storage.json`` does not describe its ``.metadata`` (another writer saved over it):
    the manifest is ignored. ``verify`` reports it as a note instead."""


class FileTooLargeError(CorruptCheckpointError):
    """A file that is read whole (metadata, manifest, index) is larger than its limit; nothing past the limit
    was read. ``size`` is its size where the store said so, else ``None`` (more than ``limit`` bytes)."""

    def __init__(
        self, url: str, size: int | None = None, limit: int | None = None, what: str = "this file", fix: str = ""
    ) -> None:
        """``FileTooLargeError(url, size, limit)``, positional or by keyword (``url=``, ``size=``, ``limit=``,
        ``what=``, ``fix=``); or, like every other error here, one message: ``FileTooLargeError("...")``."""
        self.url, self.size, self.limit, self.what, self.fix = url, size, limit, what, fix
        if limit is None:  # a message, as CorruptCheckpointError(message) takes
            super().__init__(url)
            return
        has = f"is {size} bytes" if size is not None else f"has more than {limit} bytes"
        msg = f"{url}: {has}, more than the {limit}-byte limit for {what}; refusing to read it (corrupt or hostile?)"
        super().__init__(msg + (f"; {fix}" if fix else ""))

    def __reduce__(self) -> tuple[object, ...]:  # crosses processes (DCP gathers rank errors by pickle)
        return (type(self), (self.url, self.size, self.limit, self.what, self.fix))


class ObjectChangedError(CorruptCheckpointError):
    """An object was replaced while a load read it: a later read saw another version (ETag, generation) than
    the first read of the same load. Never retried into a mix of two versions: retry the whole load."""

    def __init__(self, url: str, pinned: str, seen: str | None) -> None:
        self.url, self.pinned, self.seen = url, pinned, seen
        now = f"now {seen!r}" if seen is not None else "that version is gone"
        super().__init__(
            f"{url}: the object changed during the load (first read saw version {pinned!r}, {now}); "
            "its bytes would mix two versions, so nothing was loaded from it: retry the load"
        )

    def __reduce__(self) -> tuple[object, ...]:  # crosses processes (DCP gathers rank errors by pickle)
        return (type(self), (self.url, self.pinned, self.seen))


class TransportError(DcpStorageError, OSError):
    """Storage kept failing after the retry policy gave up; the message names URL, range and attempts."""


class ListingTooLongError(DcpStorageError, OSError):
    """A store's listing (objects, in-progress uploads) passed its bound on pages or entries, or repeated a
    continuation token: a broken or hostile server whose listing never ends. Not retried; the message names
    the URL, the bound and the environment variable that raises it."""


class StorageFullError(DcpStorageError, OSError):
    """A write failed because the storage is full or over quota (``ENOSPC``, ``EDQUOT``).

    The message names the path, the bytes needed where known, and the fix (free space, then retry). The
    writer that raises it leaves nothing behind but what was there before: its temp files and its lock are
    removed, so the retry after space is freed succeeds. ``errno`` is the original one.
    """

    def __init__(self, path: str, needed: int | None = None, errno_: int | None = None, detail: str = "") -> None:
        self.path, self.needed, self.detail = path, needed, detail
        need = f" ({needed} bytes needed)" if needed is not None else ""
        msg = f"{path}: no space left on the storage{need}{': ' + detail if detail else ''}; free space and retry"
        super().__init__(msg)
        if errno_ is not None:
            self.errno = errno_

    def __reduce__(self) -> tuple[object, ...]:  # crosses processes (DCP gathers rank errors by pickle)
        return (type(self), (self.path, self.needed, getattr(self, "errno", None), self.detail))


class StorageOptionsError(DcpStorageError, ValueError):
    """The URL or storage options cannot make a client (an endpoint that is not a URL, a malformed region, a
    ``file://`` URL naming another host): no request was sent. The message names the URL, the reason and the
    fix."""


class StorageAccessError(DcpStorageError, PermissionError):
    """The store refused the credentials, or found none, or they do not grant the operation (401/403).

    Never retried. The message names the operation and URL, the store's reason, and where credentials come
    from; it never shows a credential.
    """


class CrossOriginRedirectError(StorageAccessError):
    """An HTTP(S) server redirected a checkpoint read to another origin (scheme, host or port): refused before
    the request is repeated there, so no credential or header of the checkpoint's storage options leaves for
    a host the user did not name, and no bytes from that host are loaded."""


class WrongFormatError(DcpStorageError, ValueError):
    """A reader was pointed at a checkpoint of another format; the message names that format and the reader
    to use (``open_reader`` detects it)."""


class UnknownFormatError(DcpStorageError, ValueError):
    """No format (or more than one, equally) recognised the input; the message lists what was tried."""


class TargetError(DcpStorageError, ValueError):
    """A conversion's output format cannot be told from the arguments, or contradicts the destination's name;
    or the output is the input itself (or, for a merge that removes its input, lies inside it)."""


class UnknownExtensionError(DcpStorageError, LookupError):
    """An item was written through a stream extension that no installed package provides; the message names
    the file, the key, the descriptor and the distribution to install (from the checkpoint's manifest)."""

    def __str__(self) -> str:  # keep KeyError-style quoting out of the message
        return str(self.args[0])


class ShapeMismatchError(DcpStorageError, ValueError):
    """A destination tensor does not have the shape the checkpoint says (names the key and both shapes)."""


class UnsupportedDtypeError(DcpStorageError, TypeError):
    """Tensors whose dtype the target format cannot store (names every key and its dtype)."""

    def __init__(self, keys: dict[str, object], format_name: str = "safetensors") -> None:
        self.keys = dict(keys)
        self.format_name = format_name
        listed = ", ".join(f"{k!r} ({v})" for k, v in sorted(self.keys.items()))
        super().__init__(
            f"{format_name} has no dtype for {listed}; cast these tensors to a supported dtype before saving"
        )

    def __reduce__(self) -> tuple[object, ...]:  # crosses processes (DCP gathers rank errors by pickle)
        return (type(self), (self.keys, self.format_name))


class NonTensorStateError(DcpStorageError, TypeError):
    """State dict entries that are not tensors (ints, lists, ...) where the format stores only tensors."""

    def __init__(self, keys: list[str], format_name: str = "safetensors", fix: str = "") -> None:
        self.keys = sorted(keys)
        self.format_name = format_name
        self.fix = fix
        msg = f"{format_name} stores only tensors, but these entries are not: {', '.join(map(repr, self.keys))}"
        if fix:
            msg += f"; {fix}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.keys, self.format_name, self.fix))


class UnsupportedKeyError(DcpStorageError, ValueError):
    """State dict keys the target format cannot store (safetensors: text that is not valid Unicode, such as a
    lone surrogate, or the reserved ``__metadata__``); names every key, escaped."""

    def __init__(self, keys: list[str], format_name: str = "safetensors", why: str = "") -> None:
        self.keys = sorted(keys)
        self.format_name = format_name
        self.why = why
        listed = ", ".join(map(repr, self.keys))
        super().__init__(f"{format_name} cannot store the keys {listed}{f' ({why})' if why else ''}; rename them")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.keys, self.format_name, self.why))


def _failures(exc: BaseException) -> dict[int, BaseException]:
    raw = getattr(exc, "failures", None)
    if type(exc).__name__ != "CheckpointException" or not isinstance(raw, dict):
        return {}
    out = {}
    for rank, failure in raw.items():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            out[int(rank)] = inner
    return out


def _ours(exc: BaseException) -> DcpStorageError | None:
    """``exc`` or the first of its causes/contexts that is one of ours (a chain at most 32 deep)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 32:
        if isinstance(current, DcpStorageError):
            return current
        current = current.__cause__ or current.__context__
        seen += 1
    return None


def failing_ranks(exc: BaseException) -> list[int]:
    """The ranks a ``CheckpointException`` reports as failed, ascending (``[]`` for any other exception)."""
    return sorted(_failures(exc))


def unwrap(exc: BaseException) -> BaseException:
    """The library's error inside ``exc`` (a torch ``CheckpointException``, whichever rank raised it).

    The lowest failing rank whose error is ours (or was caused by ours), else the lowest failing rank's
    error; ``exc`` itself when it is not a ``CheckpointException``, or is one with no failures::

        try:
            dcp.load(state, storage_reader=ds.FsspecReader(url, opts))
        except BaseException as exc:  # CheckpointException is a BaseException
            raise ds.unwrap(exc) from exc
    """
    failures = _failures(exc)
    if not failures:
        return exc
    for rank in sorted(failures):
        ours = _ours(failures[rank])
        if ours is not None:
            return ours
    return failures[min(failures)]
