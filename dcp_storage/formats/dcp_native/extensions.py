"""Stream-transform extensions on the read side: finding them, and decoding items with them.

torch records, for each item written through ``_extensions`` (compression, ...), the list of transform
descriptors (``"name/version"``) in ``_StorageInfo.transform_descriptors``, and its reader resolves them
through an ``ExtensionRegistry`` that the caller must fill by hand. Ours is filled automatically:
:class:`PluginExtensionRegistry` holds torch's defaults (``stream.zstd``) plus, looked up only when a
descriptor names one, every extension registered under the ``dcp_storage.extensions`` entry-point group.

A descriptor nobody provides raises :class:`UnknownExtensionError` naming the file, the key, the
descriptor and, from the checkpoint's manifest (``.dcp_storage.json``, written by ``FsspecWriter``), the
distribution to install. Stored bytes that do not decode raise
:class:`~dcp_storage.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from torch.distributed.checkpoint._extension import Extension, ExtensionRegistry, StreamTransformExtension

from dcp_storage import registry as plugin_registry
from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError, UnknownExtensionError
from dcp_storage.formats.dcp_native.framed_items import DecodesTooLarge, decode_whole
from dcp_storage.formats.dcp_native.seekable import SeekableTransform
from dcp_storage.formats.limits import INFLATED, MANIFEST, inflation_limit, read_limited
from dcp_storage.integrity.manifest import MANIFEST_FILE, install_hint

__all__ = ["MANIFEST_FILE", "ExtensionResolver", "PluginExtensionRegistry", "UnknownExtensionError"]


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
        self._lock = threading.Lock()
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
        :func:`~dcp_storage.formats.limits.inflation_limit`: a decompression bomb is refused, naming the item,
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
        if self._manifest is None:
            path = self.transport.join(self.root, MANIFEST_FILE)
            try:
                parsed = json.loads(read_limited(self.transport, path, MANIFEST))
                self._manifest = parsed if isinstance(parsed, dict) else "manifest is not a JSON object"
            except (CheckpointNotFoundError, FileNotFoundError):
                self._manifest = "the checkpoint has no manifest naming the distribution that wrote it"
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                self._manifest = f"manifest is not valid JSON ({exc})"
        return self._manifest
