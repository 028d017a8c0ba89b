"""The source side of ``convert``: tensors of any checkpoint, one at a time, and its ``planner_data`` tree checked
first.

The nested paths of a checkpoint's ``planner_data``, checked as one tree before any container is built.

DCP records each key's place in the nested state dict (``("model", "layers", 0, "w")``) in the
metadata's ``planner_data``, and the writers of ``convert`` rebuild the tree from those paths with torch's
``set_element``, which grows a list up to the index it is given. The paths come from the checkpoint, so
they are checked together first, each key named:

- a list index is a non-negative ``int``; the root and a dict hold ``str`` keys, and one container holds
  keys of one kind (a list index mixed with a key raised a bare ``TypeError``);
- a key is a leaf or a container, never both (a tensor under another tensor's key);
- the holes of all lists together (indices no key uses; torch's flattening leaves one only for an empty
  container it dropped) number at most the keys plus :data:`LIST_HOLE_SLACK`: a 910-byte ``.metadata``
  naming index ``2**40`` sent ``convert`` into an unbounded allocation. So the lists built hold no more
  slots than the checkpoint has keys, plus the slack.

A checkpoint opened for reading one tensor at a time, in any format the registry knows.

:class:`TensorSource` opens a URL with :func:`dcp_storage.open_reader` (so plugin formats work too), reads
its ``Metadata`` once, and then serves full tensors, one or a batch at a time: it allocates each and drives
the reader with a ``LoadPlan`` for those keys (``prepare_local_plan`` -> ``prepare_global_plan`` ->
``read_data``), exactly the calls ``dcp.load`` makes, minus re-reading the metadata for every key. Memory
held is the tensors asked for plus whatever staging the reader needs for them (a chunk, for a resharded
or cast read), never the checkpoint.

Non-tensor values (``BYTE_IO`` items: step counters, extra state) come back as the ``torch.save`` bytes
the reader hands to ``load_bytes`` (our readers check them with ``weights_only=True`` first);
:meth:`TensorSource.read_value` decodes them with ``weights_only=True`` too.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dcp_storage import registry
from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.spec import FormatSpec
from dcp_storage.opening import detect_format, reader_of
from dcp_storage.runtime import wait_for

__all__ = [
    "LIST_HOLE_SLACK",
    "READ_BATCH_BYTES",
    "SourceTensor",
    "SourceValue",
    "TensorSource",
    "byte_batches",
    "check_tree_paths",
]


LIST_HOLE_SLACK = 1024  # list slots no key uses, beyond one per key (empty containers torch dropped)

Path = tuple[Any, ...]


class _Node:
    __slots__ = ("children", "fqn")

    def __init__(self) -> None:
        self.children: dict[Any, _Node] = {}
        self.fqn: str | None = None  # set on a leaf


def _where(url: str, fqn: str) -> str:
    return f"{url}: key {fqn!r} in .metadata's planner_data"


def check_tree_paths(url: str, paths: Mapping[str, Path]) -> None:
    """Raise :class:`CorruptCheckpointError` naming the key when ``paths`` cannot form one nested state dict."""
    root = _Node()
    for fqn, path in paths.items():
        node = root
        for depth, part in enumerate(path):
            if type(part) is int:
                if depth == 0:
                    raise CorruptCheckpointError(
                        f"{_where(url, fqn)} starts with the list index {part}; a state dict's top level holds "
                        "names: the metadata is damaged or was not written by DCP"
                    )
                if part < 0:
                    raise CorruptCheckpointError(
                        f"{_where(url, fqn)} has the negative list index {part}: the metadata is damaged"
                    )
            elif type(part) is not str:
                raise CorruptCheckpointError(f"{_where(url, fqn)} has a {type(part).__name__} in its path")
            if node.fqn is not None:
                raise CorruptCheckpointError(
                    f"{_where(url, fqn)} lies under {node.fqn!r}, which is itself a stored value: the metadata "
                    "is damaged"
                )
            if node.children and type(next(iter(node.children))) is not type(part):
                other = next(iter(node.children))
                raise CorruptCheckpointError(
                    f"{_where(url, fqn)} uses {part!r} where another key uses {other!r}: one container cannot "
                    "be both a list and a dict; the metadata is damaged"
                )
            node = node.children.setdefault(part, _Node())
        if node.children or node.fqn is not None:
            raise CorruptCheckpointError(
                f"{_where(url, fqn)} names a place that also holds other keys: the metadata is damaged"
            )
        node.fqn = fqn
    _check_holes(url, root, len(paths))


def _check_holes(url: str, root: _Node, keys: int) -> None:
    allowed = keys + LIST_HOLE_SLACK
    holes = 0
    todo = [root]
    while todo:
        node = todo.pop()
        todo.extend(node.children.values())
        if node is root or not node.children or type(next(iter(node.children))) is not int:
            continue
        top = max(node.children)
        holes += top + 1 - len(node.children)
        if holes > allowed:
            leaf = node.children[top]
            while leaf.fqn is None:
                leaf = next(iter(leaf.children.values()))
            raise CorruptCheckpointError(
                f"{_where(url, leaf.fqn)} has the list index {top}, but the checkpoint has only {keys} keys: the "
                f"lists would hold more than {allowed} empty slots (one per key plus {LIST_HOLE_SLACK}); the "
                "metadata is damaged or hostile"
            )


READ_BATCH_BYTES = 16 << 20  # tensors read by one plan when a caller reads many (a larger one goes alone)
READ_BATCH_COUNT = 4096  # and at most this many: a plan's per-item bookkeeping stays small


@dataclass(frozen=True)
class SourceTensor:
    """A tensor of the source checkpoint: its flattened key, nested path, stored dtype and full shape."""

    fqn: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


S = TypeVar("S", bound=_Sized)


def byte_batches(tensors: Iterable[S], budget: int = READ_BATCH_BYTES) -> Iterator[list[S]]:
    """Consecutive groups of ``tensors`` of at most ``budget`` bytes and ``READ_BATCH_COUNT`` tensors each
    (a tensor larger than ``budget`` makes a group of its own), for :meth:`TensorSource.read_tensors`."""
    batch: list[S] = []
    size = 0
    for info in tensors:
        if batch and (size + info.nbytes > budget or len(batch) >= READ_BATCH_COUNT):
            yield batch
            batch, size = [], 0
        batch.append(info)
        size += info.nbytes
    if batch:
        yield batch


@dataclass(frozen=True)
class SourceValue:
    """A non-tensor value of the source checkpoint (stored as ``torch.save`` bytes)."""

    fqn: str
    path: Path


class _CapturePlanner(LoadPlanner):
    """The planner half of a one-key load: destinations are narrow views of one full tensor."""

    def __init__(self) -> None:
        self.dest: dict[str, torch.Tensor] = {}
        self.values: dict[str, bytes] = {}

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:  # plans are built by TensorSource
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.values[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor = self.dest[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, offset, length)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _paths(url: str, metadata: Metadata) -> dict[str, Path]:
    """Each key's nested path from ``planner_data`` (DCP's flatten mapping) where it is sound, else ``(key,)``;
    the paths together must form one tree, lists bounded (:func:`~.tree_paths.check_tree_paths`)."""
    data = metadata.planner_data
    out: dict[str, Path] = {}
    for fqn in metadata.state_dict_metadata:
        path = data.get(fqn) if isinstance(data, Mapping) else None
        ok = (
            isinstance(path, tuple)
            and path
            and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path)
            and ".".join(map(str, path)) == fqn
        )
        out[fqn] = path if ok else (fqn,)  # type: ignore[assignment]
    check_tree_paths(url, out)
    return out


class TensorSource:
    """One checkpoint, read key by key. Build with :meth:`open`; use as a context manager."""

    def __init__(self, url: str, spec: FormatSpec, reader: Any, metadata: Metadata, trust: bool = False) -> None:
        self.url = url
        self.trust = trust
        self.spec = spec
        self.reader = reader
        self.metadata = metadata
        paths = _paths(url, metadata)
        self.tensors: dict[str, SourceTensor] = {}
        self.values: dict[str, SourceValue] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                self.tensors[fqn] = SourceTensor(fqn, paths[fqn], md.properties.dtype, tuple(int(s) for s in md.size))
            elif isinstance(md, BytesStorageMetadata):
                self.values[fqn] = SourceValue(fqn, paths[fqn])
            else:
                raise CorruptCheckpointError(f"{url}: key {fqn!r} has unknown metadata {type(md).__name__}")

    @classmethod
    def open(
        cls,
        url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        format: str | None = None,
        trust: bool = False,
    ) -> TensorSource:
        """Open ``url``. ``trust``: the reader decodes the checkpoint as ``torch.load(weights_only=False)`` would
        (formats whose reader takes a ``trust`` option: the built-in ones), and so does :meth:`read_value`."""
        url = os.fspath(url)
        spec = registry.get("formats", format) if format is not None else detect_format(url, storage_options)
        options = {"trust": True} if trust else {}
        reader = reader_of(spec, url, storage_options, **options)
        metadata = reader.read_metadata()
        reader.set_up_storage_reader(metadata, True)
        return cls(url, spec, reader, metadata, trust)

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        transport = getattr(self.reader, "transport", None) or getattr(self.reader, "_transport", None)
        close = getattr(transport, "close", None)
        if callable(close):
            close()

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def _run(self, items: list[ReadItem], planner: _CapturePlanner) -> None:
        plan = self.reader.prepare_local_plan(LoadPlan(items))
        plan = self.reader.prepare_global_plan([plan])[0]
        wait_for(self.reader.read_data(plan, planner), self.reader)

    def read_tensor(self, fqn: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full tensor ``fqn`` (cast to ``dtype`` on the way in, if given), read on its own."""
        return self.read_tensors([(fqn, dtype)])[fqn]

    def read_tensors(self, wanted: Sequence[tuple[str, torch.dtype | None]]) -> dict[str, torch.Tensor]:
        """Several full tensors, each cast to its dtype if given, read by one plan.

        One plan lets the reader coalesce and overlap the requests of many small tensors (read one by one,
        each paid a round trip through the reader's thread pool: 0.3 ms a tensor). Memory: the tensors
        themselves; callers bound it by what they ask for at once.
        """
        planner = _CapturePlanner()
        items: list[ReadItem] = []
        for fqn, dtype in wanted:
            info = self.tensors[fqn]
            dest = planner.dest[fqn] = torch.empty(info.shape, dtype=dtype or info.dtype)
            if dest.numel() == 0:
                continue
            md = self.metadata.state_dict_metadata[fqn]
            full = ChunkStorageMetadata(offsets=torch.Size([0] * len(info.shape)), sizes=torch.Size(info.shape))
            mine = create_read_items_for_chunk_list(fqn, md, [full])  # type: ignore[arg-type]
            covered = sum(math.prod(int(n) for n in item.lengths) for item in mine)
            if covered != dest.numel():
                raise CorruptCheckpointError(
                    f"{self.url}: the stored chunks of {fqn!r} cover {covered} of its {dest.numel()} elements "
                    "(chunks missing from the metadata, or overlapping)"
                )
            items += mine
        if items:
            self._run(items, planner)
        return planner.dest

    def read_value_bytes(self, fqn: str) -> bytes:
        """The ``torch.save`` bytes of non-tensor value ``fqn``."""
        index = MetadataIndex(fqn)
        zero = torch.Size((0,))
        item = ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero)
        planner = _CapturePlanner()
        self._run([item], planner)
        if fqn not in planner.values:
            raise CorruptCheckpointError(f"{self.url}: the reader delivered no bytes for value {fqn!r}")
        return planner.values[fqn]

    def read_value(self, fqn: str) -> Any:
        """Non-tensor value ``fqn``, decoded with ``torch.load(weights_only=True)`` (never runs code), or for a
        trusted source with ``weights_only=False``."""
        from dcp_storage.formats.dcp_native.torch_record import load_tensor_record  # maps refusals to our errors

        data = self.read_value_bytes(fqn)
        if self.trust:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        return load_tensor_record(data, f"{self.url} (value {fqn!r})")
