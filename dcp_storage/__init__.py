"""dcp-storage: storage backends, formats and planners for ``torch.distributed.checkpoint``.

Drop-in readers and writers for ``dcp.load(sd, storage_reader=...)`` / ``dcp.save(sd, storage_writer=...)``
that work on any fsspec URL (local, ``memory://``, ``s3://``, ``gs://``), read only the bytes each rank
needs, retry transient storage failures, commit atomically and never run code from a checkpoint.
"""

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DcpStorageError,
    IncompleteCheckpointError,
    ShapeMismatchError,
    TransportError,
    NonTensorStateError,
    UnsafeCheckpointError,
    UnsupportedDtypeError,
)
from . import registry
from .opening import UnknownFormatError, detect_format, open_reader, open_writer
from .planners import DtypePolicy, DynamicMetaLoadPlanner, KeyMap, KeyRules, RemappingLoadPlanner
from .storage import FsspecReader, FsspecWriter, SafetensorsReader, SafetensorsWriter
from .storage import BroadcastingTorchSaveReader
from .strategies import Broadcasting, share_object
from .transports import FsspecTransport, RetryPolicy, TransportConfig
from .conversion import ConvertResult, convert, dcp_to_torch_save, merge_fsdp_weights, torch_save_to_dcp
from .inspection import describe, verify
from . import fsdp

__version__ = "0.1.0"

__all__ = [
    "RemappingLoadPlanner",
    "DynamicMetaLoadPlanner",
    "KeyMap",
    "KeyRules",
    "DtypePolicy",
    "FsspecReader",
    "FsspecWriter",
    "SafetensorsReader",
    "SafetensorsWriter",
    "BroadcastingTorchSaveReader",
    "Broadcasting",
    "share_object",
    "FsspecTransport",
    "TransportConfig",
    "RetryPolicy",
    "DcpStorageError",
    "UnsafeCheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CheckpointExistsError",
    "NonTensorStateError",
    "UnsupportedDtypeError",
    "CorruptCheckpointError",
    "ShapeMismatchError",
    "TransportError",
    "registry",
    "fsdp",
    "open_reader",
    "open_writer",
    "detect_format",
    "UnknownFormatError",
    "convert",
    "ConvertResult",
    "dcp_to_torch_save",
    "torch_save_to_dcp",
    "merge_fsdp_weights",
    "describe",
    "verify",
    "__version__",
]
