"""Reading and writing DCP's ``.metadata`` file without trusting it.

torch writes ``.metadata`` with ``pickle.dump`` and reads it with ``pickle.load``. We write the same bytes
(so torch's reader loads our checkpoints) but read them with an allow-list: the DCP metadata classes,
``torch.Size``, dtypes, layouts, memory formats, enums (also pickled as ``getattr(enum, name)``) and plain
containers, and what the user registered with ``torch.serialization.add_safe_globals`` /
``safe_globals`` (:mod:`..safe_globals`). Anything else raises
:class:`~dcp_storage.errors.UnsafeCheckpointError` naming the file and the global.
"""

from __future__ import annotations

import collections
import copyreg
import enum
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint.metadata import Metadata

from ...gc_pause import gc_paused
from ...safe_unpickle import StandInRefusal, globals_of, safe_loads
from ..limits import METADATA, read_limited
from ..paths import METADATA_FILE
from ..safe_globals import with_registered_globals
from .metadata_checks import check_metadata

__all__ = [
    "DCP_VERSION",
    "METADATA_FILE",
    "dump_metadata",
    "load_metadata",
    "metadata_allow_list",
    "read_metadata_file",
]

DCP_VERSION = "1.0.0"  # the Metadata.version written: torch's FileSystemWriter's


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


_ALLOWED = metadata_allow_list()


def load_metadata(data: bytes | bytearray | memoryview, path: str) -> Metadata:
    """Decode ``.metadata`` bytes read from ``path``; never runs code from them.

    The decoded object is checked too (:mod:`.metadata_checks`: dtypes, shapes, byte counts, chunk bounds,
    storage entries that stay inside the checkpoint), so every problem is reported here, naming ``path``.
    """
    with gc_paused():  # millions of small acyclic objects at a million tensors (see gc_pause)
        metadata = safe_loads(data, path, with_registered_globals(_ALLOWED), expected=Metadata)
        return check_metadata(metadata, path)


def read_metadata_file(transport: Any, path: str) -> Metadata:
    """Read (at most :data:`~dcp_storage.formats.limits.METADATA` bytes) and decode the ``.metadata`` at ``path``."""
    return load_metadata(read_limited(transport, path, METADATA), transport.url(path))


def dump_metadata(metadata: Metadata) -> bytes:
    """Encode ``metadata`` exactly as torch's ``FileSystemWriter`` does (``pickle.dump``)."""
    return pickle.dumps(metadata)
