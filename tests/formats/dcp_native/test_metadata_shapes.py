"""Shapes in DCP ``.metadata`` and ``torch.save`` views: many huge dimensions are refused at once.

A product of 80,000 factors of 2**62 takes seconds (quadratic) and has more digits than Python converts to
text (a ``ValueError`` while formatting the message, outside our error hierarchy).
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from dcp_storage import FsspecWriter, describe
from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.paths import checked_nbytes

SHAPES = [[2**62] * 80_000, [2**62] * 80_000 + [0]]


@pytest.mark.parametrize("shape", SHAPES, ids=["huge", "with-a-zero"])
def test_metadata_with_a_shape_of_many_huge_dimensions_is_refused_at_once(tmp_path: Path, shape: list[int]) -> None:
    dcp.save({"w": torch.ones(2)}, storage_writer=FsspecWriter(str(tmp_path)), no_dist=True)
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    item = md.state_dict_metadata["w"]
    item.size = torch.Size(shape)
    item.chunks = [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))]
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    start = time.monotonic()
    with pytest.raises(CorruptCheckpointError) as info:
        describe(str(tmp_path))
    assert time.monotonic() - start < 2.0
    assert ".metadata" in str(info.value) and "'w'" in str(info.value) and "dimensions" in str(info.value)
    assert len(str(info.value)) < 1000


@pytest.mark.parametrize("shape", SHAPES, ids=["huge", "with-a-zero"])
def test_checked_nbytes_refuses_many_dimensions_at_once(shape: list[int]) -> None:
    start = time.monotonic()
    with pytest.raises(CorruptCheckpointError) as info:
        checked_nbytes(shape, 4, "model.pt: tensor 'w'")
    assert time.monotonic() - start < 1.0
    assert "model.pt" in str(info.value) and "dimensions" in str(info.value) and len(str(info.value)) < 1000


def _one_entry_under_many_keys(chunks: int, keys: int) -> bytes:
    """One tensor entry of ``chunks`` chunks under ``keys`` names: pickle writes it once, then a memo
    reference per key, so the file is small while the keys list ``chunks * keys`` chunks."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    boxes = [ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(chunks)]
    shared = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([chunks]), boxes)
    return pickle.dumps(Metadata({f"k{j}": shared for j in range(keys)}, storage_data={}))


@pytest.mark.parametrize("decoder", ["off", "native", "python"])
def test_one_entry_under_many_keys_is_refused_at_once(monkeypatch: pytest.MonkeyPatch, decoder: str) -> None:
    """100 KB naming 3 million chunks: refused in well under a second, not checked chunk by chunk (minutes,
    and a message per chunk without a storage entry: gigabytes)."""
    from dcp_storage.formats.dcp_native.native import load_metadata

    monkeypatch.setenv("DCP_STORAGE_METADATA_DECODER", decoder)
    data = _one_entry_under_many_keys(1000, 3000)
    assert len(data) < 100_000
    start = time.monotonic()
    with pytest.raises(CorruptCheckpointError) as info:
        load_metadata(data, "ckpt/.metadata")
    assert time.monotonic() - start < 2.0
    message = str(info.value)
    assert "ckpt/.metadata" in message and "3000000 chunks" in message and len(message) < 1000
