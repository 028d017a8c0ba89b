"""dcp-storage: storage backends, formats and planners for ``torch.distributed.checkpoint``.

Drop-in readers and writers for ``dcp.load(sd, storage_reader=...)`` / ``dcp.save(sd, storage_writer=...)``
that work on any fsspec URL (local, ``memory://``, ``s3://``, ``gs://``), read only the bytes each rank
needs, retry transient storage failures, commit atomically and never run code from a checkpoint.
"""

from . import fsdp, registry
from .conversion import ConvertResult, convert, dcp_to_torch_save, merge_fsdp_weights, torch_save_to_dcp
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DcpStorageError,
    IncompleteCheckpointError,
    NonTensorStateError,
    ShapeMismatchError,
    TransportError,
    UnknownExtensionError,
    UnsafeCheckpointError,
    UnsupportedDtypeError,
)
from .inspection import describe, verify
from .opening import UnknownFormatError, detect_format, open_reader, open_writer
from .planners import DtypePolicy, DynamicMetaLoadPlanner, KeyMap, KeyRules, RemappingLoadPlanner
from .storage import BroadcastingTorchSaveReader, FsspecReader, FsspecWriter, SafetensorsReader, SafetensorsWriter
from .strategies import Broadcasting, share_object
from .transports import FsspecTransport, RetryPolicy, TransportConfig

__version__ = "0.1.0"

__all__ = [
    "Broadcasting",
    "BroadcastingTorchSaveReader",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ConvertResult",
    "CorruptCheckpointError",
    "DcpStorageError",
    "DtypePolicy",
    "DynamicMetaLoadPlanner",
    "FsspecReader",
    "FsspecTransport",
    "FsspecWriter",
    "IncompleteCheckpointError",
    "KeyMap",
    "KeyRules",
    "NonTensorStateError",
    "RemappingLoadPlanner",
    "RetryPolicy",
    "SafetensorsReader",
    "SafetensorsWriter",
    "ShapeMismatchError",
    "TransportConfig",
    "TransportError",
    "UnknownExtensionError",
    "UnknownFormatError",
    "UnsafeCheckpointError",
    "UnsupportedDtypeError",
    "__version__",
    "convert",
    "dcp_to_torch_save",
    "describe",
    "detect_format",
    "fsdp",
    "merge_fsdp_weights",
    "open_reader",
    "open_writer",
    "registry",
    "share_object",
    "torch_save_to_dcp",
    "verify",
]
