"""The ``torch.save`` format's spec: ``inspect``, ``verify`` and ``convert`` output (the zip built record by record).

Streaming ``torch.save`` output: the zip built record by record, one tensor in memory at a time.

``torch.save`` pickles the whole object first and then writes every storage, so it needs every tensor in
memory at once. Here ``data.pkl`` is pickled from the metadata alone: each tensor is a placeholder that
pickles exactly as torch pickles a plain tensor (``torch._utils._rebuild_tensor_v2`` over a persistent
``("storage", torch.FloatStorage, key, "cpu", numel)``, or ``_rebuild_tensor_v3`` over an
``UntypedStorage`` for the dtypes torch saves that way). The archive is then written by torch's own zip
writer (``torch._C.PyTorchFileWriter``, the one ``torch.save`` uses: same records, 64-byte alignment,
CRC32s): ``data.pkl``, the version and byte-order records, then ``data/0``, ``data/1``... each read from
the source just before it is written. ``torch.load(weights_only=True)`` loads the result.

Directory outputs with several shards follow ``save_pretrained``'s names (``pytorch_model-00001-of-00002.bin``
+ ``pytorch_model.bin.index.json``); shards hold flat dicts of tensors, as Hugging Face's do.

``inspect`` for ``torch.save`` files: every tensor with the byte range of its elements in its zip record
(from the central directory and ``data.pkl``; no storage is read).

``verify`` for ``torch.save`` files.

Shallow: zip end records and central directory, ``data.pkl`` decodable by the allow-list, every storage
record present, uncompressed, large enough and inside the file. Deep: the zip CRC32 of every stored record
(written by torch's zip writer), each read in pieces of bounded size.

Format registration for single ``torch.save`` files (``pytorch_model.bin``, ``model.pt``).

Read-only: loads go through :class:`~dcp_storage.BroadcastingTorchSaveReader` and need a planner that
builds metadata from the state dict (``dcp_storage.DynamicMetaLoadPlanner``), as torch's reader does.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import posixpath
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dcp_storage._torch import legacy_storage_type, set_element, tensor_rebuilders, zip_writer
from dcp_storage.errors import CheckpointExistsError, NonTensorStateError
from dcp_storage.formats.reports import (
    CheckpointInfo,
    ChunkInfo,
    FileInfo,
    TensorInfo,
    ValueInfo,
    VerifyReport,
    dtype_name,
    error_text,
)
from dcp_storage.formats.safetensors.convert_out import hf_index_json, pack_by_bytes, shard_size
from dcp_storage.formats.spec import (
    ConvertTarget,
    Fetch,
    FormatSpec,
    OutTensor,
    OutValue,
    Probe,
    WriteDestination,
    WriteOptions,
)
from dcp_storage.formats.torch_save.archive import TorchSaveArchive
from dcp_storage.formats.torch_save.pickle_tree import TensorDescriptor
from dcp_storage.formats.torch_save.zip_index import STORED, data_starts, read_zip_index
from dcp_storage.integrity.checksums import crc32, mismatch
from dcp_storage.runtime import held_interrupts
from dcp_storage.transports import open_transport
from dcp_storage.transports.access import make_output_root

__all__ = [
    "FORMAT",
    "TARGET",
    "build_tree",
    "check_torch_save",
    "deep_check_torch_save",
    "describe_torch_save",
    "looks_like_legacy_torch_pickle",
    "looks_like_torch_zip",
    "write_torch_save",
]


PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL
STORAGE_ALIGNMENT = 64


class _Storage:
    """A storage to be written as ``data/<key>``; pickled as torch's persistent id."""

    __slots__ = ("key", "load", "numel", "storage_type")

    def __init__(self, key: str, numel: int, storage_type: Any, load: Callable[[], torch.Tensor]) -> None:
        self.key, self.numel, self.storage_type, self.load = key, numel, storage_type, load


class TensorRef:
    """A tensor in the tree to pickle, read later by ``load``."""

    __slots__ = ("dtype", "load", "shape")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], load: Callable[[], torch.Tensor]) -> None:
        self.dtype, self.shape, self.load = dtype, tuple(shape), load


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class _Pickler(pickle.Pickler):
    """torch's pickling of a state dict, with :class:`TensorRef` (and real tensors) standing for tensors."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.storages: list[_Storage] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
            tensor = obj.detach().cpu().contiguous()
            obj = TensorRef(tensor.dtype, tuple(tensor.shape), lambda t=tensor: t)
        if not isinstance(obj, TensorRef):
            return NotImplemented
        key = str(len(self.storages))
        numel = 1
        for s in obj.shape:
            numel *= s
        legacy = legacy_storage_type(obj.dtype)
        hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        if legacy is not None:
            storage = _Storage(key, numel, legacy, obj.load)
            args: tuple[Any, ...] = (storage, 0, obj.shape, _contiguous_stride(obj.shape), False, hooks)
            rebuild = tensor_rebuilders()[0]
        else:
            storage = _Storage(key, numel * obj.dtype.itemsize, torch.UntypedStorage, obj.load)
            args = (storage, 0, obj.shape, _contiguous_stride(obj.shape), False, hooks, obj.dtype)
            rebuild = tensor_rebuilders()[1]
        self.storages.append(storage)
        return rebuild, args


class _Detachable:
    """The output stream as torch's zip writer sees it, cut off once the archive is given up.

    ``PyTorchFileWriter`` writes its end records when it is freed if ``write_end_of_file`` was never
    called. After a failure the output stream is abandoned (closed), and a write into it from the
    writer's destructor is a C++ exception there: ``std::terminate``, the process killed by SIGABRT,
    whenever the writer happens to be freed. Detached, writes are dropped.
    """

    def __init__(self, stream: Any) -> None:
        self._stream: Any = stream

    def write(self, data: Any) -> int:
        if self._stream is None:
            return memoryview(data).nbytes
        return self._stream.write(data)

    def flush(self) -> None:
        if self._stream is not None:
            self._stream.flush()

    def detach(self) -> None:
        self._stream = None


def write_archive(stream: Any, tree: Any, on_tensor: Callable[[int], None] | None = None) -> None:
    """Write ``tree`` (a dict whose tensors may be :class:`TensorRef`) to ``stream`` as ``torch.save`` does."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(tree)
    data = buf.getvalue()
    out = _Detachable(stream)
    zf = zip_writer(out, STORAGE_ALIGNMENT)
    try:
        _write_records(zf, data, pickler.storages, on_tensor)
    except BaseException:
        out.detach()  # the caller abandons ``stream``; the writer, freed later, must not touch it
        # Finish the archive now, into the detached stream: after a failed write (a full disk) the writer's
        # position checks fail, and raised from its destructor that was std::terminate (SIGABRT). torch
        # marks the writer finished even when this raises, so the destructor then writes nothing.
        with contextlib.suppress(Exception), held_interrupts():
            zf.write_end_of_file()
        del zf
        raise


def _write_records(zf: Any, data: bytes, storages: list[_Storage], on_tensor: Callable[[int], None] | None) -> None:
    """The records, each written by the C++ writer with Ctrl-C held (:mod:`dcp_storage.runtime`): it calls
    the stream's Python ``write``, and an interrupt raised there aborted the process."""
    with held_interrupts():
        zf.write_record("data.pkl", data, len(data))
        zf.write_record(".format_version", "1", 1)
        zf.write_record(".storage_alignment", str(STORAGE_ALIGNMENT), len(str(STORAGE_ALIGNMENT)))
        zf.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    for storage in storages:
        tensor = storage.load().contiguous()
        untyped = tensor.untyped_storage()
        nbytes = tensor.numel() * tensor.element_size()
        if untyped.nbytes() != nbytes or tensor.storage_offset() != 0:
            tensor = tensor.clone()
            untyped = tensor.untyped_storage()
        with held_interrupts():
            zf.write_record(f"data/{storage.key}", untyped, nbytes)
        del tensor, untyped
        if on_tensor is not None:
            on_tensor(nbytes)
    with held_interrupts():
        zf.write_end_of_file()


def build_tree(tensors: Sequence[OutTensor], values: Sequence[OutValue], fetch: Fetch) -> dict[str, Any]:
    """The nested state dict to pickle: tensors as :class:`TensorRef` placeholders, values decoded."""
    tree: dict[str, Any] = {}
    entries: list[OutTensor | OutValue] = sorted([*values, *tensors], key=lambda e: e.order)
    for e in entries:  # source order: the same data.pkl torch.save writes for the loaded state dict
        if isinstance(e, OutValue):
            set_element(tree, e.path, fetch.value(e))
        else:
            set_element(tree, e.path, TensorRef(e.dtype, e.shape, lambda e=e: fetch.tensor(e)))
    return tree


def write_torch_save(
    dest: WriteDestination,
    tensors: Sequence[OutTensor],
    values: Sequence[OutValue],
    fetch: Fetch,
    *,
    single_file: bool,
    max_shard_size: int,
    drop_non_tensors: bool = False,
    prefix: str = "pytorch_model",
) -> tuple[str, list[str]]:
    """Write a ``torch.save`` file (or HF-named shards plus index); returns the path to open and the
    value keys left out (``drop_non_tensors`` with several shards)."""
    transport = dest.transport
    if single_file:
        groups = [list(tensors)]
    else:
        groups = pack_by_bytes(tensors, max_shard_size)
    sharded = len(groups) > 1
    if sharded and values and not drop_non_tensors:
        raise NonTensorStateError(
            [v.key for v in values],
            format_name="sharded torch.save output",
            fix="pass drop_non_tensors=True (--drop-non-tensors), or a larger max_shard_size for one file",
        )
    single_name, index_name = f"{prefix}.bin", f"{prefix}.bin.index.json"
    if single_file:
        root, _ = dest.parent_and_name()
        targets = [dest.path]
    else:
        root = dest.path
        targets = [transport.join(root, single_name), transport.join(root, index_name)]
    existing = [p for p in targets if transport.exists(p)]
    if existing and not dest.overwrite:
        raise CheckpointExistsError(
            f"{dest.url_of(existing[0])}: already exists; pass overwrite=True (--overwrite) to replace it"
        )
    if not single_file:
        transport.remove(transport.join(root, index_name))
    make_output_root(transport, root)

    n = len(groups)
    weight_map: dict[str, str] = {}
    written: list[str] = []
    try:
        _write_groups(dest, groups, values, fetch, single_file, prefix, root, weight_map, written)
        if n > 1:
            data = hf_index_json(sum(t.nbytes for t in tensors), {t.key: weight_map[t.key] for t in tensors})
            transport.write_file(transport.join(root, index_name), data)
            dest.record(index_name, len(data))
    except BaseException:
        # A shard is a whole torch.save file that opens on its own: none may outlive a failed set.
        if n > 1:
            for path in written:
                with contextlib.suppress(Exception):
                    transport.remove(path)
        raise
    dropped = [v.key for v in values] if sharded else []
    if single_file:
        return dest.path, dropped
    return transport.join(root, index_name if n > 1 else single_name), dropped


def _write_groups(
    dest: WriteDestination,
    groups: list[list[OutTensor]],
    values: Sequence[OutValue],
    fetch: Fetch,
    single_file: bool,
    prefix: str,
    root: str,
    weight_map: dict[str, str],
    written: list[str],
) -> None:
    """Write each group as one ``torch.save`` file; ``written`` collects their paths as they are committed."""
    transport = dest.transport
    single_name = f"{prefix}.bin"
    n = len(groups)
    for k, group in enumerate(groups):
        if single_file:
            path, name = dest.path, dest.parent_and_name()[1]
            tree: Any = build_tree(group, values, fetch)
        else:
            name = single_name if n == 1 else f"{prefix}-{k + 1:05d}-of-{n:05d}.bin"
            path = transport.join(root, name)
            if n == 1:
                tree = build_tree(group, values, fetch)
            else:
                tree = {t.key: TensorRef(t.dtype, t.shape, lambda t=t: fetch.tensor(t)) for t in group}
        with transport.open_atomic(path) as stream:
            write_archive(stream, tree, dest.advance)
            size = stream.tell()
        written.append(path)
        dest.record(name, size)
        for t in group:
            weight_map[t.key] = name


def _write(
    dest: WriteDestination,
    tensors: Sequence[OutTensor],
    values: Sequence[OutValue],
    fetch: Fetch,
    options: WriteOptions,
) -> tuple[str, list[str]]:
    return write_torch_save(
        dest,
        tensors,
        values,
        fetch,
        single_file=options.single_file,
        max_shard_size=shard_size(options),
        drop_non_tensors=options.drop_non_tensors,
    )


TARGET = ConvertTarget("torch", _write, aliases=("torch_save", "pt", "bin"))


def describe_torch_save(url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
    transport, path = open_transport(url, storage_options)
    with transport:
        archive = TorchSaveArchive.open(transport, path)
        name = posixpath.basename(path.replace(os.sep, "/"))
        starts = archive._data_starts()
        tensors, values = [], []
        for fqn, value in archive.flat.items():
            if isinstance(value, TensorDescriptor):
                shape = list(value.shape)
                start = starts[value.storage_key] + value.storage_offset * value.itemsize
                chunk = ChunkInfo([0] * len(shape), shape, name, start, value.nbytes)
                tensors.append(TensorInfo(fqn, dtype_name(value.dtype), shape, value.nbytes, [chunk]))
            else:
                values.append(ValueInfo(fqn, name, None, None))
        files = [FileInfo(name, archive.index.file_size)]
    return CheckpointInfo(url, spec.descriptor, spec.description, "torch.save zip", files, tensors, values)


_CRC_CHUNK = 8 * 1024 * 1024


def check_torch_save(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    transport, path = open_transport(url, storage_options)
    with transport:
        try:
            archive = TorchSaveArchive.open(transport, path)
            archive._data_starts()  # every storage record's local header, inside the entry area
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(error_text(exc))
            return
        report.checked["files"] = 1
        report.checked["tensors"] = len(archive.tensors)
        report.checked["chunks"] = len(archive.tensors)


def deep_check_torch_save(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    if report.problems:  # a tensor did not read back: that is the finding, its record's CRC adds nothing
        return
    try:
        _check_crc32(report, url, storage_options)
    except Exception as exc:  # noqa: BLE001 - reported
        report.problems.append(error_text(exc))
    report.notes.append("CRC32 of every zip record (written by torch's zip writer) checked")


def _check_crc32(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    transport, path = open_transport(url, storage_options)
    with transport:
        index = read_zip_index(transport, path)
        names = [n for n, e in index.entries.items() if e.method == STORED]
        starts = data_starts(transport, index, names)
        for name in names:
            entry, start, crc = index.entries[name], starts[name], 0
            for lo in range(start, start + entry.compressed_size, _CRC_CHUNK):
                hi = min(lo + _CRC_CHUNK, start + entry.compressed_size)
                crc = crc32(transport.read_range(path, lo, hi), crc)
            if crc != entry.crc32:
                report.problems.append(
                    f"{index.url}: record {name!r}: {mismatch('CRC32', f'{entry.crc32:08x}')}: "
                    "the bytes were changed after the file was written"
                )
        report.checked["crc32_records"] = len(names)


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER, the first object of a legacy file


def looks_like_torch_zip(head: bytes) -> bool:
    """A zip whose first entry is ``<archive>/data.pkl``: what ``torch.save`` writes since torch 1.6."""
    if len(head) < 30 or not head.startswith(b"PK\x03\x04"):
        return False
    (name_len,) = struct.unpack_from("<H", head, 26)
    name = head[30 : 30 + name_len]
    return name.endswith(b"data.pkl") or len(name) < name_len  # name cut off by the short head: still plausible


def looks_like_legacy_torch_pickle(head: bytes) -> bool:
    """A pre-1.6 ``torch.save`` file: a pickle whose first object is torch's magic number."""
    return head.startswith(b"\x80\x02\x8a\x0a") and int.from_bytes(head[4:14], "little") == _LEGACY_MAGIC


def _sniff(probe: Probe) -> int | None:
    if probe.is_dir:
        return None
    if looks_like_torch_zip(probe.head):
        return 100
    if looks_like_legacy_torch_pickle(probe.head):
        return 50  # recognised so the reader can refuse it with a clear message
    return None


FORMAT = FormatSpec(
    name="torch_save",
    version="1",
    sniff=_sniff,
    description="a single torch.save file (zip format); legacy pickles are recognised and refused",
    reader="dcp_storage.BroadcastingTorchSaveReader(url)",
    describe=describe_torch_save,
    check=check_torch_save,
    deep_check=deep_check_torch_save,
    convert_target=TARGET,
    suffixes=(".pt", ".pth", ".bin", ".ckpt"),
)
