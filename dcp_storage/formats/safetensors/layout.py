"""Finding the safetensors blobs of a checkpoint: one file, a directory, an HF index, torch's DCP layouts.

What a URL can point at, and how each is recognised (no guessing beyond this list):

* ``.../x.safetensors``: that one file.
* ``.../model.safetensors.index.json`` (any ``*.json``): a Hugging Face index; its ``weight_map`` names
  the shard files, relative to the index's directory.
* a directory holding ``.metadata``: torch's ``FileSystemWriter(serialization_format=SAFETENSORS)``. The
  ``.distcp`` files are safetensors blobs (after any non-tensor items) and the pickled ``.metadata``,
  read with an allow-list unpickler, says where each one starts.
* a directory holding ``model.safetensors.index.json``: that index.
* any other directory: every ``*.safetensors`` file directly in it. This covers a single HF file and
  torch's ``HuggingFaceStorageWriter``, whose ``save_distributed`` files (``shard-XXXXX-model-...``) carry
  each chunk's position in ``__metadata__``.

Paths are kept relative to the checkpoint root (as DCP's own storage map does) and resolved with
:func:`resolve`. Index entries that would leave the root (``..``, absolute paths, URLs) are refused.
"""

from __future__ import annotations

import json
import os
import posixpath
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata

from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_storage.formats.completeness import raise_if_incomplete
from dcp_storage.formats.dcp_native.lazy_metadata import columns_of
from dcp_storage.formats.dcp_native.metadata_io import METADATA_FILE, read_metadata_file
from dcp_storage.formats.limits import INDEX, read_limited
from dcp_storage.formats.paths import INDEX_FILE, check_relative
from dcp_storage.formats.paths import SAFETENSORS_SUFFIX as SUFFIX
from dcp_storage.formats.safetensors.header import LENGTH_BYTES, MAX_HEADER_BYTES
from dcp_storage.transports import Transport

__all__ = [
    "INDEX_FILE",
    "SUFFIX",
    "Layout",
    "check_relative",
    "discover",
    "looks_like_safetensors",
    "parse_index",
    "resolve",
]


def looks_like_safetensors(head: bytes | bytearray | memoryview, size: int) -> bool:
    """Whether a file of ``size`` bytes starting with ``head`` (at least 9 bytes) looks like safetensors.

    The 8-byte little-endian header length must fit the file and the 100 MiB cap, and the header must
    start with ``{``. Cheap enough for format auto-detection; says nothing about the rest of the header.
    """
    if len(head) < LENGTH_BYTES + 1 or size < LENGTH_BYTES + 2:
        return False
    (length,) = struct.unpack("<Q", bytes(head[:LENGTH_BYTES]))
    return (
        2 <= length <= min(size - LENGTH_BYTES, MAX_HEADER_BYTES)
        and bytes(head[LENGTH_BYTES : LENGTH_BYTES + 1]) == b"{"
    )


@dataclass
class Layout:
    """A discovered checkpoint.

    ``root``: the directory (transport path) that ``files`` and the index entries are relative to.
    ``kind``: ``"file"``, ``"directory"``, ``"index"`` or ``"dcp"``. ``index``: the index's transport path
    and ``weight_map`` (tensor name -> relative file) for ``"index"``. ``dcp_metadata``: the decoded
    ``.metadata`` for ``"dcp"``. ``source_url``: what to name in errors about the layout as a whole (the
    index, the ``.metadata`` file, or the root).
    """

    kind: str
    root: str
    files: list[str]
    source_url: str = ""
    index_path: str | None = None
    weight_map: dict[str, str] = field(default_factory=dict)
    dcp_metadata: Metadata | None = None


def resolve(transport: Transport, root: str, relative: str) -> str:
    """The transport path of ``relative`` under ``root``."""
    if transport.is_local:
        return transport.join(root, relative) if root else relative
    if root in ("", "/"):
        return root + relative
    return transport.join(root, relative)


def _parent(transport: Transport, path: str) -> tuple[str, str]:
    if transport.is_local:
        return os.path.dirname(path), os.path.basename(path)
    stripped = path.rstrip("/")
    head, tail = posixpath.split(stripped)
    if not head and stripped.startswith("/"):
        head = "/"
    return head, tail


def parse_index(data: bytes, index_url: str) -> dict[str, str]:
    """The ``weight_map`` of an HF index (tensor name -> relative file name), validated."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{index_url}: index is not valid JSON ({exc})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{index_url}: index has no 'weight_map' object")
    for tensor, name in weight_map.items():
        check_relative(name, f"{index_url}: weight_map entry {tensor!r}")
    return dict(weight_map)


def discover(transport: Transport, path: str) -> Layout:
    """Work out what ``path`` (a transport path) holds; raises :class:`CheckpointNotFoundError` if nothing."""
    url = transport.url(path)
    if path.endswith(".json"):
        return _index_layout(transport, path)
    if path.endswith(SUFFIX):
        return _single_file(transport, path)
    names = transport.listdir(path)
    raise_if_incomplete(transport, path, names)  # shards without their index: IncompleteCheckpointError
    if not names:
        empty_dir = transport.is_local and os.path.isdir(path)  # what a save killed before its first file leaves
        if transport.exists(path) and not empty_dir:
            return _single_file(transport, path)
        raise CheckpointNotFoundError(f"{url}: {'an empty directory' if empty_dir else 'no such file or directory'}")
    if METADATA_FILE in names:
        return _dcp_layout(transport, path)
    if INDEX_FILE in names:
        return _index_layout(transport, transport.join(path, INDEX_FILE))
    files = sorted(n for n in names if n.endswith(SUFFIX))
    if not files:
        raise CheckpointNotFoundError(
            f"{url}: no *{SUFFIX} files, no {INDEX_FILE} and no {METADATA_FILE} in this directory"
        )
    return Layout("directory", path, files, url)


def _single_file(transport: Transport, path: str) -> Layout:
    root, name = _parent(transport, path)
    return Layout("file", root, [name], transport.url(path))


def _index_layout(transport: Transport, index_path: str) -> Layout:
    url = transport.url(index_path)
    try:
        data = read_limited(transport, index_path, INDEX)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(f"{url}: no such index file") from exc
    weight_map = parse_index(data, url)
    root, _ = _parent(transport, index_path)
    files = sorted(set(weight_map.values()))
    if not files:
        raise CorruptCheckpointError(f"{url}: index's weight_map is empty")
    return Layout("index", root, files, url, index_path=index_path, weight_map=weight_map)


def _dcp_layout(transport: Transport, root: str) -> Layout:
    path = transport.join(root, METADATA_FILE)
    metadata = read_metadata_file(transport, path)
    if metadata.storage_data is None or not isinstance(metadata.storage_data, Mapping):
        raise CorruptCheckpointError(f"{transport.url(path)}: metadata carries no storage map")
    cols = columns_of(metadata)
    if cols is not None:  # views of checked columns: their files, without building every entry
        return Layout(
            "dcp",
            root,
            sorted({cols.files[i] for i in np.unique(cols.file).tolist()}),
            transport.url(path),
            dcp_metadata=metadata,
        )
    files: set[str] = set()
    for index, info in metadata.storage_data.items():
        rel = getattr(info, "relative_path", None)
        files.add(check_relative(rel, f"{transport.url(path)}: storage entry for {index.fqn!r}"))
    return Layout("dcp", root, sorted(files), transport.url(path), dcp_metadata=metadata)
