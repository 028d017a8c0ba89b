"""dcp-storage: storage backends, formats and planners for ``torch.distributed.checkpoint``.

Drop-in readers and writers for ``dcp.load(sd, storage_reader=...)`` / ``dcp.save(sd, storage_writer=...)``
that work on any fsspec URL (local, ``memory://``, ``s3://``, ``gs://``), read only the bytes each rank
needs, retry transient storage failures, commit atomically and never run code from a checkpoint.
"""

from typing import TYPE_CHECKING

from dcp_storage._version import __version__ as __version__
from dcp_storage.registry import lazy_exports as _lazy_exports

# Imported on first use (PEP 562), not here: ``import dcp_storage`` would otherwise import torch (seconds),
# and ``dcp-storage --help`` / ``--version`` must answer at once. Module -> the public names it provides; the
# same names are imported for type checkers below and make up ``__all__``.
_EXPORTS = {
    "dcp_storage.opening": ("open_reader", "open_writer", "load", "save"),
    "dcp_storage.formats.dcp_native.reader": ("FsspecReader",),
    "dcp_storage.formats.dcp_native.writer": ("FsspecWriter",),
    "dcp_storage.formats.safetensors.reader": ("SafetensorsReader",),
    "dcp_storage.formats.safetensors.writer": ("SafetensorsWriter",),
    "dcp_storage.formats.torch_save.reader": ("BroadcastingTorchSaveReader",),
    "dcp_storage.strategies": ("Broadcasting", "ReadStrategies"),
    "dcp_storage.planners": ("DtypePolicy", "DynamicMetaLoadPlanner", "KeyMap"),
    "dcp_storage.transports": ("RetryPolicy", "TransportConfig"),
    "dcp_storage.conversion": ("convert", "merge_fsdp_weights"),
    "dcp_storage.inspection": ("describe", "verify"),
    "dcp_storage.manager": ("CheckpointManager", "KeepPolicy", "TrainState"),
    "dcp_storage.errors": ("CheckpointNotFoundError", "DcpStorageError"),
}
__getattr__, __dir__ = _lazy_exports(
    __name__, {name: module for module, names in _EXPORTS.items() for name in names}, submodules=True
)


if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from dcp_storage.conversion import convert, merge_fsdp_weights
    from dcp_storage.errors import CheckpointNotFoundError, DcpStorageError
    from dcp_storage.formats.dcp_native.reader import FsspecReader
    from dcp_storage.formats.dcp_native.writer import FsspecWriter
    from dcp_storage.formats.safetensors.reader import SafetensorsReader
    from dcp_storage.formats.safetensors.writer import SafetensorsWriter
    from dcp_storage.formats.torch_save.reader import BroadcastingTorchSaveReader
    from dcp_storage.inspection import describe, verify
    from dcp_storage.manager import CheckpointManager, KeepPolicy, TrainState
    from dcp_storage.opening import load, open_reader, open_writer, save
    from dcp_storage.planners import DtypePolicy, DynamicMetaLoadPlanner, KeyMap
    from dcp_storage.strategies import Broadcasting, ReadStrategies
    from dcp_storage.transports import RetryPolicy, TransportConfig

# What a user needs, no more: the tuning configs, error subclasses, prefix strategies, transports and
# conversion helpers live in their own modules (``dcp_storage.errors``, ``dcp_storage.strategies``, ...).
__all__ = [
    "Broadcasting",
    "BroadcastingTorchSaveReader",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "DcpStorageError",
    "DtypePolicy",
    "DynamicMetaLoadPlanner",
    "FsspecReader",
    "FsspecWriter",
    "KeepPolicy",
    "KeyMap",
    "ReadStrategies",
    "RetryPolicy",
    "SafetensorsReader",
    "SafetensorsWriter",
    "TrainState",
    "TransportConfig",
    "convert",
    "describe",
    "load",
    "merge_fsdp_weights",
    "open_reader",
    "open_writer",
    "save",
    "verify",
]
