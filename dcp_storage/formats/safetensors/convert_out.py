"""Streaming safetensors output: headers planned from shapes and dtypes, then tensor bytes one at a time.

Every header is known before any tensor is read (it holds only names, dtypes, shapes and offsets), so each
file is written front to back: header, then each tensor's row-major bytes in safetensors' data order. A
file written from the same tensors is byte-identical to ``safetensors.torch.save_file(tensors,
metadata={"format": "pt"})``. Several files are named and indexed like ``save_pretrained``
(``model-00001-of-00002.safetensors`` + ``model.safetensors.index.json``), packed greedily by
``max_shard_size``; the index is written last.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from dcp_storage.errors import CheckpointExistsError, NonTensorStateError, UnsupportedDtypeError
from dcp_storage.formats.paths import INDEX, read_limited
from dcp_storage.formats.safetensors.encode import (
    HeaderEntry,
    as_memoryview,
    encode_header,
    safetensors_order_key,
    tensor_bytes,
    unstorable_keys,
)
from dcp_storage.formats.safetensors.header import safetensors_dtype
from dcp_storage.formats.safetensors.write_plan import (
    TensorSpec,
    index_name,
    pack_files,
    parse_size,
    shard_name,
    single_name,
)
from dcp_storage.formats.spec import ConvertTarget, Fetch, OutTensor, OutValue, WriteDestination, WriteOptions
from dcp_storage.transports.access import make_output_root

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "TARGET",
    "hf_index_json",
    "pack_by_bytes",
    "refuse_unstorable",
    "shard_size",
    "write_safetensors",
]

HEADER_METADATA = {"format": "pt"}
DEFAULT_MAX_SHARD_SIZE = "5GB"  # save_pretrained's default, for directory outputs


def shard_size(options: WriteOptions) -> int:
    """The bytes per output file the options ask for, else save_pretrained's default."""
    return options.max_shard_size if options.max_shard_size is not None else parse_size(DEFAULT_MAX_SHARD_SIZE)


def pack_by_bytes(tensors: Sequence[OutTensor], max_shard_size: int) -> list[list[OutTensor]]:
    """``tensors`` in files of at most ``max_shard_size`` bytes (a larger tensor alone), packed as
    save_pretrained packs shards, for formats whose files hold any dtype (counted by bytes only)."""
    by_key = {t.key: t for t in tensors}
    specs = [TensorSpec(t.key, "U8", (t.nbytes,), 1) for t in tensors]
    return [[by_key[s.fqn] for s in group] for group in pack_files(specs, max_shard_size)]


def refuse_unstorable(tensors: Sequence[OutTensor], values: Sequence[OutValue], options: WriteOptions) -> None:
    """Refuse, before any I/O, what safetensors cannot hold (naming every key)."""
    drop_non_tensors = options.drop_non_tensors
    bad = {t.key: t.dtype for t in tensors if safetensors_dtype(t.dtype) is None}
    if bad:
        raise UnsupportedDtypeError(bad)
    unstorable = unstorable_keys(t.key for t in tensors)
    if unstorable is not None:
        raise unstorable
    if values and not drop_non_tensors:
        raise NonTensorStateError(
            [v.key for v in values],
            fix="pass drop_non_tensors=True (--drop-non-tensors) to leave them out, or convert to dcp or torch",
        )


def hf_index_json(total_size: int, weight_map: Mapping[str, str]) -> bytes:
    """An HF index as ``save_pretrained`` formats it (sorted keys, 2-space indent, trailing newline)."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _old_index_files(dest: WriteDestination, index_path: str) -> set[str]:
    try:
        doc = json.loads(read_limited(dest.transport, index_path, INDEX))
        return {str(f) for f in doc.get("weight_map", {}).values() if "/" not in str(f) and ".." not in str(f)}
    except Exception:  # noqa: BLE001 - an unreadable old index: nothing to clean up
        return set()


def write_safetensors(
    dest: WriteDestination,
    tensors: Sequence[OutTensor],
    fetch: Fetch,
    *,
    single_file: bool,
    max_shard_size: int,
    prefix: str = "model",
) -> str:
    """Write ``tensors``; returns the path a reader should open (the file, or the index, or the directory)."""
    transport = dest.transport
    specs = [TensorSpec(t.key, safetensors_dtype(t.dtype) or "", t.shape, t.dtype.itemsize) for t in tensors]
    by_key = {t.key: t for t in tensors}
    if single_file:
        root, only = dest.parent_and_name()
        groups, names = [specs], [only]
        index_path = None
        targets = [dest.path]
    else:
        root = dest.path
        groups = pack_files(specs, max_shard_size)
        n = len(groups)
        names = [single_name(prefix)] if n == 1 else [shard_name(prefix, k + 1, n) for k in range(n)]
        index_path = transport.join(root, index_name(prefix))
        targets = [transport.join(root, single_name(prefix)), index_path]
    existing = [p for p in targets if transport.exists(p)]
    if existing and not dest.overwrite:
        raise CheckpointExistsError(
            f"{dest.url_of(existing[0])}: already exists; pass overwrite=True (--overwrite) to replace it"
        )
    stale: set[str] = set()
    if index_path is not None and transport.exists(index_path):
        stale = _old_index_files(dest, index_path)
        transport.remove(index_path)  # an old index would shadow the new files
    if len(names) > 1 and dest.overwrite and transport.exists(transport.join(root, single_name(prefix))):
        stale.add(single_name(prefix))  # an unsharded file left by an earlier run
    make_output_root(transport, root)

    weight_map: dict[str, str] = {}
    for name, group in zip(names, groups):
        ordered = sorted(group, key=lambda s: safetensors_order_key(s.fqn, s.dtype))
        entries, position = [], 0
        for s in ordered:
            entries.append(HeaderEntry(s.fqn, s.dtype, s.shape, position, position + s.nbytes))
            position += s.nbytes
        header = encode_header(entries, HEADER_METADATA)
        with transport.open_atomic(transport.join(root, name)) as stream:
            stream.write(header)
            for out, tensor in fetch.tensors([by_key[s.fqn] for s in ordered]):
                stream.write(as_memoryview(tensor_bytes(tensor)))
                del tensor
                weight_map[out.key] = name
                dest.advance(out.nbytes)
            size = stream.tell()
        dest.record(name, size)
    if len(names) > 1 and index_path is not None:
        order = [t.key for t in tensors]
        data = hf_index_json(sum(s.nbytes for s in specs), {k: weight_map[k] for k in order})
        transport.write_file(index_path, data)
        dest.record(index_name(prefix), len(data))
    for old in stale - set(names):
        transport.remove(transport.join(root, old))
    if single_file:
        return dest.path
    return index_path if len(names) > 1 and index_path is not None else transport.join(root, names[0])


def _write(
    dest: WriteDestination,
    tensors: Sequence[OutTensor],
    values: Sequence[OutValue],
    fetch: Fetch,
    options: WriteOptions,
) -> tuple[str, list[str]]:
    path = write_safetensors(dest, tensors, fetch, single_file=options.single_file, max_shard_size=shard_size(options))
    return path, [v.key for v in values]  # refuse_unstorable let them through: drop_non_tensors


TARGET = ConvertTarget("safetensors", _write, refuse=refuse_unstorable)
