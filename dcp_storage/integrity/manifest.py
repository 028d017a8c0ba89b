"""``.dcp_storage.json``: what wrote a DCP checkpoint (provenance descriptors) and a checksum per stored item.

torch's ``.metadata`` must stay loadable by torch's own readers, so none of our classes go into it. The
coordinator writes this manifest in ``FsspecWriter.finish`` *before* ``.metadata``, which stays the commit
marker: a checkpoint whose ``.metadata`` exists has its manifest too (if its writer was ours). Schema 1::

    {"schema": 1, "format": "dcp/1", "writer": "dcp-storage/0.1.0",
     "extensions": [{"descriptor": "stream.zstd/1", "distribution": "torch", "version": "2.13.0"}],
     "checksums": {"algorithm": "xxh3_64",
                   "files": {"__0_0.distcp": {"size": 1234, "items": [[0, 1234, "9f0c..."]]}}}}

Each item checksum covers the *stored* bytes ``[offset, offset + length)`` of one record (after any stream
transform), and a file's items tile it, so a changed byte anywhere in a data file changes some checksum.

Two optional fields, which readers before them ignore (so the schema stays 1):

- ``"metadata": {"algorithm": "xxh3_64", "digest": "...", "size": N}``: the digest of the ``.metadata``
  this manifest describes. A reader compares it with the ``.metadata`` it read and ignores a manifest that
  does not match (torch's ``FileSystemWriter`` saved over the checkpoint and left our manifest behind),
  with one warning naming both files (:func:`metadata_matches`). Whichever of the two files an overwrite
  writes first, a reader sees a matching pair or ignores the manifest: never a record "mismatch".
- ``checksums.block_size`` and, per file, ``"blocks": [[offset, "<digest><digest>...", first, size], ...]``:
  for each record longer than one block, the digests of its consecutive blocks, concatenated: a first block
  of ``first`` bytes when not 0 (the record's header, so the blocks after it are aligned to the tensor's
  elements), then blocks of ``size`` bytes (``checksums.block_size`` when absent; the last one shorter), so
  a slice read is checked by the blocks that cover it (:mod:`.blocks`). A record without blocks in a
  manifest with ``block_size`` is its own block.

Does this installation have the format plugin a checkpoint's manifest names?

A checkpoint written through dcp-storage records its format as a ``name/version`` descriptor in
``.dcp_storage.json``. Format detection asks here first, so a checkpoint whose format plugin is not installed
fails with the descriptor and the distribution to install, instead of "unrecognised checkpoint".

``name/version`` descriptors of what wrote a checkpoint, and the distribution that provides each one.

A reader that meets a descriptor it has no plugin for names the distribution to install, so the writer
records it: for an extension, the registry entry (``dcp_storage.extensions`` entry points) whose name is
the extension's ``registry_name()``, else the distribution that owns the extension's module (torch's own
extensions: ``torch``).
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any

from dcp_storage import registry
from dcp_storage._version import __version__
from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError, DcpStorageError, StaleManifestWarning
from dcp_storage.formats.paths import MANIFEST, MANIFEST_FILE, check_relative, read_limited
from dcp_storage.integrity.checksums import ChecksumAlgorithmError, checksum

__all__ = [
    "ExtensionInfo",
    "FileChecksums",
    "ItemChecksum",
    "MANIFEST_FILE",
    "manifest_bytes",
    "Manifest",
    "SCHEMA",
    "describe_extension",
    "distribution_of_module",
    "format_distribution",
    "install_hint",
    "metadata_matches",
    "missing_format_plugin",
    "writer_descriptor",
]


SCHEMA = 1

# PEP 508 distribution names and PEP 440-shaped versions: nothing a shell would read as more than a word.
_DISTRIBUTION = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?")
_VERSION = re.compile(r"[0-9][0-9A-Za-z.+!_-]{0,62}")


def install_hint(distribution: str | None, version: str | None = None, what: str = "it") -> str:
    """What to install for a descriptor a checkpoint's manifest attributes to ``distribution``.

    The name comes from the checkpoint, so it is a claim, not advice: it is quoted as a command only when it
    is a well-formed distribution name (and version), and always with a warning to check it first. A
    hostile manifest can then suggest a package, but never a shell command, and never silently.
    """
    generic = f"install the package that provides {what}"
    if not distribution:
        return generic
    if not _DISTRIBUTION.fullmatch(distribution) or (version and not _VERSION.fullmatch(version)):
        return f"{generic} (the checkpoint's manifest names no valid distribution: install nothing it names)"
    command = f"pip install '{distribution}=={version}'" if version else f"pip install {distribution}"
    return f"{command} (a name read from the checkpoint: install it only from a source you trust)"


@dataclass(frozen=True)
class ExtensionInfo:
    """An extension the writer used: its ``name/version`` descriptor and the distribution that provides it."""

    descriptor: str
    distribution: str | None = None
    version: str | None = None

    @property
    def install_hint(self) -> str:
        return install_hint(self.distribution, self.version)


@dataclass(frozen=True)
class ItemChecksum:
    offset: int
    length: int
    digest: str
    blocks: tuple[str, ...] = ()  # digests of its block_size blocks, for a record longer than one block
    first_block: int = 0  # a short first block of this many bytes (the record's header), 0 for none
    block_size: int = 0  # its blocks' size (0: the manifest's block_size)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class FileChecksums:
    size: int
    items: list[ItemChecksum] = field(default_factory=list)


@dataclass
class Manifest:
    """The parsed manifest; :meth:`from_json` validates every field and names the file on error."""

    format: str
    writer: str
    extensions: list[ExtensionInfo] = field(default_factory=list)
    algorithm: str | None = None
    files: dict[str, FileChecksums] = field(default_factory=dict)
    format_distribution: str | None = None
    block_size: int | None = None
    metadata_digest: tuple[str, str, int] | None = None  # (algorithm, digest, size) of the .metadata described

    @property
    def format_name(self) -> str:
        return self.format.partition("/")[0]

    def item(self, file: str, offset: int, length: int) -> ItemChecksum | None:
        """The checksum recorded for exactly the record ``[offset, offset + length)`` of ``file``, if any."""
        entry = self.files.get(file)
        if entry is None:
            return None
        lookup = getattr(entry, "_by_range", None)
        if lookup is None:
            lookup = {(i.offset, i.length): i for i in entry.items}
            entry._by_range = lookup  # type: ignore[attr-defined]
        return lookup.get((offset, length))  # type: ignore[no-any-return]

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {"schema": SCHEMA, "format": self.format, "writer": self.writer}
        if self.format_distribution:
            doc["format_distribution"] = self.format_distribution
        doc["extensions"] = [
            {
                k: v
                for k, v in (("descriptor", e.descriptor), ("distribution", e.distribution), ("version", e.version))
                if v
            }
            for e in self.extensions
        ]
        if self.metadata_digest is not None:
            algorithm, digest, size = self.metadata_digest
            doc["metadata"] = {"algorithm": algorithm, "digest": digest, "size": size}
        if self.algorithm is not None:
            doc["checksums"] = {"algorithm": self.algorithm, "files": {}}
            if self.block_size is not None:
                doc["checksums"]["block_size"] = self.block_size
            for name, f in sorted(self.files.items()):
                entry: dict[str, Any] = {"size": f.size, "items": [[i.offset, i.length, i.digest] for i in f.items]}
                blocks = [[i.offset, "".join(i.blocks), i.first_block, i.block_size] for i in f.items if i.blocks]
                if blocks:
                    entry["blocks"] = blocks
                doc["checksums"]["files"][name] = entry
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, url: str) -> Manifest:
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{url}: manifest is not valid JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(f"{url}: manifest is not a JSON object")
        schema = doc.get("schema")
        if not isinstance(schema, int) or schema < 1:
            raise CorruptCheckpointError(f"{url}: manifest has no valid 'schema' field")
        if schema > SCHEMA:
            raise CorruptCheckpointError(
                f"{url}: manifest schema {schema} is newer than this dcp-storage understands ({SCHEMA}); "
                "pip install -U dcp-storage"
            )
        fmt, writer = doc.get("format"), doc.get("writer")
        if not isinstance(fmt, str) or not isinstance(writer, str):
            raise CorruptCheckpointError(f"{url}: manifest needs string 'format' and 'writer' fields")
        extensions = []
        for e in _list(doc.get("extensions", []), url, "extensions"):
            if not isinstance(e, dict) or not isinstance(e.get("descriptor"), str):
                raise CorruptCheckpointError(f"{url}: manifest extension entry {e!r} has no 'descriptor'")
            extensions.append(ExtensionInfo(e["descriptor"], _opt_str(e, "distribution"), _opt_str(e, "version")))
        manifest = cls(fmt, writer, extensions, format_distribution=_opt_str(doc, "format_distribution"))
        manifest.metadata_digest = _metadata_digest(doc.get("metadata"), url)
        sums = doc.get("checksums")
        if sums is not None:
            if not isinstance(sums, dict) or not isinstance(sums.get("algorithm"), str):
                raise CorruptCheckpointError(f"{url}: manifest 'checksums' needs an 'algorithm'")
            manifest.algorithm = sums["algorithm"]
            block_size = sums.get("block_size")
            if block_size is not None and (type(block_size) is not int or not 4096 <= block_size <= 1 << 30):
                raise CorruptCheckpointError(
                    f"{url}: manifest 'checksums.block_size' {block_size!r} is not 4 KiB-1 GiB"
                )
            manifest.block_size = block_size
            files = sums.get("files", {})
            if not isinstance(files, dict):
                raise CorruptCheckpointError(f"{url}: manifest 'checksums.files' is not an object")
            for name, f in files.items():
                # A name leaving the checkpoint would have verify hash a file outside it against a digest
                # the manifest chose: a way to test guesses about that file's content.
                check_relative(name, f"{url}: checksums entry")
                manifest.files[name] = _file_entry(f, url, name, block_size)
        return manifest

    def blocks_of(self, file: str, offset: int, length: int) -> tuple[str, ...]:
        """The block digests of the record ``[offset, offset + length)`` of ``file`` (empty: none recorded)."""
        item = self.item(file, offset, length)
        return item.blocks if item is not None else ()


def metadata_matches(manifest: Manifest, data: Any, manifest_url: str, metadata_url: str) -> bool | None:
    """Whether ``manifest`` describes the ``.metadata`` bytes ``data`` (``None``: it records no digest).

    ``False`` warns once, naming both files: the manifest is then ignored (a writer that knows nothing of
    it, torch's, saved over the checkpoint), and the load relies on what the format carries (zip CRC-32s).
    """
    if manifest.metadata_digest is None:
        return None
    algorithm, digest, size = manifest.metadata_digest
    try:
        same = len(data) == size and checksum(data, algorithm) == digest
    except ChecksumAlgorithmError:
        same = False
    if not same:
        warnings.warn(
            f"{manifest_url} does not describe {metadata_url} (another writer, e.g. torch's FileSystemWriter, saved "
            "over the checkpoint and left it behind); ignoring the manifest and checking the zip CRC-32s. Delete the "
            "stale manifest to silence this",
            StaleManifestWarning,
            stacklevel=3,
        )
    return same


def _metadata_digest(value: Any, url: str) -> tuple[str, str, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("algorithm"), str)
        or not isinstance(value.get("digest"), str)
        or type(value.get("size")) is not int
    ):
        raise CorruptCheckpointError(f"{url}: manifest 'metadata' needs 'algorithm', 'digest' and an integer 'size'")
    return value["algorithm"], value["digest"], value["size"]


def _list(value: Any, url: str, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{url}: manifest field {name!r} is not a list")
    return value


def _opt_str(doc: Mapping[str, Any], key: str) -> str | None:
    value = doc.get(key)
    return value if isinstance(value, str) else None


def _file_entry(f: Any, url: str, name: str, block_size: int | None = None) -> FileChecksums:
    if not isinstance(f, dict) or type(f.get("size")) is not int or f["size"] < 0:
        raise CorruptCheckpointError(f"{url}: manifest entry for {name!r} needs an integer 'size'")
    items = []
    for it in _list(f.get("items", []), url, f"checksums.files[{name!r}].items"):
        if (
            not isinstance(it, list)
            or len(it) != 3
            or not all(isinstance(x, int) and x >= 0 for x in it[:2])
            or not isinstance(it[2], str)
        ):
            raise CorruptCheckpointError(f"{url}: manifest item {it!r} of {name!r} is not [offset, length, digest]")
        items.append(ItemChecksum(it[0], it[1], it[2]))
    blocks = f.get("blocks")
    if blocks is not None and block_size is not None:
        by_offset = {i.offset: k for k, i in enumerate(items)}
        for b in _list(blocks, url, f"checksums.files[{name!r}].blocks"):
            shaped = isinstance(b, list) and len(b) in (2, 3, 4) and isinstance(b[1], str)
            first = b[2] if shaped and len(b) >= 3 else 0
            size = b[3] if shaped and len(b) == 4 and b[3] else block_size
            sound = type(first) is int and type(size) is int and 4096 <= size <= 1 << 30 and 0 <= first < size
            k = by_offset.get(b[0]) if shaped and sound else None
            if k is None:
                raise CorruptCheckpointError(f"{url}: manifest blocks entry {str(b)[:80]} of {name!r} names no record")
            item = items[k]
            if first >= item.length:
                raise CorruptCheckpointError(
                    f"{url}: manifest blocks of {name!r} at {item.offset}: first block too long"
                )
            count = (1 if first else 0) + -(-(item.length - first) // size)
            width = len(item.digest)
            if width == 0 or len(b[1]) != count * width:
                raise CorruptCheckpointError(
                    f"{url}: manifest blocks of {name!r} at {item.offset} hold {len(b[1])} hex digits, expected "
                    f"{count} digests of {width}"
                )
            digests = tuple(b[1][j : j + width] for j in range(0, len(b[1]), width))
            items[k] = ItemChecksum(item.offset, item.length, item.digest, digests, first, size)
    return FileChecksums(f["size"], items)


def file_checksums(items: Iterable[tuple[Any, ...]]) -> dict[str, FileChecksums]:
    """Group ``(file, offset, length, digest[, blocks])`` records by file; a file's size is where its last item
    ends."""
    files: dict[str, FileChecksums] = {}
    for name, offset, length, digest, *blocks in items:
        first = blocks[1] if len(blocks) > 1 else 0
        size = blocks[2] if len(blocks) > 2 else 0
        item = ItemChecksum(offset, length, digest, tuple(blocks[0]) if blocks else (), first, size)
        files.setdefault(name, FileChecksums(0)).items.append(item)
    for f in files.values():
        f.items.sort(key=lambda i: i.offset)
        f.size = max((i.end for i in f.items), default=0)
    return files


def manifest_bytes(transport: Any, root: str) -> bytes | None:
    """The raw ``.dcp_storage.json`` of the checkpoint at ``root`` (size-limited), ``None`` when it has none.

    The one read of the manifest file: a load parses and checks what it returns
    (``formats.dcp_native.manifest_io.read_checked_manifest``), format detection reads its format from it
    (:func:`missing_format_plugin`), and the extension registry's hints read the writer's name from it."""
    try:
        return bytes(read_limited(transport, transport.join(root, MANIFEST_FILE), MANIFEST))
    except (CheckpointNotFoundError, FileNotFoundError):
        return None


def missing_format_plugin(probe: Any, known_formats: Container[str]) -> str | None:
    """A message naming the descriptor and distribution, if the probed directory's format is not registered."""
    if not probe.is_dir or MANIFEST_FILE not in probe.names:
        return None
    try:
        raw = manifest_bytes(probe.transport, probe.path)
        if raw is None:
            return None
        manifest = Manifest.from_json(raw, probe.transport.url(probe.transport.join(probe.path, MANIFEST_FILE)))
    except DcpStorageError:
        return None  # a damaged or unreadable manifest does not decide the format; verify reports it
    if manifest.format_name in known_formats:
        return None
    dist = manifest.format_distribution
    hint = install_hint(dist, what="it") if dist else "install the dcp-storage plugin that provides it"
    return (
        f"{probe.transport.url(probe.path)}: written in format {manifest.format!r} by {manifest.writer}, but no "
        f"installed plugin provides format {manifest.format_name!r}; {hint} (see `dcp-storage plugins`)"
    )


def writer_descriptor() -> str:
    """``dcp-storage/<version>``: the writer recorded in every checkpoint we write."""
    return f"dcp-storage/{__version__}"


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return dict(importlib_metadata.packages_distributions())


def _version(distribution: str) -> str | None:
    try:
        return importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        return None


def distribution_of_module(module: str) -> str | None:
    """The installed distribution that provides top-level package of ``module`` (``None`` if unknown)."""
    top = module.partition(".")[0]
    dists = _packages_distributions().get(top)
    return dists[0] if dists else None


def _registry_distribution(registry_name: str, cls: type) -> str | None:
    target = f"{cls.__module__}:{cls.__qualname__}"
    for info in registry.list("extensions"):
        if info.name == registry_name or info.target == target or info.target is cls:
            return None if info.distribution.startswith("<") else info.distribution
    return None


def format_distribution(name: str) -> str | None:
    """The distribution that registers format ``name`` (``dcp-storage`` for the built-in ones)."""
    return registry.distribution_of("formats", name)


def describe_extension(descriptor: str, extension: Any | None = None) -> ExtensionInfo:
    """An :class:`ExtensionInfo` for ``descriptor``, with distribution and version when they can be found."""
    name = descriptor.partition("/")[0].partition("@")[0]
    dist = None
    if extension is not None:
        cls = extension if isinstance(extension, type) else type(extension)
        dist = _registry_distribution(name, cls) or distribution_of_module(cls.__module__)
    else:
        dist = next(
            (
                i.distribution
                for i in registry.list("extensions")
                if i.name == name and not i.distribution.startswith("<")
            ),
            None,
        )
    return ExtensionInfo(descriptor, dist, _version(dist) if dist else None)
