"""``dcp_storage.load`` / ``dcp_storage.save``: ``dcp.load`` / ``dcp.save`` whose failures reach the user once.

Thin conveniences over torch's calls with :func:`~dcp_storage.opening.open_reader` /
:func:`~dcp_storage.opening.open_writer`. What they change is only how a failure looks:

* torch wraps every rank's error in a ``CheckpointException`` (a ``BaseException``, one traceback per rank),
  and a failed metadata read in an ``AssertionError`` quoting it: these raise the library's own error
  instead (:func:`~dcp_storage.unwrapping.unwrap`, or the error the reader recorded), with a note naming the
  failing ranks, a short traceback and no chained torch frames;
* torch logs a traceback on the root logger when the metadata read fails ("Global metadata is not found.
  Falling back to rank local metadata."): records from ``torch.distributed.checkpoint`` are dropped while
  these calls run, and only then (:func:`quiet_torch_checkpoint_logs`);
* without an initialised process group they pass ``no_dist=True`` (torch would assume it, with a warning).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_storage.errors import DcpStorageError
from dcp_storage.opening import open_reader, open_writer
from dcp_storage.unwrapping import failing_ranks, unwrap

__all__ = ["load", "quiet_torch_checkpoint_logs", "save"]

# dcp.load / dcp.save's own keywords; every other keyword goes to the reader or writer.
_DCP_KEYWORDS = ("planner", "process_group", "no_dist")
_TORCH_DCP_DIR = os.path.dirname(dcp.__file__) + os.sep


def _from_torch_dcp(record: logging.LogRecord) -> bool:
    return not record.pathname.startswith(_TORCH_DCP_DIR)


@contextlib.contextmanager
def quiet_torch_checkpoint_logs() -> Iterator[None]:
    """While inside, log records emitted by ``torch.distributed.checkpoint``'s modules are dropped.

    torch logs through the root logger (``logging.getLogger()``), so the filter sits on the root logger and is
    removed on exit: records from any other module, and torch's after the call, are untouched.
    """
    root = logging.getLogger()
    root.addFilter(_from_torch_dcp)
    try:
        yield
    finally:
        root.removeFilter(_from_torch_dcp)


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    call = {k: options.pop(k) for k in _DCP_KEYWORDS if k in options}
    if "no_dist" not in call and call.get("process_group") is None and not dist.is_initialized():
        call["no_dist"] = True
    return call, options


def _ours(exc: BaseException, storage: Any, verb: str) -> DcpStorageError | None:
    """The library's error behind ``exc`` with a note naming the failing ranks, or ``None`` if it is not ours."""
    inner = unwrap(exc)
    recorded = getattr(getattr(storage, "metadata_failure", None), "error", None)
    if not isinstance(inner, DcpStorageError) and isinstance(recorded, DcpStorageError):
        inner = recorded  # torch's AssertionError quoting a failed read_metadata: the reader kept the error
    if not isinstance(inner, DcpStorageError):
        return None
    ranks = failing_ranks(exc)
    if not ranks:
        where = "this rank"
    elif len(ranks) == 1:
        where = f"rank {ranks[0]}"
    else:
        where = "ranks " + ", ".join(map(str, ranks))
    note = f"dcp_storage.{verb} failed on {where}"
    if note not in getattr(inner, "__notes__", ()):
        inner.add_note(note)
    return inner


def _run(make: Callable[[], Any], call: Callable[[Any], Any], verb: str) -> Any:
    """``call(make())`` with torch's checkpoint logs quiet; a failure that is ours is re-raised alone."""
    storage = None
    with quiet_torch_checkpoint_logs():
        try:
            storage = make()
            return call(storage)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # CheckpointException is a BaseException; what is not ours re-raised
            ours = _ours(exc, storage, verb)
            if ours is None:
                raise
    raise ours.with_traceback(None) from None  # ours alone: no torch frames, no "during handling" chain


def load(state: dict[str, Any], url: str | os.PathLike[str], **options: Any) -> None:
    """``dcp.load(state, storage_reader=open_reader(url, ...))``, raising the library's own error.

    ``options``: ``planner``, ``process_group``, ``no_dist`` go to ``dcp.load``; the rest
    (``storage_options``, ``format``, ``verify``, ``read_strategy``, ...) to :func:`open_reader`. A failure
    raises the :class:`~dcp_storage.errors.DcpStorageError` a reader or planner raised on any rank, with a
    note naming the failing ranks; an error that is not ours propagates as torch raised it.
    """
    call, reader_options = _split(dict(options))
    fmt = reader_options.pop("format", None)
    _run(lambda: open_reader(url, fmt, **reader_options), lambda r: dcp.load(state, storage_reader=r, **call), "load")


def save(state: dict[str, Any], url: str | os.PathLike[str], **options: Any) -> Any:
    """``dcp.save(state, storage_writer=open_writer(url, ...))``, raising the library's own error.

    ``options``: ``planner``, ``process_group``, ``no_dist`` go to ``dcp.save``; the rest (``format``,
    ``storage_options``, ``overwrite``, ...) to :func:`open_writer`. Returns ``dcp.save``'s ``Metadata``.
    """
    call, writer_options = _split(dict(options))
    fmt = writer_options.pop("format", "dcp")
    return _run(
        lambda: open_writer(url, fmt, **writer_options), lambda w: dcp.save(state, storage_writer=w, **call), "save"
    )
