"""What a format plugin provides (a sniffer, reader/writer factories, tool hooks), how a location's format is
detected, and what a convert target is.

What a format plugin provides: a sniffer, reader/writer factories, and the hooks the tools call.

The built-in formats define their own half here in ``formats/<name>/spec.py`` (name, version, sniffer);
their readers and writers live a layer above (``dcp_storage.storage``), which binds them into the specs the
entry points register (:mod:`dcp_storage.opening`), so no format imports the storage layer.

A format registers a :class:`FormatSpec` under the ``dcp_storage.formats`` entry-point group.
:func:`dcp_storage.open_reader` builds one :class:`Probe` of the URL (a directory listing, or the first
bytes of a file) and asks every format's ``sniff``; the best score wins.

Everything a tool knows about a format comes through its spec: ``inspect`` calls ``describe``, ``verify``
calls ``check`` and ``deep_check``, ``convert`` writes through ``convert_target``. So a format lives in
one place (``formats/<name>/``, or a plugin's package), and a plugin's format gets the same tools as the
built-in ones. Each hook is optional; without it the tool falls back to what any format's reader gives
(its ``Metadata``, and every tensor read back).

Which registered format a probed location holds: the one sniffer shared by ``open_reader`` and the readers.

:func:`dcp_storage.open_reader` asks it to pick a reader; a reader that finds no checkpoint of its own
format asks it (on that error path only) whether another format is there, to name it and the reader to use
(:mod:`.misdirected`). Both see the same scores, so the hint never disagrees with what ``open_reader``
would do.

What a format provides to be a ``convert`` target: a streaming writer, and the entries it writes.

``convert`` (and ``merge``) read a checkpoint one tensor at a time and hand a format's
:class:`ConvertTarget` the list of output entries (:class:`OutTensor`, :class:`OutValue`: names, dtypes,
shapes, no bytes) and a :class:`Fetch` to ask for each tensor just before it is written, so peak memory
stays near one tensor whatever the checkpoint's size. The writer streams to a :class:`WriteDestination`
(a transport, a path, and the bookkeeping of what was written). Declared here, below the tools, so that
a format's writer lives in its own ``formats/<name>/`` (or in a plugin) and ``convert`` picks it from the
registry by name, knowing no format itself.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dcp_storage.errors import CheckpointNotFoundError
from dcp_storage.transports import Transport, open_transport
from dcp_storage.transports.access import missing_bucket

if TYPE_CHECKING:
    from dcp_storage.formats.reports import CheckpointInfo, VerifyReport
import math
from collections.abc import Iterator, Sequence

import torch

from dcp_storage import registry
from dcp_storage.errors import DcpStorageError

__all__ = [
    "CheckHook",
    "ConvertTarget",
    "DescribeHook",
    "Fetch",
    "FormatSpec",
    "OutTensor",
    "OutValue",
    "Probe",
    "WriteDestination",
    "WriteHook",
    "WriteOptions",
    "WrittenFile",
    "best_formats",
    "registered_formats",
    "score_formats",
    "trust_byte_items",
]


HEAD_BYTES = 64


@dataclass(frozen=True)
class Probe:
    """What format detection may look at, fetched once: cheap for a bucket prefix or a big file."""

    url: str
    transport: Transport
    path: str
    is_dir: bool
    names: tuple[str, ...] = ()  # entries of the directory (names, not paths)
    head: bytes = b""  # first bytes of the file (empty for a directory)
    size: int = 0

    @classmethod
    def of(cls, url: str, storage_options: dict[str, Any] | None = None) -> Probe:
        transport, path = open_transport(url, storage_options)
        return cls.at(transport, path, url)

    @classmethod
    def at(cls, transport: Transport, path: str, url: str | None = None) -> Probe:
        """Probe ``path`` on an open transport (a reader's own, on its error path)."""
        url = transport.url(path) if url is None else url
        names = transport.listdir(path)
        if names:
            return cls(url, transport, path, True, tuple(names))
        if not transport.exists(path):
            raise missing_bucket(transport, path) or CheckpointNotFoundError(
                f"{transport.url(path)}: no such file or directory"
            )
        size = transport.size(path)
        head = bytes(transport.read_range(path, 0, min(size, HEAD_BYTES))) if size else b""
        return cls(url, transport, path, False, (), head, size)

    @property
    def basename(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    def named(self, suffix: str) -> Iterator[str]:
        """The names ending with ``suffix``, in listing order (sorted), found at C speed: a directory of a
        million data files is probed several times over by the sniffers."""
        return itertools.compress(self.names, map(str.endswith, self.names, itertools.repeat(suffix)))

    def first_named(self, suffix: str) -> str | None:
        """The least name ending with ``suffix`` (whatever order the transport lists in), or ``None``."""
        if suffix + "\0" not in self._joined:  # no name ends with it (a NUL-ended name still matches: scanned)
            return None
        return min(self.named(suffix), default=None)

    @functools.cached_property
    def _joined(self) -> str:
        """Every name followed by a NUL, as one string: one substring search rules a suffix out."""
        return "\0".join(self.names) + "\0"

    def head_of(self, name: str, nbytes: int = HEAD_BYTES) -> bytes:
        """The first ``nbytes`` of ``name`` inside the probed directory."""
        path = self.transport.join(self.path, name)
        size = self.transport.size(path)
        return bytes(self.transport.read_range(path, 0, min(size, nbytes))) if size else b""


class DescribeHook(Protocol):
    def __call__(self, url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
        """What the checkpoint at ``url`` holds and where (files, tensors, chunks with their byte ranges),
        from metadata and headers only: no tensor data is read. Raises our errors for what it cannot read."""
        ...


class CheckHook(Protocol):
    def __call__(self, report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
        """Add every problem found to ``report.problems`` (each naming the file, the key and the reason),
        and what was checked to ``report.notes``/``report.checked``; never raises for a damaged checkpoint."""
        ...


@dataclass(frozen=True)
class FormatSpec:
    """A checkpoint format: ``name/version`` descriptor, detection, reader/writer factories and tool hooks.

    ``sniff(probe)`` returns a score (higher is more specific) when the probe looks like this format, or
    ``None``. ``open_reader(url, storage_options=..., **options)`` returns a DCP ``StorageReader``;
    ``open_writer`` a ``StorageWriter`` (``None`` for read-only formats). A spec registered without a reader
    (a format's own half, before its reader is bound) is detected but cannot be opened. ``reader`` names the reader class
    to suggest to a user who pointed another format's reader at such a checkpoint
    (``"dcp_storage.SafetensorsReader(url)"``); empty: ``open_reader(url, format=name)`` is suggested.

    The tools' hooks (all optional; the fallback in brackets):

    * ``describe`` - ``inspect``'s summary, with file names and byte ranges [the reader's ``Metadata``:
      tensors and shapes, no files];
    * ``check`` - ``verify``'s structural checks: metadata, headers, sizes, coverage, without reading tensor
      data [the reader's ``Metadata`` must load];
    * ``deep_check`` - ``verify --deep``'s byte checks that only the format knows (recorded checksums,
      CRCs), run after the shallow checks passed and every tensor was read back through the reader [none:
      the read-back is all];
    * ``convert_target`` - the streaming writer that makes the format a ``convert --to`` target [not a
      target];
    * ``suffixes`` - file-name endings that imply the format: ``convert`` infers ``--to`` from the output's
      name, ``verify`` checks a file detection refused as the format its name says.
    """

    name: str
    version: str
    sniff: Callable[[Probe], int | None]
    open_reader: Callable[..., Any] | None = None
    open_writer: Callable[..., Any] | None = None
    description: str = ""
    reader: str = ""
    describe: DescribeHook | None = None
    check: CheckHook | None = None
    deep_check: CheckHook | None = None
    convert_target: ConvertTarget | None = None
    suffixes: tuple[str, ...] = ()

    @property
    def descriptor(self) -> str:
        return f"{self.name}/{self.version}"


def trust_byte_items(options: dict[str, Any], config_class: type) -> None:
    """A reader factory's ``trust=True`` (what ``convert(trust=True)`` passes), for readers whose non-tensor
    items are vetted by a loader config: ``options["loader_config"]`` with ``trust_byte_items=True``."""
    if options.pop("trust", False):
        config = options.get("loader_config") or config_class()
        options["loader_config"] = dataclasses.replace(config, trust_byte_items=True)


def registered_formats() -> dict[str, FormatSpec]:
    """Every format of the registry (built-in and plugins), by name."""
    return {name: spec for name, spec in registry.load_all("formats").items() if isinstance(spec, FormatSpec)}


def score_formats(probe: Probe, specs: dict[str, FormatSpec]) -> tuple[dict[str, int], list[str]]:
    """Each format's sniffer score for ``probe`` (formats that do not match are left out), and the errors
    sniffers raised (``"name: message"``)."""
    scores: dict[str, int] = {}
    failures: list[str] = []
    for name, spec in specs.items():
        try:
            score = spec.sniff(probe)
        except DcpStorageError as exc:
            failures.append(f"{name}: {exc}")
            continue
        if score is not None:
            scores[name] = score
    return scores, failures


def best_formats(scores: dict[str, int]) -> list[str]:
    """The names with the best score, sorted (one name: detected; more: ambiguous; none: unknown)."""
    if not scores:
        return []
    best = max(scores.values())
    return sorted(n for n, s in scores.items() if s == best)


Path = tuple[Any, ...]


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: its output key and nested path, the source key, and its output dtype/shape."""

    key: str
    path: Path
    src: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    order: int = 0  # position in the source's metadata (outputs that mix tensors and values keep it)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class OutValue:
    """One output non-tensor value (step counters, extra state)."""

    key: str
    path: Path
    src: str
    order: int = 0


@dataclass(frozen=True)
class WrittenFile:
    name: str  # relative to the destination directory (the file name for a single-file destination)
    size: int


class Fetch(Protocol):
    """What a writer asks for while it streams (implemented by the engine).

    ``tensors(outs)`` yields ``(out, tensor)`` in the order given, read in batches (of up to 16 MiB, one
    reader plan each): a writer that knows the order it writes in should use it, since many small tensors
    asked for one by one each cost a round trip through the reader. ``tensor(out)`` reads one.
    """

    def tensor(self, out: OutTensor) -> torch.Tensor: ...

    def tensors(self, outs: Sequence[OutTensor]) -> Iterator[tuple[OutTensor, torch.Tensor]]: ...

    def value_bytes(self, out: OutValue) -> bytes: ...

    def value(self, out: OutValue) -> Any: ...


class WriteDestination(Protocol):
    """Where a writer puts its files: a transport and a path (a directory, or the file of a one-file output).

    A writer commits each file atomically (``transport.open_atomic``), calls :meth:`record` for it, and
    :meth:`advance` after each tensor it wrote and dropped (progress, and memory given back).
    """

    url: str
    transport: Transport
    path: str
    overwrite: bool

    def join(self, name: str) -> str: ...

    def parent_and_name(self) -> tuple[str, str]: ...

    def record(self, name: str, size: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def url_of(self, path: str) -> str: ...


@dataclass(frozen=True)
class WriteOptions:
    """The knobs every target gets; a target ignores what it has no use for."""

    max_shard_size: int | None = None  # bytes per output file; None: the target's default
    drop_non_tensors: bool = False  # leave values out (instead of NonTensorStateError) where they cannot go
    single_file: bool = False  # write exactly ``dest.path`` as one file (only for targets with single_file)
    descriptor: str = ""  # the format's ``name/version``, for writers that record what wrote the checkpoint


class WriteHook(Protocol):
    def __call__(
        self,
        dest: WriteDestination,
        tensors: Sequence[OutTensor],
        values: Sequence[OutValue],
        fetch: Fetch,
        options: WriteOptions,
    ) -> tuple[str, list[str]]:
        """Write the entries; returns the path a reader should open, and the value keys left out."""
        ...


class RefuseHook(Protocol):
    def __call__(self, tensors: Sequence[OutTensor], values: Sequence[OutValue], options: WriteOptions) -> None:
        """Raise our error (naming every key) for what the format cannot hold, before anything is read."""
        ...


@dataclass(frozen=True)
class ConvertTarget:
    """A format as ``convert``'s output: ``convert(src, dst, to=name)``, ``dcp-storage convert --to NAME``.

    ``name`` is what ``to`` takes (it may differ from the format's registry name: ``torch_save`` writes as
    ``torch``), ``aliases`` other spellings. ``single_file``: the output can be one file, chosen when the
    destination's name ends in one of the format's ``suffixes`` (else a directory). ``refuse`` runs before
    any tensor is read, so an impossible conversion fails without writing anything.
    """

    name: str
    write: WriteHook
    aliases: tuple[str, ...] = ()
    single_file: bool = True
    refuse: RefuseHook | None = None
