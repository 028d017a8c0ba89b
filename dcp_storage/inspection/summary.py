"""``describe``: what a checkpoint holds and where, from metadata and headers only (no tensor data read).

One :class:`CheckpointInfo` for any format: the format descriptor, the files with their sizes, and a table
of tensors (key, dtype, shape, bytes) with, for each stored chunk, its offsets in the full tensor and the
file and byte range that hold it; non-tensor values likewise. The format describes itself through its
spec's ``describe`` hook (:class:`~dcp_storage.formats.spec.FormatSpec`); a format without one is
described from its reader's ``Metadata`` (file locations unknown).

DCP ``Metadata`` of a model nobody saved: the input :mod:`.request_model` plans loads of at any scale.

:func:`synthetic_transformer` builds what ``dcp.save`` of a Llama-shaped model (70B by default), sharded
``Shard(0)`` over ``save_shards`` ranks, would have recorded: every tensor's chunks, and where each chunk's
record lies in its ``.distcp`` file (records are given estimated header and trailer sizes).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage import registry
from dcp_storage._torch import StorageInfo
from dcp_storage.formats.reports import (
    CheckpointInfo,
    ChunkInfo,
    FileInfo,
    TensorInfo,
    ValueInfo,
    dtype_name,
    tensor_table,
)
from dcp_storage.formats.spec import FormatSpec
from dcp_storage.opening import detect_format
from dcp_storage.runtime import gc_paused

__all__ = [
    "CheckpointInfo",
    "ChunkInfo",
    "FileInfo",
    "RECORD_HEADER",
    "RECORD_TRAILER",
    "TensorInfo",
    "ValueInfo",
    "describe",
    "dtype_name",
    "even_split",
    "synthetic_transformer",
]


def describe_from_reader(url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
    """What any format's reader tells: its ``Metadata`` (tensors, shapes, chunks), no files or byte ranges."""
    reader = spec.open_reader(url, storage_options=storage_options)
    md = reader.read_metadata()
    tensors, values = tensor_table(md, lambda _fqn, _offsets: (None, None, None))
    return CheckpointInfo(url, spec.descriptor, spec.description, spec.name, [], tensors, values)


def resolve_spec(url: str, storage_options: dict[str, Any] | None, format: str | None) -> FormatSpec:
    return registry.get("formats", format) if format is not None else detect_format(url, storage_options)


def describe(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, format: str | None = None
) -> CheckpointInfo:
    """Describe the checkpoint at ``url`` (format detected unless ``format`` names one)."""
    url = os.fspath(url)
    spec = resolve_spec(url, storage_options, format)
    with gc_paused():  # one row object per tensor, millions at a million tensors (see gc_pause)
        return (spec.describe or describe_from_reader)(url, spec, storage_options)


RECORD_TRAILER = 512  # bytes after a record's tensor data (zip central directory), an estimate
RECORD_HEADER = 1024  # bytes before it in a synthetic record


def synthetic_transformer(
    layers: int = 80,
    hidden: int = 8192,
    ffn: int = 28672,
    vocab: int = 128256,
    kv_heads: int = 8,
    heads: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    save_shards: int = 8,
) -> Metadata:
    """DCP metadata of a Llama-shaped model (defaults: 70B) saved ``Shard(0)`` by ``save_shards`` ranks,
    rank ``r`` writing its chunk of every tensor, in order, to ``__r_0.distcp``."""
    kv = hidden // heads * kv_heads
    shapes: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [
            (p + "attention.wq.weight", (hidden, hidden)),
            (p + "attention.wk.weight", (kv, hidden)),
            (p + "attention.wv.weight", (kv, hidden)),
            (p + "attention.wo.weight", (hidden, hidden)),
            (p + "feed_forward.w1.weight", (ffn, hidden)),
            (p + "feed_forward.w2.weight", (hidden, ffn)),
            (p + "feed_forward.w3.weight", (ffn, hidden)),
            (p + "attention_norm.weight", (hidden,)),
            (p + "ffn_norm.weight", (hidden,)),
        ]
    shapes += [("norm.weight", (hidden,)), ("output.weight", (vocab, hidden))]
    props = TensorProperties(dtype=dtype)
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    ends = [0] * save_shards
    for fqn, shape in shapes:
        chunks = []
        for r, (start, rows) in enumerate(even_split(shape[0], save_shards)):
            offsets = torch.Size([start, *([0] * (len(shape) - 1))])
            sizes = torch.Size([rows, *shape[1:]])
            chunks.append(ChunkStorageMetadata(offsets, sizes))
            length = RECORD_HEADER + math.prod(sizes) * dtype.itemsize + RECORD_TRAILER
            storage[MetadataIndex(fqn, offsets)] = StorageInfo(f"__{r}_0.distcp", ends[r], length)
            ends[r] += length
        state[fqn] = TensorStorageMetadata(props, torch.Size(shape), chunks)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """``(start, rows)`` of each non-empty part of ``n`` rows split as evenly as ``Shard(0)`` splits them."""
    step, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        rows = step + (1 if i < extra else 0)
        out.append((start, rows))
        start += rows
    return [(s, r) for s, r in out if r > 0]
