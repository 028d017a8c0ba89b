"""What a format provides to be a ``convert`` target: a streaming writer, and the entries it writes.

``convert`` (and ``merge``) read a checkpoint one tensor at a time and hand a format's
:class:`ConvertTarget` the list of output entries (:class:`OutTensor`, :class:`OutValue`: names, dtypes,
shapes, no bytes) and a :class:`Fetch` to ask for each tensor just before it is written, so peak memory
stays near one tensor whatever the checkpoint's size. The writer streams to a :class:`WriteDestination`
(a transport, a path, and the bookkeeping of what was written). Declared here, below the tools, so that
a format's writer lives in its own ``formats/<name>/`` (or in a plugin) and ``convert`` picks it from the
registry by name, knowing no format itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dcp_storage.transports import Transport

__all__ = [
    "ConvertTarget",
    "Fetch",
    "OutTensor",
    "OutValue",
    "WriteDestination",
    "WriteHook",
    "WriteOptions",
    "WrittenFile",
]

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
