"""The entry points: ``open_reader``/``open_writer``, ``load``/``save``, and the built-in formats' registry entries.

``open_reader`` / ``open_writer``: pick the right reader or writer for a URL.

Formats come from the registry (``dcp_storage.formats`` entry points), so an installed plugin's format is
detected like the built-in ones.

``dcp_storage.load`` / ``dcp_storage.save``: ``dcp.load`` / ``dcp.save`` whose failures reach the user once.

Thin conveniences over torch's calls with :func:`~dcp_storage.opening.open_reader` /
:func:`~dcp_storage.opening.open_writer`. What they change is only how a failure looks:

* torch wraps every rank's error in a ``CheckpointException`` (a ``BaseException``, one traceback per rank),
  and a failed metadata read in an ``AssertionError`` quoting it: these raise the library's own error
  instead (:func:`~dcp_storage.errors.unwrap`, or the error the reader recorded), with a note naming the
  failing ranks, a short traceback and no chained torch frames;
* torch logs a traceback on the root logger when the metadata read fails ("Global metadata is not found.
  Falling back to rank local metadata."): records from ``torch.distributed.checkpoint`` are dropped while
  these calls run, and only then (:func:`quiet_torch_checkpoint_logs`);
* without an initialised process group they pass ``no_dist=True`` (torch would assume it, with a warning).

The built-in formats as the ``dcp_storage.formats`` entry points register them.

Each format's own half (name, version, sniffer, description) lives in ``formats/<name>/spec.py``; its
reader and writer are storage classes, a layer above the formats, so they are bound here and the formats
never import the storage layer. Third-party formats pass their factories to ``FormatSpec`` directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_storage import registry
from dcp_storage.errors import DcpStorageError, UnknownFormatError, failing_ranks, unwrap
from dcp_storage.formats.dcp_native.item_loader import DcpLoaderConfig
from dcp_storage.formats.dcp_native.reader import FsspecReader
from dcp_storage.formats.dcp_native.spec import FORMAT as DCP_FORMAT
from dcp_storage.formats.dcp_native.writer import FsspecWriter
from dcp_storage.formats.location import probe_or_refuse
from dcp_storage.formats.safetensors.loader import SafetensorsLoaderConfig
from dcp_storage.formats.safetensors.reader import SafetensorsReader
from dcp_storage.formats.safetensors.spec import FORMAT as SAFETENSORS_FORMAT
from dcp_storage.formats.safetensors.writer import SafetensorsWriter
from dcp_storage.formats.spec import (
    FormatSpec,
    Probe,
    best_formats,
    registered_formats,
    score_formats,
    trust_byte_items,
)
from dcp_storage.formats.torch_save.reader import BroadcastingTorchSaveReader
from dcp_storage.formats.torch_save.spec import FORMAT as TORCH_SAVE_FORMAT
from dcp_storage.integrity.manifest import missing_format_plugin
from dcp_storage.strategies.collectives import share_object

__all__ = [
    "DCP",
    "SAFETENSORS",
    "TORCH_SAVE",
    "UnknownFormatError",
    "detect_format",
    "load",
    "open_reader",
    "open_writer",
    "quiet_torch_checkpoint_logs",
    "raising_ours",
    "reader_of",
    "save",
]


def _describe(probe: Probe) -> str:
    if probe.is_dir:
        shown = ", ".join(probe.names[:8]) + (", ..." if len(probe.names) > 8 else "")
        return f"a directory holding [{shown}]"
    return f"a {probe.size}-byte file starting with {probe.head[:16]!r}"


def detect_format(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> FormatSpec:
    """The format whose sniffer scores ``url`` highest; :class:`UnknownFormatError` if none or a tie."""
    probe = probe_or_refuse(os.fspath(url), storage_options)  # an interrupted save: IncompleteCheckpointError
    specs = registered_formats()
    missing = missing_format_plugin(probe, specs)  # the manifest names a format no plugin here provides
    if missing is not None:
        raise UnknownFormatError(missing)
    scores, failures = score_formats(probe, specs)
    broken = [f"{p.name} ({p.distribution}): {p.error}" for p in registry.list("formats") if p.status == "failed"]
    if not scores:
        tried = ", ".join(sorted(specs)) or "none"
        extra = ("; errors: " + "; ".join(failures)) if failures else ""
        extra += ("; plugins that failed to import: " + "; ".join(broken)) if broken else ""
        raise UnknownFormatError(
            f"{probe.transport.url(probe.path)}: unrecognised checkpoint ({_describe(probe)}); tried formats: "
            f"{tried}{extra}. Pass format=... to choose one."
        )
    winners = best_formats(scores)
    if len(winners) > 1:
        raise UnknownFormatError(
            f"{probe.transport.url(probe.path)}: ambiguous checkpoint ({_describe(probe)}): formats "
            f"{', '.join(winners)} all match; pass format=... to choose one"
        )
    return specs[winners[0]]


def open_reader(
    url: str | os.PathLike[str],
    format: str | None = None,
    storage_options: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """A DCP ``StorageReader`` for ``url``: ``dcp.load(sd, storage_reader=open_reader(url))``.

    ``format`` names a registered format (``"dcp"``, ``"safetensors"``, ``"torch_save"``, or a plugin's);
    without it the format is detected.
    """
    _check_format_name("open_reader", format)
    spec = registry.get("formats", format) if format is not None else detect_format(url, storage_options)
    return reader_of(spec, url, storage_options, **options)


def _check_format_name(api: str, format: object) -> None:
    """``open_reader(url, opts)`` passes the options as ``format`` (the second argument): say so, instead of
    the registry's ``TypeError: unhashable type: 'dict'``."""
    if format is not None and not isinstance(format, str):
        raise TypeError(
            f"{api}: format must be a format name such as 'dcp' or 'safetensors', got a {type(format).__name__}; "
            f"pass storage options by name: {api}(url, storage_options=...)"
        )


def reader_of(
    spec: FormatSpec, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, **options: Any
) -> Any:
    """``spec``'s reader for ``url``; :class:`UnknownFormatError` for a format registered without one."""
    if spec.open_reader is None:
        raise UnknownFormatError(
            f"format {spec.name!r} is registered without a reader; its plugin must pass open_reader"
        )
    return spec.open_reader(os.fspath(url), storage_options=storage_options, **options)


def open_writer(
    url: str | os.PathLike[str], format: str = "dcp", storage_options: dict[str, Any] | None = None, **options: Any
) -> Any:
    """A DCP ``StorageWriter`` for ``url`` in ``format`` (``"dcp"`` or ``"safetensors"``, or a plugin's)."""
    return writable_format(format).open_writer(os.fspath(url), storage_options=storage_options, **options)


def writable_format(format: str, caller: str = "open_writer") -> Any:
    """The registered spec of ``format``, checked to have a writer; :class:`UnknownFormatError` otherwise.

    A caller that will write later (the checkpoint manager) looks its format up once, up front: a wrong name
    fails where it was given, and the plugin discovery it triggers is not paid inside a save."""
    _check_format_name(caller, format)
    spec = registry.get("formats", format)
    if spec.open_writer is None:
        raise UnknownFormatError(
            f"format {format!r} is read-only; writable formats: "
            + ", ".join(n for n, s in registered_formats().items() if s.open_writer is not None)
        )
    return spec


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

    def run() -> Any:
        nonlocal storage
        storage = make()
        return call(storage)

    return raising_ours(run, lambda: storage, verb)


def raising_ours(call: Callable[[], Any], storage: Callable[[], Any], verb: str) -> Any:
    """``call()`` (a ``dcp.load``/``dcp.save`` through the reader or writer ``storage()`` returns) with torch's
    checkpoint logs quiet; a failure that is the library's is raised alone, out of torch's
    ``CheckpointException``, with a note naming the failing ranks (``dcp_storage.<verb> failed on rank 1``)."""
    with quiet_torch_checkpoint_logs():
        try:
            return call()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # CheckpointException is a BaseException; what is not ours re-raised
            ours = _ours(exc, storage(), verb)
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

    def reader() -> Any:
        _check_format_name("load", fmt)
        name = _shared_format(url, fmt, reader_options.get("storage_options"), call)
        return open_reader(url, name, **reader_options)

    _run(reader, lambda r: dcp.load(state, storage_reader=r, **call), "load")


def _shared_format(url: str | os.PathLike[str], fmt: str | None, storage_options: Any, call: dict[str, Any]) -> str:
    """The format: this rank's ``format=``, else the coordinator's (its own ``format=``, or detected once for every
    rank of the load). Every rank takes part, whatever it passed: a probe on each rank cost N probes, and a rank
    whose probe failed raised alone while the others went on into the load's collectives."""
    shared = lambda: fmt or detect_format(url, storage_options).name  # noqa: E731 - run on the coordinator
    coordinators = shared() if call.get("no_dist") else share_object(shared, group=call.get("process_group"))
    return fmt or coordinators


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


def _dcp_reader(path: str, storage_options: dict[str, Any] | None = None, **options: Any) -> FsspecReader:
    trust_byte_items(options, DcpLoaderConfig)
    return FsspecReader(path, storage_options, **options)


def _dcp_writer(path: str, storage_options: dict[str, Any] | None = None, **options: Any) -> FsspecWriter:
    return FsspecWriter(path, storage_options, **options)


def _safetensors_reader(path: str, storage_options: dict[str, Any] | None = None, **options: Any) -> SafetensorsReader:
    trust_byte_items(options, SafetensorsLoaderConfig)
    return SafetensorsReader(path, storage_options, **options)


def _safetensors_writer(path: str, storage_options: dict[str, Any] | None = None, **options: Any) -> SafetensorsWriter:
    return SafetensorsWriter(path, storage_options, **options)


def _torch_save_reader(
    path: str, storage_options: dict[str, Any] | None = None, **options: Any
) -> BroadcastingTorchSaveReader:
    return BroadcastingTorchSaveReader(path, storage_options=storage_options, **options)


DCP = dataclasses.replace(DCP_FORMAT, open_reader=_dcp_reader, open_writer=_dcp_writer)
SAFETENSORS = dataclasses.replace(SAFETENSORS_FORMAT, open_reader=_safetensors_reader, open_writer=_safetensors_writer)
TORCH_SAVE = dataclasses.replace(TORCH_SAVE_FORMAT, open_reader=_torch_save_reader)
