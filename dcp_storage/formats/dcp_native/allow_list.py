"""The globals a DCP ``.metadata`` pickle may name, and the stand-ins that replace torch's risky ones.

Shared by the guarded unpickler (:mod:`.metadata_io`) and the native decoder (:mod:`.native_decode`), which
matches globals by module and name against this table and never imports or calls what a file names.
"""

from __future__ import annotations

import collections
import copyreg
import enum
import pathlib
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md

from dcp_storage.safe_unpickle import StandInRefusal, globals_of

__all__ = ["metadata_allow_list"]


def _layout_by_name(name: str) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout`` that only looks names up."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise ValueError(f"unknown torch layout {name!r}")


def _enum_member(cls: Any, name: Any) -> Any:
    """Stand-in for ``builtins.getattr``: only ``getattr(EnumClass, member_name)``.

    Early Python 3.11 releases (Debian 12's 3.11.2 among them; 3.11.7 no longer) pickle an enum member as
    ``getattr(cls, name)`` instead of ``cls(value)``, so ``.metadata`` written there, by torch or by us,
    names ``builtins.getattr`` for DCP's ``_MEM_FORMAT_ENCODING``. ``cls`` comes from the allow-list like every global; anything but a member
    of an allow-listed enum is refused.
    """
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise StandInRefusal("builtins.getattr", f"allowed only for an enum member, not getattr({cls!r}, {name!r})")


def _torch_constants() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout_by_name,
    }
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


def metadata_allow_list() -> dict[tuple[str, str], Any]:
    """Every global a DCP ``.metadata`` pickle may name."""
    allowed = _torch_constants()
    allowed.update(
        globals_of(
            dcp_md,
            [
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            ],
        )
    )
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_fs._StorageInfo
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    # torch's FileSystemWriter records the checkpoint path as a pathlib object in StorageMeta.
    for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    allowed[("builtins", "getattr")] = allowed[("__builtin__", "getattr")] = _enum_member
    allowed[("copyreg", "_reconstructor")] = copyreg._reconstructor
    allowed[("copy_reg", "_reconstructor")] = copyreg._reconstructor
    for name, obj in (
        ("object", object),
        ("set", set),
        ("frozenset", frozenset),
        ("tuple", tuple),
        ("list", list),
        ("dict", dict),
    ):
        allowed[("builtins", name)] = obj
        allowed[("__builtin__", name)] = obj
    return allowed
