"""Looking at checkpoints without loading them: :func:`describe` (``dcp-storage inspect``) and
:func:`verify` (``dcp-storage verify``)."""

from dcp_storage.inspection.checks import (
    PendingUpload,
    VerifyReport,
    abort_stale_uploads,
    list_pending_uploads,
    remove_unreferenced_files,
    verify,
)
from dcp_storage.inspection.summary import CheckpointInfo, ChunkInfo, FileInfo, TensorInfo, ValueInfo, describe

__all__ = [
    "CheckpointInfo",
    "ChunkInfo",
    "FileInfo",
    "PendingUpload",
    "TensorInfo",
    "ValueInfo",
    "VerifyReport",
    "abort_stale_uploads",
    "describe",
    "list_pending_uploads",
    "remove_unreferenced_files",
    "verify",
]
