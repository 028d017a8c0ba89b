"""The reader a format plugin gets for free: tensors stored as raw elements at known byte offsets.

Many formats keep each tensor as its raw elements, one after the other, somewhere in a file: safetensors,
an uncompressed ``.npz`` member, a GGUF tensor, a raw dump with a JSON index. For such a format the plugin
writes only the part that knows the layout, a *scan*: given the transport and the checkpoint's path, it
reads the format's headers (with ranged reads of its own) and says where each tensor lies, as
:class:`RawTensor` rows. :class:`RawTensorReader` does the rest, the same way the built-in readers do:

* ``read_metadata``: the coordinator runs the scan, checks every row (unique keys, relative file names
  that stay under the checkpoint, every tensor's bytes inside its file) and shares the ``Metadata`` with
  every rank (:func:`~dcp_storage.strategies.collectives.share_object`): the headers are read once per
  load, not once per rank.
* ``prepare_local_plan`` / ``prepare_global_plan``: the read strategy's (``per_rank``, ``read_once``,
  ``per_host`` or a plugin's: :mod:`dcp_storage.strategies.read_strategy`).
* ``read_data``: each planned slice becomes the byte runs it needs (one for a ``Shard(0)`` slice, one per
  row for ``Shard(1)``), coalesced and fetched concurrently by the transport, straight into the
  destination tensor where it can (:mod:`dcp_storage.formats.reading`): a rank reads the bytes of its
  slices, not whole tensors.

Bytes stored in the other byte order (``byte_order="big"`` on a little-endian host, say) land in a
staging buffer and are swapped before they reach the destination. Nothing is ever unpickled.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.location import LoadingLocation
from dcp_storage.formats.paths import check_relative
from dcp_storage.formats.reading import SliceRead, StoredTensor, dense_gap_of, plan_slice_read, read_slices
from dcp_storage.planners.planner import check_planned_keys
from dcp_storage.strategies.collectives import reader_location, running_planner, share_object
from dcp_storage.strategies.read_strategy import MetadataItems, ReadStrategy, StrategyReading
from dcp_storage.transports import Transport, TransportConfig

__all__ = ["RawTensor", "RawTensorReader", "Scan"]

_BYTE_ORDERS = ("little", "big")


@dataclass(frozen=True)
class RawTensor:
    """Where one tensor's elements lie: element ``i`` (in ``stride`` order) at byte ``offset + i * itemsize``.

    Args:
        key: the state-dict key (``"layer.0.weight"``).
        offset: the byte offset of its first element in ``file``.
        dtype: the torch dtype of its elements (map the format's own dtype names onto torch's in the scan).
        shape: its shape; ``()`` for a scalar.
        file: ``""``: the file the reader was opened on (a single-file format); otherwise a path relative to
            the location the reader was opened on (a directory format), which must stay under it.
        byte_order: ``"little"`` or ``"big"``; bytes not in the host's order are swapped on load.
        stride: its strides in elements (``None``: row-major, C order). A column-major (Fortran order)
            tensor of shape ``(a, b)`` has stride ``(1, a)``; its slices are read as their bounding range.
    """

    key: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str = ""
    byte_order: str = "little"
    stride: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def extent(self) -> int:
        """Bytes from the first element to the end of the last (0 for an empty tensor)."""
        if math.prod(self.shape) == 0:
            return 0
        stride = self.stride if self.stride is not None else _row_major(self.shape)
        return (sum((n - 1) * s for n, s in zip(self.shape, stride)) + 1) * self.dtype.itemsize


#: A format's scan: ``scan(transport, path)`` -> every tensor of the checkpoint at ``path`` (its own
#: headers read through ``transport``; raise a :class:`~dcp_storage.errors.DcpStorageError` naming the file,
#: the key and the fix for what is wrong). It runs on the coordinator only; it must be picklable (a module
#: level function) for the reader to be.
Scan = Callable[[Transport, str], Sequence[RawTensor]]


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))


class RawTensorReader(LoadingLocation, StorageReader):
    """A DCP ``StorageReader`` for any format whose tensors are raw elements at known offsets (module docstring).

    A format plugin's ``open_reader`` factory returns ``RawTensorReader(url, scan, storage_options, ...)``;
    ``dcp.load(state_dict, storage_reader=...)`` then loads any state dict (plain tensors, or DTensors sharded
    any way) reading only the bytes each rank's slices need.

    Args:
        path: the checkpoint (a file or a directory; a local path or any URL a transport serves).
        scan: the format's :data:`Scan`.
        storage_options: for the transport (credentials, endpoint, ``"read_strategy"``).
        format_name: how errors name the format (``"npz"``).
        transport_config: concurrency, coalescing, in-flight and retry settings.
        transport: an existing transport to share (its counters then add up across readers).
        read_strategy: who fetches bytes that several ranks need (a :class:`ReadStrategy` or its name; default:
            ``per_rank`` on a local disk, ``read_once`` on an object store).
        process_group: the group whose coordinator scans and shares the metadata (``None``: ``dcp.load``'s).
        coordinator_rank: the rank, within ``process_group``, that scans.
        staging_bytes: the most staging memory held at once (slices that cannot land in their destination).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        scan: Scan,
        storage_options: dict[str, Any] | None = None,
        *,
        format_name: str = "raw",
        transport_config: TransportConfig | None = None,
        transport: Transport | None = None,
        read_strategy: ReadStrategy | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        coordinator_rank: int = 0,
        staging_bytes: int = 256 << 20,
    ) -> None:
        super().__init__()
        if coordinator_rank < 0 or staging_bytes < 1:
            raise ValueError(
                f"coordinator_rank must be >= 0 and staging_bytes >= 1, got {coordinator_rank}, {staging_bytes}"
            )
        self.scan = scan
        self.format_name = format_name
        self.storage_options = dict(storage_options or {})
        self._reading = StrategyReading(read_strategy, self.storage_options)  # takes the storage option out
        self.transport_config = transport_config
        self._given_transport = transport
        self.process_group = process_group
        self.coordinator_rank = coordinator_rank
        self.staging_bytes = staging_bytes
        self.storage_data: dict[MetadataIndex, RawTensor] = {}
        self._open_load(path)

    def _open(self, url: str | os.PathLike[str]) -> None:
        super()._open(url)
        self._reading.choose(self.transport.is_local)

    @property
    def read_strategy(self) -> ReadStrategy:
        return self._reading.strategy

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self._reading.reset()
        self._next_load(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # which format a URL holds is the plugin's sniffer's to say (open_reader), not torch's

    # ---------------------------------------------------------------------------------------- metadata
    def _file(self, row: RawTensor) -> str:
        """The transport path of ``row``'s file: the reader's path, or a checked relative name under it."""
        if row.file == "":
            return self.root
        return self.transport.join(self.root, check_relative(row.file, self.transport.url(self.root)))

    def _build(self) -> Metadata:
        """Run the scan and check its rows (coordinator): the ``Metadata`` every rank loads by."""
        rows = list(self.scan(self.transport, self.root))
        sizes: dict[str, int] = {}
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, RawTensor] = {}
        for row in rows:
            path = self._file(row)
            where = f"{self.transport.url(path)} (tensor {row.key!r})"
            self._check_row(row, where)
            if row.key in state:
                raise CorruptCheckpointError(f"{where}: the {self.format_name} checkpoint holds this key twice")
            if path not in sizes:
                sizes[path] = self.transport.size(path)
            end = row.offset + row.extent()
            if end > sizes[path]:
                raise CorruptCheckpointError(
                    f"{where}: its {row.dtype} {list(row.shape)} elements end at byte {end}, past the end of the "
                    f"{sizes[path]}-byte file: the file is truncated or its {self.format_name} header is wrong"
                )
            size = torch.Size(row.shape)
            zeros = torch.Size([0] * len(row.shape))
            state[row.key] = TensorStorageMetadata(
                TensorProperties(dtype=row.dtype), size, [ChunkStorageMetadata(zeros, size)]
            )
            storage[MetadataIndex(row.key, zeros)] = row
        return Metadata(state_dict_metadata=state, storage_data=storage)

    def _check_row(self, row: RawTensor, where: str) -> None:
        """A scan's row must describe a tensor that can exist; the scan read its numbers from the checkpoint."""
        problem = None
        if not isinstance(row.key, str) or not row.key:
            problem = f"key {row.key!r} is not a non-empty string"
        elif not isinstance(row.dtype, torch.dtype):
            problem = f"dtype {row.dtype!r} is not a torch.dtype"
        elif not isinstance(row.offset, int) or row.offset < 0:
            problem = f"offset {row.offset!r} is not a byte offset"
        elif not all(isinstance(n, int) and n >= 0 for n in row.shape):
            problem = f"shape {list(row.shape)!r} is not a list of sizes"
        elif row.stride is not None and (
            len(row.stride) != len(row.shape) or not all(isinstance(s, int) and s >= 0 for s in row.stride)
        ):
            problem = f"stride {row.stride!r} does not fit shape {list(row.shape)}"
        elif row.byte_order not in _BYTE_ORDERS:
            problem = f"byte order {row.byte_order!r} is not one of {_BYTE_ORDERS}"
        if problem is not None:
            raise CorruptCheckpointError(f"{where}: {problem} (from the {self.format_name} scan)")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            return None  # type: ignore[return-value]  # no per-rank metadata: torch then reports the global failure
        metadata = share_object(
            self._build,
            group=self.process_group,
            src_rank=self.coordinator_rank,
            location=reader_location(self),
            kind=type(self).__name__,
        )
        return self._stamp_load(metadata)  # a scan's Metadata carries no storage_meta of its own

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        check_planned_keys(running_planner(), metadata)
        self.storage_data = dict(metadata.storage_data or {})
        self.is_coordinator = is_coordinator
        self._reading.set_up(MetadataItems(metadata))  # raw elements: any row block can be fetched alone

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self._reading.local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self._reading.global_plan(plans)

    # -------------------------------------------------------------------------------------------- data
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return self._reading.read(plan, planner, self._load)

    def _load(self, items: Sequence[ReadItem], planner: LoadPlanner) -> None:
        """Fetch exactly the bytes of ``items`` and deliver them (the strategy's ``read_items``)."""
        works: list[SliceRead] = []
        swapped: dict[int, torch.Tensor] = {}  # id(work) -> the real destination, for bytes in the other order
        local = self.transport.is_local
        for item in items:
            row = self.storage_data.get(item.storage_index)
            if item.type != LoadItemType.TENSOR or row is None:
                raise CorruptCheckpointError(
                    f"{self.transport.url(self.root)}: the plan reads {item.storage_index.fqn!r} as "
                    f"{item.type.name.lower()}, but the {self.format_name} checkpoint has no such tensor"
                )
            path = self._file(row)
            stride = row.stride if row.stride is not None else _row_major(row.shape)
            where = f"{self.transport.url(path)} (tensor {row.key!r})"
            stored = StoredTensor(path, row.offset, row.dtype, tuple(row.shape), tuple(stride), 0, where)
            dest = planner.resolve_tensor(item).detach()
            native = row.byte_order == sys.byteorder or row.dtype.itemsize == 1
            landing = dest if native else torch.empty(tuple(dest.shape), dtype=row.dtype)
            work = plan_slice_read(
                item,
                stored,
                item.storage_offsets,
                item.lengths,
                landing,
                map_runs_above=16 if local else None,
                dense_gap=dense_gap_of(self.transport),
            )
            if not native:
                swapped[id(work)] = dest
            works.append(work)

        def commit(work: SliceRead) -> None:
            dest = swapped.pop(id(work), None)
            if dest is not None:
                dest.copy_(_swap_bytes(work.dest))
                work.dest = dest
            planner.commit_tensor(work.key, work.dest)  # type: ignore[arg-type]

        read_slices(self.transport, works, commit, self.staging_bytes)


def _swap_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous, CPU) with the bytes of each element reversed."""
    size = tensor.element_size()
    raw = tensor.reshape(-1).view(torch.uint8).view(-1, size).flip(-1).contiguous()
    return raw.view(tensor.dtype).view(tensor.shape)
