"""``.metadata`` written by Python versions that pickle enum members as ``getattr(EnumClass, name)``.

Early Python 3.11 releases (Debian 12's system 3.11.2) do; a checkpoint saved there, by torch or by us,
must load, and ``getattr`` must stay refused for anything but an enum member.
"""

from __future__ import annotations

import enum
import io
import pickle
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage.errors import UnsafeCheckpointError
from dcp_storage.formats.dcp_native.native import load_metadata

WHERE = "s3://bucket/ckpt/.metadata"


class _EnumsByName(pickle.Pickler):
    """Pickles enum members the way Python 3.11.2 does: ``getattr(cls, name)``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    _EnumsByName(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


def _metadata() -> Metadata:
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 3]))]
    return Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([4, 3]), chunks)
        },
        storage_data={MetadataIndex("w", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 1200)},
    )


def test_enum_members_pickled_by_name_load() -> None:
    data = _pickle(_metadata())
    assert b"getattr" in data and b"_MEM_FORMAT_ENCODING" in data  # the form this test is about
    assert load_metadata(data, WHERE) == load_metadata(pickle.dumps(_metadata()), WHERE)


@pytest.mark.parametrize(
    "payload",
    [
        (getattr, (object, "__subclasses__")),  # a class from the allow-list, not an enum
        (getattr, (torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING, "no_such_member")),
    ],
)
@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL])  # __builtin__.getattr, builtins.getattr
def test_getattr_is_refused_for_anything_but_an_enum_member(
    payload: tuple[Any, tuple[Any, ...]], protocol: int
) -> None:
    class _Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return payload

    data = pickle.dumps(_Payload(), protocol=protocol)
    with pytest.raises(UnsafeCheckpointError, match=r"s3://bucket/ckpt/\.metadata.*builtins\.getattr.*enum member"):
        load_metadata(data, WHERE)
