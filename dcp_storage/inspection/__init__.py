"""Looking at checkpoints without loading them: :func:`describe` (``dcp-storage inspect``) and
:func:`verify` (``dcp-storage verify``)."""

from dcp_storage.inspection.checks import VerifyReport, verify
from dcp_storage.inspection.summary import CheckpointInfo, ChunkInfo, FileInfo, TensorInfo, ValueInfo, describe
from dcp_storage.inspection.unreferenced import remove_unreferenced_files
from dcp_storage.inspection.uploads import PendingUpload, abort_stale_uploads, list_pending_uploads

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
