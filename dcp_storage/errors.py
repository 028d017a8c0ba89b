"""The project's exception hierarchy.

Every error raised on purpose derives from :class:`DcpStorageError`, which derives from
:class:`Exception`, so callers can catch "anything this library refused" in one clause. Subclasses also
derive from the builtin exception that matches their meaning (``FileNotFoundError``, ``FileExistsError``,
``ValueError``, ``OSError``), so code written against builtins keeps working.

Messages name the file, the key and the reason, and where there is one, the fix.
"""

from __future__ import annotations

__all__ = [
    "DcpStorageError",
    "UnsafeCheckpointError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "CorruptCheckpointError",
    "TransportError",
    "ShapeMismatchError",
]


class DcpStorageError(Exception):
    """Base class of every error dcp-storage raises on purpose."""


class UnsafeCheckpointError(DcpStorageError):
    """A checkpoint asked to import or call something outside the allow-list.

    Raised before the payload runs: the unpickler refuses the global instead of resolving it.
    """

    def __init__(self, path: str, forbidden: str, detail: str = "") -> None:
        self.path = path
        self.forbidden = forbidden
        msg = f"{path}: refusing to unpickle forbidden global {forbidden!r}"
        if detail:
            msg += f" ({detail})"
        msg += "; the file may be malicious, nothing from it was executed"
        super().__init__(msg)


class CheckpointNotFoundError(DcpStorageError, FileNotFoundError):
    """A file the checkpoint needs does not exist (metadata, a data file, the checkpoint itself)."""


class CheckpointExistsError(DcpStorageError, FileExistsError):
    """A save would clobber an existing checkpoint and ``overwrite=False`` was asked for."""


class CorruptCheckpointError(DcpStorageError, ValueError):
    """A file exists but its bytes do not match what the metadata promises (truncated, garbled)."""


class TransportError(DcpStorageError, OSError):
    """Storage kept failing after the retry policy gave up; the message names URL, range and attempts."""


class ShapeMismatchError(DcpStorageError, ValueError):
    """A destination tensor does not have the shape the checkpoint says (names the key and both shapes)."""
