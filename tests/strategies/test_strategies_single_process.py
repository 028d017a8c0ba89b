"""Strategies without a process group: they must behave as the plain reader / a plain call."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcp_storage import Broadcasting, FsspecReader, FsspecWriter
from dcp_storage.errors import CheckpointNotFoundError, DcpStorageError, UnsafeCheckpointError
from dcp_storage.strategies import share_object
from dcp_storage.strategies.collectives import decode_error, encode_error
from dcp_storage.strategies.slice_delivery import canonical_order

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_share_object_without_group_is_a_call() -> None:
    assert share_object(lambda: 41 + 1) == 42
    with pytest.raises(KeyError):  # the original exception, untouched
        share_object(lambda: {}["missing"])
    with pytest.raises(ValueError, match="src_rank"):
        share_object(lambda: 1, src_rank=1)


def test_errors_cross_ranks_as_the_same_class() -> None:
    original = UnsafeCheckpointError("s3://b/k.pt", "os.system", "weights_only refused it")
    info = pickle.loads(pickle.dumps(encode_error(original, rank=0)))
    rebuilt = decode_error(info)
    assert type(rebuilt) is UnsafeCheckpointError
    assert str(rebuilt) == str(original) and rebuilt.forbidden == "os.system" and rebuilt.path == "s3://b/k.pt"

    missing = decode_error(encode_error(CheckpointNotFoundError("s3://b/k: no such file"), rank=3))
    assert isinstance(missing, CheckpointNotFoundError) and isinstance(missing, FileNotFoundError)
    assert str(missing) == "s3://b/k: no such file"

    foreign = decode_error(encode_error(ZeroDivisionError("division by zero"), rank=2))
    assert type(foreign) is DcpStorageError and str(foreign) == "ZeroDivisionError on rank 2: division by zero"

    # A class name from elsewhere is never imported: it is wrapped.
    spoofed = decode_error({"module": "os", "qualname": "system", "message": "x", "attrs": {}, "rank": 0})
    assert type(spoofed) is DcpStorageError


def test_canonical_order_ignores_list_order() -> None:
    def item(fqn: str, off: int) -> ReadItem:
        return ReadItem(
            LoadItemType.TENSOR,
            MetadataIndex(fqn, (off,)),
            torch.Size([off]),
            MetadataIndex(fqn, (0,)),
            torch.Size([off]),
            torch.Size([2]),
        )

    items = [item("b", 0), item("a", 4), item("a", 0)]
    assert canonical_order(items) == canonical_order(list(reversed(items)))
    assert [i.storage_index.fqn for i in canonical_order(items)] == ["a", "a", "b"]


def test_broadcasting_without_group_is_the_inner_reader(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 32), "b": torch.randn(32).to(torch.bfloat16), "step": 3}
    dcp.save(state, storage_writer=FsspecWriter(str(tmp_path / "ckpt")))
    inner = FsspecReader(str(tmp_path / "ckpt"))
    target = {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16), "step": 0}
    reader = Broadcasting(inner)
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"]) and target["step"] == 3
    assert reader.stats["bytes_sent"] == 0 and reader.stats["bytes_local"] > 0 and inner.counters["requests"] > 0
    with pytest.raises(TypeError, match="StorageReader"):
        Broadcasting(object())  # type: ignore[arg-type]
