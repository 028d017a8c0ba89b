"""Checkpoints for tests of the column paths: a ``.metadata`` of many kinds of entries, and forcing columns.

``synthetic_checkpoint`` writes a ``.metadata`` as torch's writer lays one out (with data files of the
right sizes, holding zeros: ``describe``, ``inspect`` and planning never read them) for: dtypes of every
family, a 0-d and an empty tensor, tensors sharded in rows (with an empty chunk), in a 2-d grid and with
chunks listed out of order, a non-tensor value, a key with a control character, and records spread over
two files. ``columns_forced`` makes every ``.metadata`` read return lazy metadata over its columns, as
the decoder will for large checkpoints.
"""

from __future__ import annotations

import itertools
import math
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage._torch import StorageInfo
from dcp_storage.formats.columns import columns_from_metadata, columns_of
from dcp_storage.formats.dcp_native.native import lazy_metadata

Box = tuple[list[int], list[int]]

ENTRIES: list[tuple[str, Any, list[int], list[Box] | None]] = [
    ("model.embed.weight", torch.float32, [16, 8], None),
    ("model.layers.0.w", torch.bfloat16, [8, 12], [([0, 0], [4, 12]), ([4, 0], [4, 12])]),
    ("model.layers.0.b", torch.float16, [12], [([0], [5]), ([12], [0]), ([5], [7])]),
    ("model.layers.1.w", torch.float64, [6, 4], [([r, c], [3, 2]) for r, c in itertools.product((0, 3), (0, 2))]),
    ("model.layers.1.b", torch.float32, [10], [([6], [4]), ([0], [6])]),  # chunks listed out of order
    ("model.norm.scale", torch.float32, [], None),
    ("model.ids", torch.int64, [10], None),
    ("model.mask", torch.bool, [7], None),
    ("model.empty", torch.float32, [0, 4], None),
    ("model.q", torch.float8_e4m3fn, [4, 4], None),
    ("step", None, [], None),  # a BYTE_IO value
    ("model.\x1b[2Jodd", torch.int32, [3], None),
    ("extra_state", None, [], None),
]


def synthetic_metadata(entries: list[tuple[str, Any, list[int], list[Box] | None]] = ENTRIES) -> Metadata:
    """The ``Metadata`` of ``entries`` (``dtype`` ``None``: a value); records alternate between two files."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    ends = [0, 0]
    n = 0

    def record(index: MetadataIndex, length: int) -> None:
        nonlocal n
        f = n % 2
        storage[index] = StorageInfo(f"__{f}_0.distcp", ends[f], length)
        ends[f] += length
        n += 1

    for fqn, dtype, shape, boxes in entries:
        if dtype is None:
            state[fqn] = BytesStorageMetadata()
            record(MetadataIndex(fqn), 700)
            continue
        boxes = boxes if boxes is not None else [([0] * len(shape), list(shape))]
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)
        for i, chunk in enumerate(chunks):
            record(MetadataIndex(fqn, chunk.offsets, i), 1024 + math.prod(chunk.sizes) * dtype.itemsize)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def synthetic_checkpoint(root: Path, md: Metadata | None = None) -> Path:
    """``root`` holding ``md`` (default :func:`synthetic_metadata`) and data files as long as it says."""
    md = md if md is not None else synthetic_metadata()
    root.mkdir(parents=True, exist_ok=True)
    ends: dict[str, int] = {}
    for info in md.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in ends.items():
        with open(root / name, "wb") as fh:
            fh.truncate(end)
    (root / ".metadata").write_bytes(pickle.dumps(md))
    return root


def as_columns(md: Metadata) -> Metadata:
    """``md`` as lazy metadata over its columns (it must be regular)."""
    if columns_of(md) is not None:
        return md
    cols = columns_from_metadata(md)
    assert cols is not None, "test metadata must be regular"
    return lazy_metadata(cols)


@contextmanager
def columns_forced(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every ``.metadata`` read (``describe``'s and ``FsspecReader``'s) returns lazy metadata over columns."""
    # imported when forced: the patched modules import the readers, which a test module need not load
    from dcp_storage.formats.dcp_native import reader as fsspec_reader
    from dcp_storage.formats.dcp_native import spec as dcp_describe

    def forced(read: Any) -> Any:
        return lambda *args, **kwargs: as_columns(read(*args, **kwargs))

    with monkeypatch.context() as m:
        m.setattr(dcp_describe, "read_metadata_file", forced(dcp_describe.read_metadata_file))
        m.setattr(fsspec_reader, "read_metadata_file", forced(fsspec_reader.read_metadata_file))
        yield
