"""Stream-transform extensions (compression) on read and write, and ``convert`` into the native layout.

Stream-transform extensions on the read side: finding them, and decoding items with them.

torch records, for each item written through ``_extensions`` (compression, ...), the list of transform
descriptors (``"name/version"``) in ``_StorageInfo.transform_descriptors``, and its reader resolves them
through an ``ExtensionRegistry`` that the caller must fill by hand. Ours is filled automatically:
:class:`PluginExtensionRegistry` holds torch's defaults (``stream.zstd``) plus, looked up only when a
descriptor names one, every extension registered under the ``dcp_storage.extensions`` entry-point group.

A descriptor nobody provides raises :class:`UnknownExtensionError` naming the file, the key, the
descriptor and, from the checkpoint's manifest (``.dcp_storage.json``, written by ``FsspecWriter``), the
distribution to install. Stored bytes that do not decode raise
:class:`~dcp_storage.errors.CorruptCheckpointError`.

Writing DCP items through stream-transform extensions (compression, ...), exactly as torch does.

torch's ``FileSystemWriter(_extensions=[...])`` wraps each item's output stream in every extension's
``transform_to`` (the last extension outermost), writes the item, closes the chain, and records
``[ext.get_descriptor() for ext in reversed(extensions)]`` as the item's ``transform_descriptors`` (or
``None`` when there are no extensions). :class:`ItemEncoder` does the same, so torch's
``FileSystemReader`` with an ``ExtensionRegistry`` holding the extensions reads our output and ours
reads torch's.

Streaming a DCP native checkpoint (``__0_N.distcp`` + ``.metadata``), one tensor in memory at a time.

The bytes are what torch's ``FileSystemWriter`` (and our :class:`~dcp_storage.FsspecWriter`) write for a
single-rank save: each tensor a ``torch.save`` record appended to a data file, non-tensor values (their
``torch.save`` bytes) first in the first file, and a pickled ``Metadata`` whose ``planner_data`` is DCP's
flatten mapping, so ``dcp.load``, ``FileSystemReader`` and ``dcp_to_torch_save`` read the result.

Commit order: an old ``.metadata`` is removed first (``overwrite=True``), each data file is committed
atomically, the manifest ``.dcp_storage.json`` (provenance and a checksum of every record, hashed while
writing, exactly as :class:`~dcp_storage.FsspecWriter` records them: :mod:`dcp_storage.integrity`) follows,
and the new ``.metadata`` is written last, so an interrupted conversion never looks complete.
"""

from __future__ import annotations

import io
import json
import threading
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from contextlib import contextmanager
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage import registry as plugin_registry
from dcp_storage._torch import Extension, ExtensionRegistry, StorageInfo, StreamTransformExtension
from dcp_storage.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    DcpStorageError,
    UnknownExtensionError,
)
from dcp_storage.formats.dcp_native.framed_items import DecodesTooLarge, decode_whole
from dcp_storage.formats.dcp_native.manifest_io import build_manifest
from dcp_storage.formats.dcp_native.native import DCP_VERSION, METADATA_FILE, dump_metadata
from dcp_storage.formats.dcp_native.records import SeekableTransform
from dcp_storage.formats.paths import DATA_SUFFIX, INFLATED, inflation_limit
from dcp_storage.formats.safetensors.convert_out import pack_by_bytes
from dcp_storage.formats.spec import ConvertTarget, Fetch, OutTensor, OutValue, WriteDestination, WriteOptions
from dcp_storage.formats.writing import save_record
from dcp_storage.integrity.checksums import BLOCK_SIZE, DEFAULT_ALGORITHM, HashingWriter, block_size_for
from dcp_storage.integrity.manifest import MANIFEST_FILE, install_hint, manifest_bytes
from dcp_storage.runtime import fork_safe, held_interrupts
from dcp_storage.transports.access import make_output_root

__all__ = [
    "ExtensionResolver",
    "ItemEncoder",
    "MANIFEST_FILE",
    "PluginExtensionRegistry",
    "TARGET",
    "UnknownExtensionError",
    "write_dcp",
]


class PluginExtensionRegistry(ExtensionRegistry):
    """torch's :class:`ExtensionRegistry` that also finds extension plugins, on first use of their name.

    ``base``: a registry whose entries are kept (and win over plugins), e.g. one the user filled with
    ``register``. A plugin entry is an ``Extension`` subclass; it is found by its entry-point name or, failing
    that, by the ``registry_name()`` of any extension plugin (which imports them all, once).
    """

    def __init__(self, base: ExtensionRegistry | None = None) -> None:
        super().__init__()
        if base is not None:
            self.extensions.update(base.extensions)
        self._lock = fork_safe(threading.Lock())
        self.plugin_errors: dict[str, str] = {}  # name -> why the plugin that claims it did not load

    def lookup(self, name: str) -> type[Extension] | None:
        """The extension class registered as ``name``, from torch, the base registry or a plugin."""
        with self._lock:
            cls = self.extensions.get(name)
            if cls is None:
                cls = self._from_plugins(name)
                if cls is not None:
                    self.extensions[name] = cls
            return cls

    def _from_plugins(self, name: str) -> type[Extension] | None:
        try:
            found = _as_extension_class(plugin_registry.get("extensions", name))
            if found is not None and found.registry_name() == name:
                return found
        except plugin_registry.PluginNotFoundError:
            pass
        except plugin_registry.PluginImportError as exc:
            self.plugin_errors[name] = str(exc)
        for info in plugin_registry.list("extensions"):
            try:
                cls = _as_extension_class(plugin_registry.get("extensions", info.name))
            except plugin_registry.PluginImportError as exc:
                self.plugin_errors.setdefault(name, str(exc))
                continue
            if cls is not None and cls.registry_name() == name:
                return cls
        return None

    def from_descriptor_list(self, descriptors: Sequence[str]) -> Sequence[Extension]:
        """As torch's: ``ValueError`` for a name nobody registered (torch's readers expect that)."""
        out = []
        for desc in descriptors:
            name, _, version = desc.partition("/")
            cls = self.lookup(name)
            if cls is None:
                raise ValueError(f"Unknown extension {name=}")
            out.append(cls.from_descriptor(version))
        return out


def _as_extension_class(obj: Any) -> type[Extension] | None:
    if isinstance(obj, type) and issubclass(obj, Extension):
        return obj
    if isinstance(obj, Extension):
        return type(obj)
    return None


class ExtensionResolver:
    """Turns an item's descriptors into extension objects and decodes whole items; one per load.

    ``transport``/``root`` locate the checkpoint, for the manifest read when a descriptor is unknown;
    ``executor`` decodes the frames of seekable items concurrently (default: the transport's workers).
    """

    def __init__(
        self, transport: Any, root: str, registry: ExtensionRegistry | None = None, executor: Executor | None = None
    ) -> None:
        self.transport = transport
        self._executor = executor
        self.root = root
        self.registry = registry if isinstance(registry, PluginExtensionRegistry) else PluginExtensionRegistry(registry)
        self._cache: dict[tuple[str, ...], list[Extension]] = {}
        self._manifest: dict[str, Any] | str | None = None

    def resolve(self, descriptors: Sequence[str], where: str, key: str) -> list[Extension]:
        """Extension objects for ``descriptors``, in the order the reader applies them (torch's)."""
        descs = tuple(descriptors)
        cached = self._cache.get(descs)
        if cached is not None:
            return cached
        out: list[Extension] = []
        for desc in descs:
            name, _, version = desc.partition("/")
            cls = self.registry.lookup(name)
            if cls is None:
                raise UnknownExtensionError(self._unknown(desc, where, key, self.registry.plugin_errors.get(name)))
            try:
                out.append(cls.from_descriptor(version))
            except Exception as exc:  # any refusal of the version becomes our error, chained
                raise UnknownExtensionError(
                    self._unknown(desc, where, key, f"{cls.__module__}.{cls.__qualname__} refused it: {exc}")
                ) from exc
        self._cache[descs] = out
        return out

    def untransform(
        self, descriptors: Sequence[str], raw: memoryview, where: str, key: str, expected: int = 0
    ) -> bytes | bytearray:
        """The original bytes of a whole stored item (torch's ``transform_from`` chain).

        ``expected``: the bytes the metadata says the item decodes to (0: unknown). Decoding stops at
        :func:`~dcp_storage.formats.paths.inflation_limit`: a decompression bomb is refused, naming the item,
        before it is inflated.
        """
        extensions = self.resolve(descriptors, where, key)
        limit = inflation_limit(len(raw), expected)
        stream: Any = io.BytesIO(raw)
        try:
            if len(extensions) == 1 and isinstance(extensions[0], SeekableTransform):
                pool = self._executor or self.transport.executor()
                out = decode_whole(extensions[0], raw, pool, limit)  # frames decoded concurrently
            else:
                for ext in extensions:
                    if isinstance(ext, StreamTransformExtension):
                        stream = ext.transform_from(stream)
                out = stream.read(limit + 1)
        except DecodesTooLarge:
            out = None
        except Exception as exc:  # decoders raise their own types (zstd.ZstdError, ...); chained
            raise CorruptCheckpointError(
                f"{where} (item {key!r}): stored bytes do not decode with {'+'.join(descriptors)}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if out is None or len(out) > limit:
            raise CorruptCheckpointError(
                f"{where} (item {key!r}): its {len(raw)} stored bytes decode with {'+'.join(descriptors)} to more "
                f"than {limit} bytes ({'the chunk size the metadata records and ' if expected else ''}100 times "
                f"the stored size, plus {INFLATED.bytes}): a decompression bomb? If it is genuine, set "
                f"{INFLATED.env} to a larger number of bytes"
            )
        return out

    # ------------------------------------------------------------------------------------ error text
    def _unknown(self, descriptor: str, where: str, key: str, detail: str | None) -> str:
        msg = f"{where} (item {key!r}): no installed extension reads stream transform {descriptor!r}"
        if detail:
            msg += f" ({detail})"
        return f"{msg}; {self._install_hint(descriptor)}"

    def _install_hint(self, descriptor: str) -> str:
        manifest = self._read_manifest()
        url = self.transport.url(self.transport.join(self.root, MANIFEST_FILE))
        if isinstance(manifest, str):
            return f"{url}: {manifest}; install the package that provides {descriptor!r}"
        for entry in manifest.get("extensions") or []:
            if isinstance(entry, dict) and entry.get("descriptor") == descriptor and entry.get("distribution"):
                dist, version = str(entry["distribution"]), entry.get("version")
                return f"the manifest says it was written by {dist}: {install_hint(dist, version and str(version))}"
        return f"{url} does not name {descriptor!r}; install the package that provides it"

    def _read_manifest(self) -> dict[str, Any] | str:
        if self._manifest is None:  # only a hint: read leniently, never raising
            try:
                raw = manifest_bytes(self.transport, self.root)
            except DcpStorageError as exc:  # a FIFO, a directory, an oversized file: the hint says so
                self._manifest = f"manifest is unreadable ({exc})"
                return self._manifest
            if raw is None:
                self._manifest = "the checkpoint has no manifest naming the distribution that wrote it"
            else:
                try:
                    parsed = json.loads(raw)
                    self._manifest = parsed if isinstance(parsed, dict) else "manifest is not a JSON object"
                except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                    self._manifest = f"manifest is not valid JSON ({exc})"
        return self._manifest


class _NoCloseWriter(io.RawIOBase):
    """The file stream as the innermost transform sees it: closing the chain must not close the file
    (the next item is appended to it), only flush it."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.raw.write(b)

    def close(self) -> None:
        if not self.closed:
            self.raw.flush()
        super().close()


class ItemEncoder:
    """Encodes items through ``extensions`` (an empty sequence writes them unchanged).

    Raises ``TypeError`` for an extension that is not a ``StreamTransformExtension``.
    """

    def __init__(self, extensions: Sequence[StreamTransformExtension] | None = None) -> None:
        self.extensions: tuple[StreamTransformExtension, ...] = tuple(extensions or ())
        for ext in self.extensions:
            if not isinstance(ext, StreamTransformExtension):
                raise TypeError(
                    f"extensions must be torch StreamTransformExtension instances, got {type(ext).__name__}"
                )
        descriptors = [ext.get_descriptor() for ext in reversed(self.extensions)]
        self.descriptors: list[str] | None = descriptors or None  # what torch records in _StorageInfo

    @contextmanager
    def open(self, stream: Any) -> Iterator[IO[bytes]]:
        """A stream whose writes land, transformed, in ``stream``; the chain is closed (flushing the
        extensions' trailers) on exit, ``stream`` itself stays open."""
        if not self.extensions:
            yield stream
            return
        out: Any = _NoCloseWriter(stream)
        for ext in self.extensions:
            out = ext.transform_to(out)
        yield out
        out.close()


def _groups(tensors: Sequence[OutTensor], max_shard_size: int | None) -> list[list[OutTensor]]:
    return [list(tensors)] if max_shard_size is None else pack_by_bytes(tensors, max_shard_size)


def write_dcp(
    dest: WriteDestination,
    tensors: Sequence[OutTensor],
    values: Sequence[OutValue],
    fetch: Fetch,
    *,
    descriptor: str,
    max_shard_size: int | None = None,
    checksum_algorithm: str = DEFAULT_ALGORITHM,
) -> None:
    """Write ``tensors`` and ``values`` as a DCP checkpoint in the directory ``dest``, with its manifest
    (which records ``descriptor``, the format's ``name/version``, as what the checkpoint is)."""
    transport = dest.transport
    metadata_path = dest.join(METADATA_FILE)
    if transport.exists(metadata_path):
        if not dest.overwrite:
            raise CheckpointExistsError(
                f"{dest.url_of(metadata_path)}: a checkpoint already exists here; pass overwrite=True (--overwrite) "
                "to replace it"
            )
        transport.remove(metadata_path)  # retire the old checkpoint before any data file is replaced
    make_output_root(transport, dest.path)  # object stores: nothing to make (Destination checked the bucket)

    state: dict[str, object] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    records: list[tuple[object, ...]] = []  # (file, offset, length, digest, blocks) of every record
    for i, group in enumerate(_groups(tensors, max_shard_size)):
        name = f"__0_{i}{DATA_SUFFIX}"
        first = i == 0
        if not group and not (first and values):
            continue
        with transport.open_atomic(dest.join(name)) as raw:
            stream = HashingWriter(raw, checksum_algorithm, BLOCK_SIZE)  # record and block checksums, one pass
            for value in values if first else ():
                data = fetch.value_bytes(value)
                stream.begin(block_size_for(len(data)))
                stream.write(data)
                offset, length, digest = stream.end()
                records.append((name, offset, length, digest, stream.blocks, stream.first_block, stream.blocks_size))
                storage[MetadataIndex(value.key)] = StorageInfo(name, offset, length)
                state[value.key] = BytesStorageMetadata()
            for out, tensor in fetch.tensors(group):
                stream.begin(block_size_for(tensor.numel() * tensor.element_size()))
                with held_interrupts():  # torch's C++ zip writer calls stream.write (dcp_storage.runtime)
                    save_record(tensor, stream)  # torch.save, its CRC-32s by ISA-L
                offset, length, digest = stream.end()
                del tensor
                records.append((name, offset, length, digest, stream.blocks, stream.first_block, stream.blocks_size))
                zeros = torch.Size([0] * len(out.shape))
                storage[MetadataIndex(out.key, zeros, 0)] = StorageInfo(name, offset, length)
                size = torch.Size(out.shape)
                state[out.key] = TensorStorageMetadata(
                    TensorProperties(dtype=out.dtype), size, [ChunkStorageMetadata(offsets=zeros, sizes=size)]
                )
                dest.advance(out.nbytes)
            written = stream.tell()
        dest.record(name, written)

    ordered = {k: state[k] for k in [*(v.key for v in values), *(t.key for t in tensors)] if k in state}
    metadata = Metadata(
        state_dict_metadata=ordered,  # type: ignore[arg-type]
        planner_data={k: p for k, p in [*((v.key, v.path) for v in values), *((t.key, t.path) for t in tensors)]},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=dest.url, save_id=uuid.uuid4().hex),
    )
    metadata.version = DCP_VERSION
    data = dump_metadata(metadata)
    manifest = build_manifest(descriptor, storage, records, {checksum_algorithm}, metadata=data).to_json()
    transport.write_file(dest.join(MANIFEST_FILE), manifest)  # before the commit marker
    dest.record(MANIFEST_FILE, len(manifest))
    transport.write_file(metadata_path, data)
    dest.record(METADATA_FILE, len(data))


def _write(
    dest: WriteDestination,
    tensors: Sequence[OutTensor],
    values: Sequence[OutValue],
    fetch: Fetch,
    options: WriteOptions,
) -> tuple[str, list[str]]:
    write_dcp(dest, tensors, values, fetch, max_shard_size=options.max_shard_size, descriptor=options.descriptor)
    return dest.path, []


TARGET = ConvertTarget("dcp", _write, single_file=False)
