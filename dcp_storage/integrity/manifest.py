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
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError
from ..formats.paths import MANIFEST_FILE, check_relative

__all__ = ["MANIFEST_FILE", "SCHEMA", "ExtensionInfo", "FileChecksums", "ItemChecksum", "Manifest", "install_hint"]

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
        if self.algorithm is not None:
            doc["checksums"] = {
                "algorithm": self.algorithm,
                "files": {
                    name: {"size": f.size, "items": [[i.offset, i.length, i.digest] for i in f.items]}
                    for name, f in sorted(self.files.items())
                },
            }
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
        sums = doc.get("checksums")
        if sums is not None:
            if not isinstance(sums, dict) or not isinstance(sums.get("algorithm"), str):
                raise CorruptCheckpointError(f"{url}: manifest 'checksums' needs an 'algorithm'")
            manifest.algorithm = sums["algorithm"]
            files = sums.get("files", {})
            if not isinstance(files, dict):
                raise CorruptCheckpointError(f"{url}: manifest 'checksums.files' is not an object")
            for name, f in files.items():
                # A name leaving the checkpoint would have verify hash a file outside it against a digest
                # the manifest chose: a way to test guesses about that file's content.
                check_relative(name, f"{url}: checksums entry")
                manifest.files[name] = _file_entry(f, url, name)
        return manifest


def _list(value: Any, url: str, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{url}: manifest field {name!r} is not a list")
    return value


def _opt_str(doc: Mapping[str, Any], key: str) -> str | None:
    value = doc.get(key)
    return value if isinstance(value, str) else None


def _file_entry(f: Any, url: str, name: str) -> FileChecksums:
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
    return FileChecksums(f["size"], items)


def file_checksums(items: Iterable[tuple[str, int, int, str]]) -> dict[str, FileChecksums]:
    """Group ``(file, offset, length, digest)`` records by file; a file's size is where its last item ends."""
    files: dict[str, FileChecksums] = {}
    for name, offset, length, digest in items:
        files.setdefault(name, FileChecksums(0)).items.append(ItemChecksum(offset, length, digest))
    for f in files.values():
        f.items.sort(key=lambda i: i.offset)
        f.size = max((i.end for i in f.items), default=0)
    return files
