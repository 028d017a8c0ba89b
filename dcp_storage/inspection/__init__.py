"""Looking at checkpoints without loading them: :func:`describe` (``dcp-storage inspect``) and
:func:`verify` (``dcp-storage verify``)."""

from .checks import VerifyReport, verify
from .summary import CheckpointInfo, ChunkInfo, FileInfo, TensorInfo, ValueInfo, describe

__all__ = ["CheckpointInfo", "ChunkInfo", "FileInfo", "TensorInfo", "ValueInfo", "VerifyReport", "describe", "verify"]
