"""A ``torch.save`` file as a DCP checkpoint: its index, its tensors, its ``Metadata``.

:meth:`TorchSaveArchive.open` reads, with ranged reads through the transport, only the zip's end records
and central directory, ``byteorder`` and ``data.pkl`` (decoded with the allow-list of
:mod:`.pickle_tree`). The result knows every tensor's dtype, shape, stride and record, and every non-tensor
value, without having read any tensor data. From that it builds DCP ``Metadata`` (one full-size chunk per
tensor, ``BytesStorageMetadata`` for other values, keys flattened as DCP flattens state dicts) and tells
:func:`~dcp_storage.formats.reading.plan_slice_read` where each tensor's elements lie.
"""

from __future__ import annotations

import dataclasses
import io
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage._torch import traverse_for_current_version
from dcp_storage.errors import CorruptCheckpointError, DcpStorageError
from dcp_storage.formats.paths import BROADCAST_BYTES
from dcp_storage.formats.reading import StoredTensor, plan_slice_read, read_slices
from dcp_storage.formats.slices import is_row_major
from dcp_storage.formats.torch_save.pickle_tree import (
    LegacyNeedsMoreBytes,
    TensorDescriptor,
    decode_data_pkl,
    is_legacy_head,
    scan_legacy,
)
from dcp_storage.formats.torch_save.zip_index import (
    STORED,
    NotAZipError,
    ZipIndex,
    data_starts,
    read_entry,
    read_zip_index,
)
from dcp_storage.formats.torch_save.zip_layout import check_crc
from dcp_storage.runtime import writable_bytes
from dcp_storage.transports import Transport

__all__ = ["TorchSaveArchiveConfig", "TorchSaveArchive", "UnsupportedFormatError", "flatten_tree"]

MiB = 1024 * 1024


class UnsupportedFormatError(DcpStorageError, ValueError):
    """A valid file in a layout this reader does not read (legacy ``torch.save``, big-endian, compressed)."""


@dataclass(frozen=True)
class TorchSaveArchiveConfig:
    """Limits on what :meth:`TorchSaveArchive.open` reads before any tensor data."""

    max_pickle_bytes: int = 512 * MiB  # data.pkl larger than this is refused
    legacy_scan_bytes: int = 64 * MiB  # how much of a legacy-format file is vetted for unsafe globals

    def __post_init__(self) -> None:
        if self.max_pickle_bytes < 1 or self.legacy_scan_bytes < 1:
            raise ValueError("TorchSaveArchiveConfig limits must be positive")


class TorchSaveArchive:
    """One indexed ``torch.save`` archive. Build with :meth:`open`; tensors are read on request."""

    def __init__(
        self,
        transport: Transport,
        index: ZipIndex,
        prefix: str,
        tree: Mapping[str, Any],
        flat: dict[str, Any],
        mappings: dict[str, tuple[str | int, ...]],
        storages: dict[str, int],
    ) -> None:
        self.transport = transport
        self.index = index
        self.prefix = prefix
        self.tree = tree
        self.flat = flat
        self.mappings = mappings
        self.storages = storages  # storage key -> bytes, for every tensor anywhere in the tree
        self.tensors = {k: v for k, v in flat.items() if isinstance(v, TensorDescriptor)}
        self._starts: dict[str, int] | None = None
        self._value_reads: dict[str, int] = {}  # value key -> storage bytes its tensors read (see value_bytes)

    # ------------------------------------------------------------------------------------- opening
    @classmethod
    def open(
        cls, transport: Transport, path: str, config: TorchSaveArchiveConfig | None = None, *, trust: bool = False
    ) -> TorchSaveArchive:
        """Index the archive at ``path``; raises our errors, each naming the file, for anything else.

        ``trust``: decode ``data.pkl`` as ``torch.load(weights_only=False)`` would (see :mod:`.pickle_tree`).
        """
        config = config or TorchSaveArchiveConfig()
        try:
            index = read_zip_index(transport, path)
        except NotAZipError as exc:
            _refuse_not_zip(transport, path, exc, config, trust)
            raise  # unreachable: _refuse_not_zip always raises
        url = index.url
        prefix = _archive_prefix(index)
        order_name = prefix + "byteorder"
        if order_name in index.entries:
            order = read_entry(transport, index, order_name, 64)
            if order != b"little":
                raise UnsupportedFormatError(f"{url}: byte order {order!r}: only little-endian archives are supported")
        pkl = read_entry(transport, index, prefix + "data.pkl", config.max_pickle_bytes)
        tree, storages = decode_data_pkl(pkl, f"{url} (data.pkl)", trust=trust)
        if not isinstance(tree, Mapping):
            raise UnsupportedFormatError(
                f"{url}: the file holds a {type(tree).__name__}, not a state dict; only dicts of tensors and "
                "values can be loaded through DCP"
            )
        for key, nbytes in storages.items():
            name = f"{prefix}data/{key}"
            entry = index.entries.get(name)
            if entry is None:
                raise CorruptCheckpointError(
                    f"{url}: data.pkl refers to storage {key!r} but record {name!r} is missing"
                )
            if entry.method != STORED:
                raise UnsupportedFormatError(
                    f"{url}: storage record {name!r} is compressed; it cannot be read by ranges"
                )
            if entry.size < nbytes:
                raise CorruptCheckpointError(
                    f"{url}: storage record {name!r} holds {entry.size} bytes, data.pkl needs {nbytes}"
                )
        flat, mappings = flatten_tree(tree, url)
        _check_repeats(flat, url)
        return cls(transport, index, prefix, tree, flat, mappings, storages)

    @property
    def url(self) -> str:
        return self.index.url

    # ------------------------------------------------------------------------------------- metadata
    def metadata(self) -> Metadata:
        """DCP ``Metadata``: one full chunk per tensor, ``BytesStorageMetadata`` for other values."""
        md: dict[str, Any] = {}
        for fqn, value in self.flat.items():
            if isinstance(value, TensorDescriptor):
                shape = torch.Size(value.shape)
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)
                md[fqn] = TensorStorageMetadata(TensorProperties(dtype=value.dtype), shape, [chunk])
            else:
                md[fqn] = BytesStorageMetadata()
        meta = StorageMeta(checkpoint_id=self.url, load_id=uuid.uuid4().hex)
        return Metadata(state_dict_metadata=md, planner_data=dict(self.mappings), storage_meta=meta)

    @property
    def tensor_bytes(self) -> int:
        return sum(d.nbytes for d in self.tensors.values())

    # ------------------------------------------------------------------------------------- tensors
    def _data_starts(self) -> dict[str, int]:
        if self._starts is None:
            names = {f"{self.prefix}data/{k}": k for k in self.storages}
            # Headers lie between tensors: with an object store's coalescing gap, fetching them together
            # would read the small tensors between them too. Read them exactly (same counters, same store).
            exact = self.transport.reconfigured(dataclasses.replace(self.transport.config, coalesce_gap=0))
            try:
                starts = data_starts(exact, self.index, names)
            finally:
                exact.close()
            self._starts = {names[n]: s for n, s in starts.items()}
        return self._starts

    def stored(self, fqn: str) -> StoredTensor:
        """Where tensor ``fqn``'s elements lie in the file, for :func:`plan_slice_read`."""
        desc = self.tensors[fqn]
        return StoredTensor(
            self.index.path,
            self._data_starts()[desc.storage_key],
            desc.dtype,
            desc.shape,
            desc.stride,
            desc.storage_offset,
            where=f"{self.url} (tensor {fqn!r})",
        )

    def crc_check(
        self, fqn: str, offsets: Sequence[int], lengths: Sequence[int]
    ) -> Callable[[torch.Tensor], None] | None:
        """A check of the zip CRC32 of tensor ``fqn``'s storage record, for a read of the slice
        ``offsets``/``lengths`` that brings in exactly that record's bytes (a whole tensor that is its whole
        storage, row-major); ``None`` for any other read, whose bytes the CRC does not cover."""
        return self._crc_check(self.tensors[fqn], offsets, lengths, f"{self.url} (tensor {fqn!r})")

    def _crc_check(
        self, desc: TensorDescriptor, offsets: Sequence[int], lengths: Sequence[int], where: str
    ) -> Callable[[torch.Tensor], None] | None:
        entry = self.index.entries[f"{self.prefix}data/{desc.storage_key}"]
        whole = (
            desc.storage_offset == 0
            and desc.nbytes == entry.size > 0
            and is_row_major(desc.shape, desc.stride)
            and all(int(o) == 0 for o in offsets)
            and tuple(int(n) for n in lengths) == tuple(desc.shape)
        )
        if not whole:
            return None

        def check(landed: torch.Tensor) -> None:
            check_crc(writable_bytes(landed), entry, where)

        return check

    def file_order(self) -> list[str]:
        """Tensor keys in the order their bytes lie in the file (sequential reads)."""
        starts = self._data_starts()
        return sorted(self.tensors, key=lambda k: (starts[self.tensors[k].storage_key], self.tensors[k].storage_offset))

    def read_tensor(self, desc: TensorDescriptor, where: str = "") -> torch.Tensor:
        """Read one whole tensor (for tensors nested inside non-tensor values)."""
        starts = self._data_starts()
        stored = StoredTensor(
            self.index.path,
            starts[desc.storage_key],
            desc.dtype,
            desc.shape,
            desc.stride,
            desc.storage_offset,
            where or self.url,
        )
        dest = torch.empty(desc.shape, dtype=desc.dtype)
        work = plan_slice_read(None, stored, [0] * len(desc.shape), desc.shape, dest)
        work.check = self._crc_check(desc, [0] * len(desc.shape), desc.shape, where or self.url)
        read_slices(self.transport, [work], lambda _w: None)
        return dest

    def value_bytes(self, fqn: str) -> bytes:
        """The non-tensor value ``fqn`` as ``torch.save`` bytes (what DCP's ``load_bytes`` expects).

        The value was decoded by the allow-list (or, for a trusted file, as pickle decodes it); tensors nested
        in it, also in the attributes of objects, are read whole first.
        """
        storages: dict[str, torch.Tensor] = {}
        value = self._materialize(self.flat[fqn], fqn, storages)
        self._value_reads[fqn] = sum(t.numel() for t in storages.values())
        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue()

    def _materialize(self, value: Any, fqn: str, storages: dict[str, torch.Tensor]) -> Any:
        """``value`` with its tensors read: each storage once (``storages``, by key), every tensor a view of
        it, as ``torch.load`` gives. A value may name one storage any number of times for a few bytes of
        pickle each; reading it per tensor would cost the storage's size each time."""
        if isinstance(value, TensorDescriptor):
            return self._view(value, fqn, storages)
        if isinstance(value, dict):
            out = type(value)() if type(value) is not dict else {}
            for k, v in value.items():
                out[k] = self._materialize(v, fqn, storages)
            return out
        if isinstance(value, list):
            return [self._materialize(v, fqn, storages) for v in value]
        if isinstance(value, tuple) and not isinstance(value, torch.Size):
            return tuple(self._materialize(v, fqn, storages) for v in value)
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(value, type):  # an argparse.Namespace, a config object
            for name, v in list(attrs.items()):
                attrs[name] = self._materialize(v, fqn, storages)
        return value

    def _check_value_budget(self, fqn: str, nbytes: int) -> None:
        """Values may read, together, the file's storages once plus :data:`BROADCAST_BYTES`.

        Each value is saved with its own copy of every storage it names, so N values naming one storage
        (a few bytes of pickle each) would read and hold N copies: the same repetition a broadcast view
        makes, bounded by the same limit."""
        others = sum(n for key, n in self._value_reads.items() if key != fqn)
        stored = sum(self.storages.values())
        cap = BROADCAST_BYTES.bytes
        if others + nbytes > stored + cap:
            raise CorruptCheckpointError(
                f"{self.url}: the tensors of value {fqn!r} and of the values before it repeat the file's "
                f"{stored} stored bytes into {others + nbytes} bytes, more than {cap} bytes beyond what is stored "
                f"(many values naming the same storage); refusing to expand them. If it is genuine, set "
                f"{BROADCAST_BYTES.env} to a larger number of bytes"
            )

    def _view(self, desc: TensorDescriptor, fqn: str, storages: dict[str, torch.Tensor]) -> torch.Tensor:
        """Tensor ``desc`` as a view of its storage, read whole (and CRC-checked) the first time it is named."""
        base = storages.get(desc.storage_key)
        if base is None:
            where = f"{self.url} (storage {desc.storage_key!r} of a tensor in {fqn!r})"
            nbytes = desc.storage_nbytes
            self._check_value_budget(fqn, nbytes + sum(t.numel() for t in storages.values()))
            base = torch.empty(nbytes, dtype=torch.uint8)
            stored = StoredTensor(
                self.index.path, self._data_starts()[desc.storage_key], torch.uint8, (nbytes,), (1,), 0, where
            )
            work = plan_slice_read(None, stored, [0], [nbytes], base)
            entry = self.index.entries[f"{self.prefix}data/{desc.storage_key}"]
            if nbytes == entry.size > 0:  # torch.save's records are exactly their storage: checked always
                work.check = lambda landed: check_crc(writable_bytes(landed), entry, where)
            read_slices(self.transport, [work], lambda _w: None)
            storages[desc.storage_key] = base
        view = torch.empty(0, dtype=desc.dtype)
        return view.set_(base.untyped_storage(), desc.storage_offset, desc.shape, desc.stride)


def _check_repeats(flat: Mapping[str, Any], url: str) -> None:
    """The broadcast views of a file together may repeat stored bytes by :data:`BROADCAST_BYTES`, as one may.

    Each view was checked alone (:func:`~..limits.check_view`); N of them, a few bytes of pickle each, would
    otherwise make ``convert`` write and ``verify --deep`` read N times the limit. Views that repeat nothing
    (tied weights: full views of one storage) count nothing."""
    cap = BROADCAST_BYTES.bytes
    total = 0
    for fqn, desc in flat.items():
        if isinstance(desc, TensorDescriptor) and desc.nbytes > desc.storage_nbytes:
            total += desc.nbytes - desc.storage_nbytes
            if total > cap:
                raise CorruptCheckpointError(
                    f"{url}: its broadcast (overlapping) views, up to tensor {fqn!r}, repeat their stored bytes "
                    f"into {total} bytes more than is stored, more than {cap} bytes; refusing to expand them. If "
                    f"it is genuine, set {BROADCAST_BYTES.env} to a larger number of bytes"
                )


def flatten_tree(tree: Mapping[str, Any], url: str = "") -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]]:
    """Flatten like DCP's ``flatten_state_dict``, treating :class:`TensorDescriptor` leaves as tensors.

    Keys are the object paths joined by dots; lists holding tensors or mappings are traversed, other
    values (tuples, lists of plain values, scalars) are leaves.
    """
    flat: dict[str, Any] = {}
    mappings: dict[str, tuple[str | int, ...]] = {}

    def visit(path: tuple[str | int, ...], value: Any) -> None:
        fqn = ".".join(map(str, path))
        if fqn in flat:
            raise UnsupportedFormatError(f"{url}: two values flatten to the same key {fqn!r}")
        flat[fqn] = value
        mappings[fqn] = path

    traverse = traverse_for_current_version()
    traverse(tree, visit, keep_traversing=lambda v: isinstance(v, TensorDescriptor))  # type: ignore[arg-type]
    return flat, mappings


def _archive_prefix(index: ZipIndex) -> str:
    """The archive's top directory (torch names it after the file), found through its ``data.pkl``."""
    candidates = [n[: -len("data.pkl")] for n in index.entries if n.endswith("/data.pkl") and n.count("/") == 1]
    if "data.pkl" in index.entries:
        candidates.append("")
    if not candidates:
        raise CorruptCheckpointError(f"{index.url}: a zip archive without a top-level data.pkl: not a torch.save file")
    if len(candidates) > 1:
        first = next(iter(index.entries))  # torch reads the archive named by the first record
        top = first.split("/", 1)[0] + "/" if "/" in first else ""
        if top in candidates:
            return top
    return candidates[0]


def _scan_legacy_file(transport: Transport, path: str, url: str, config: TorchSaveArchiveConfig) -> None:
    """Refuse a legacy file whose pickles name a forbidden global (else it is refused as unsupported)."""
    size = transport.size(path)
    n = min(size, 1 * MiB)
    while True:
        prefix = bytes(transport.read_range(path, 0, n))
        try:
            scan_legacy(prefix, url, complete=n >= size)
        except LegacyNeedsMoreBytes:
            if n >= min(size, config.legacy_scan_bytes):
                return
            n = min(size, 4 * n, config.legacy_scan_bytes)
            continue
        return


def _refuse_not_zip(
    transport: Transport, path: str, exc: NotAZipError, config: TorchSaveArchiveConfig, trust: bool
) -> None:
    """Raise the most useful error for a file without a zip end record (for a trusted one, never "unsafe")."""
    url = transport.url(path)
    if not exc.head:
        raise CorruptCheckpointError(str(exc)) from None
    if is_legacy_head(exc.head):
        if not trust:
            _scan_legacy_file(transport, path, url, config)
        raise UnsupportedFormatError(
            f"{url}: legacy torch.save format (saved with _use_new_zipfile_serialization=False or torch < 1.6) is "
            "not supported: its tensors cannot be located without reading the whole file. Re-save it in the "
            "default zip format: torch.save(torch.load(path, weights_only=True), new_path)"
        )
    if exc.head.startswith(b"PK\x03\x04"):
        raise CorruptCheckpointError(
            f"{url}: starts like a zip archive but has no end-of-central-directory record: the file is truncated "
            "(an interrupted save, upload or copy?)"
        ) from None
    raise CorruptCheckpointError(
        f"{url}: not a torch.save archive (no zip end record; first bytes {exc.head[:16]!r}); the file is corrupt "
        "or in another format"
    ) from None


# the names before 0.2 (one scheme for the exported configs: the format, then what it configures)
