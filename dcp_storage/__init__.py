"""dcp-storage: storage backends, formats and planners for ``torch.distributed.checkpoint``.

Drop-in readers and writers for ``dcp.load(sd, storage_reader=...)`` / ``dcp.save(sd, storage_writer=...)``
that work on any fsspec URL (local, ``memory://``, ``s3://``, ``gs://``), read only the bytes each rank
needs, retry transient storage failures, commit atomically and never run code from a checkpoint.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from dcp_storage._version import __version__

# Imported on first use (PEP 562), not here: ``import dcp_storage`` would otherwise import torch (seconds),
# and ``dcp-storage --help`` / ``--version`` must answer at once. Module -> the public names it defines; the
# same names are imported for type checkers below and listed in ``__all__``.
_EXPORTS = {
    "dcp_storage.conversion": ("ConvertResult", "convert", "dcp_to_torch_save", "merge_fsdp_weights", "torch_save_to_dcp"),
    "dcp_storage.errors": (
        "BucketNotFoundError",
        "CheckpointExistsError",
        "CheckpointNotFoundError",
        "CorruptCheckpointError",
        "DcpStorageError",
        "FileTooLargeError",
        "IncompleteCheckpointError",
        "LocationMismatchError",
        "NonTensorStateError",
        "RankMismatchError",
        "ShapeMismatchError",
        "StorageAccessError",
        "TransportError",
        "UnknownExtensionError",
        "UnsafeCheckpointError",
        "UnsupportedDtypeError",
        "UnsupportedKeyError",
        "WrongFormatError",
        "WrongPathTypeError",
    ),
    # The configs the readers take, one scheme: format-specific ones start with their format's name.
    "dcp_storage.formats.dcp_native.item_loader": ("DcpLoaderConfig",),
    "dcp_storage.formats.safetensors.loader": ("SafetensorsLoaderConfig",),
    "dcp_storage.formats.safetensors.scan": ("SafetensorsScanConfig",),
    "dcp_storage.formats.torch_save.archive": ("TorchSaveArchiveConfig",),
    "dcp_storage.inspection": ("describe", "verify"),
    "dcp_storage.load_save": ("load", "save"),
    "dcp_storage.manager": ("CheckpointManager", "KeepPolicy", "TrainState"),
    "dcp_storage.opening": ("UnknownFormatError", "detect_format", "open_reader", "open_writer"),
    "dcp_storage.planners": ("DtypePolicy", "DynamicMetaLoadPlanner", "KeyMap", "KeyRules", "RemappingLoadPlanner"),
    "dcp_storage.storage": (
        "BroadcastingTorchSaveReader",
        "FsspecReader",
        "FsspecWriter",
        "SafetensorsReader",
        "SafetensorsWriter",
    ),
    "dcp_storage.storage.prefixes": (
        "BinaryPrefixStrategy",
        "DecimalPrefixStrategy",
        "HexPrefixStrategy",
        "PrefixStrategy",
        "RoundRobinPrefixStrategy",
    ),
    "dcp_storage.strategies": ("Broadcasting", "DeliveryConfig", "ReadOnceConfig", "ReadStrategies"),
    # ``Transport`` is the protocol to depend on; ``FsspecTransport`` (the built-in transports' common base, which
    # builds the backend's class) stays exported for existing callers; open transports with ``open_transport``.
    "dcp_storage.transports": ("FsspecTransport", "RetryPolicy", "Transport", "TransportConfig"),
    "dcp_storage.unwrapping": ("unwrap",),
}
_LAZY = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:  # a submodule (``dcp_storage.fsdp``), as the eager imports used to make them attributes
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from dcp_storage import fsdp, registry
    from dcp_storage.conversion import ConvertResult, convert, dcp_to_torch_save, merge_fsdp_weights, torch_save_to_dcp
    from dcp_storage.errors import (
        BucketNotFoundError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        CorruptCheckpointError,
        DcpStorageError,
        FileTooLargeError,
        IncompleteCheckpointError,
        LocationMismatchError,
        NonTensorStateError,
        RankMismatchError,
        ShapeMismatchError,
        StorageAccessError,
        TransportError,
        UnknownExtensionError,
        UnsafeCheckpointError,
        UnsupportedDtypeError,
        UnsupportedKeyError,
        WrongFormatError,
        WrongPathTypeError,
    )
    from dcp_storage.formats.dcp_native.item_loader import DcpLoaderConfig
    from dcp_storage.formats.safetensors.loader import SafetensorsLoaderConfig
    from dcp_storage.formats.safetensors.scan import SafetensorsScanConfig
    from dcp_storage.formats.torch_save.archive import TorchSaveArchiveConfig
    from dcp_storage.inspection import describe, verify
    from dcp_storage.load_save import load, save
    from dcp_storage.manager import CheckpointManager, KeepPolicy, TrainState
    from dcp_storage.opening import UnknownFormatError, detect_format, open_reader, open_writer
    from dcp_storage.planners import DtypePolicy, DynamicMetaLoadPlanner, KeyMap, KeyRules, RemappingLoadPlanner
    from dcp_storage.storage import (
        BroadcastingTorchSaveReader,
        FsspecReader,
        FsspecWriter,
        SafetensorsReader,
        SafetensorsWriter,
    )
    from dcp_storage.storage.prefixes import (
        BinaryPrefixStrategy,
        DecimalPrefixStrategy,
        HexPrefixStrategy,
        PrefixStrategy,
        RoundRobinPrefixStrategy,
    )
    from dcp_storage.strategies import Broadcasting, DeliveryConfig, ReadOnceConfig, ReadStrategies
    from dcp_storage.transports import FsspecTransport, RetryPolicy, Transport, TransportConfig
    from dcp_storage.unwrapping import unwrap


__all__ = [
    "BinaryPrefixStrategy",
    "Broadcasting",
    "BroadcastingTorchSaveReader",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ConvertResult",
    "CorruptCheckpointError",
    "DcpLoaderConfig",
    "DcpStorageError",
    "DecimalPrefixStrategy",
    "DeliveryConfig",
    "DtypePolicy",
    "DynamicMetaLoadPlanner",
    "FileTooLargeError",
    "FsspecReader",
    "FsspecTransport",
    "FsspecWriter",
    "HexPrefixStrategy",
    "IncompleteCheckpointError",
    "KeepPolicy",
    "KeyMap",
    "KeyRules",
    "LocationMismatchError",
    "NonTensorStateError",
    "PrefixStrategy",
    "RankMismatchError",
    "ReadOnceConfig",
    "ReadStrategies",
    "RemappingLoadPlanner",
    "RetryPolicy",
    "RoundRobinPrefixStrategy",
    "SafetensorsLoaderConfig",
    "SafetensorsReader",
    "SafetensorsScanConfig",
    "SafetensorsWriter",
    "ShapeMismatchError",
    "StorageAccessError",
    "TorchSaveArchiveConfig",
    "TrainState",
    "Transport",
    "TransportConfig",
    "TransportError",
    "UnknownExtensionError",
    "UnknownFormatError",
    "UnsafeCheckpointError",
    "UnsupportedDtypeError",
    "UnsupportedKeyError",
    "WrongFormatError",
    "WrongPathTypeError",
    "__version__",
    "convert",
    "dcp_to_torch_save",
    "describe",
    "detect_format",
    "fsdp",
    "load",
    "merge_fsdp_weights",
    "open_reader",
    "open_writer",
    "registry",
    "save",
    "torch_save_to_dcp",
    "unwrap",
    "verify",
]
