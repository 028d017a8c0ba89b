"""Why a reader found no checkpoint of its own format at a URL: a missing bucket, or another format there.

A safetensors file given to ``FsspecReader`` used to fail with ``[Errno 20] Not a directory:
.../model.safetensors/.metadata``, an HF directory with "the checkpoint does not exist", and an HF
directory given to ``BroadcastingTorchSaveReader`` with ``[Errno 21] Is a directory`` and no path. Readers
call :func:`raise_explained` on such an error path, and only there (a healthy load makes no extra
request): it asks whether the bucket exists (:func:`~dcp_storage.transports.buckets.missing_bucket`), then
probes the URL once and runs every registered sniffer (:mod:`.detection`, the same ones ``open_reader``
uses). If another format wins, the reader raises :class:`~dcp_storage.errors.WrongFormatError` naming it and
the reader to use; otherwise the reader's own error stands.
"""

from __future__ import annotations

from typing import Any, NoReturn

from dcp_storage.errors import DcpStorageError, IncompleteCheckpointError, WrongFormatError
from dcp_storage.formats.detection import best_formats, registered_formats, score_formats
from dcp_storage.formats.spec import Probe
from dcp_storage.transports.buckets import missing_bucket

__all__ = ["explain_missing", "raise_explained", "wrong_format"]

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
