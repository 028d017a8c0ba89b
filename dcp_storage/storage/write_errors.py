"""Write errors as a save reports them: the storage's own error, naming the path, not what torch made of it.

``torch.save`` into a Python stream swallows the stream's ``OSError`` and fails later with ``RuntimeError:
[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598``, which names neither the cause nor
the file. :class:`RecordingWriter` sits between the serializer and the file and keeps the first ``OSError``
the file raised; :func:`write_error` turns a failed write into the error to raise: a full disk or quota
(``ENOSPC``, ``EDQUOT``) as :class:`~dcp_storage.errors.StorageFullError` naming the path and the bytes the
file needed, any other storage error as itself (with the path), anything else unchanged.
"""

from __future__ import annotations

import errno
from typing import Any

from dcp_storage.errors import StorageFullError

__all__ = ["FULL_ERRNOS", "RecordingWriter", "write_error"]

FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)


class RecordingWriter:
    """A pass-through writer that remembers the first ``OSError`` its file raised (``error``)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._raw.write(data)  # type: ignore[no-any-return]
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        try:
            self._raw.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:  # tell, writable, ... of the file
        return getattr(self._raw, name)


def _os_error(exc: BaseException, recorded: OSError | None) -> OSError | None:
    """The storage's error behind ``exc``: the recorded one, else the first ``OSError`` in its chain."""
    if recorded is not None:
        return recorded
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def write_error(
    exc: BaseException, url: str, needed: int | None = None, recorded: OSError | None = None
) -> BaseException:
    """The error to raise for ``exc``, raised while writing ``url`` (a file of about ``needed`` bytes)."""
    if isinstance(exc, StorageFullError):
        return exc
    cause = _os_error(exc, recorded)
    if cause is None:
        return exc
    if cause.errno in FULL_ERRNOS:
        return StorageFullError(url, needed, cause.errno, cause.strerror or str(cause))
    if cause is not exc and not isinstance(exc, OSError):  # torch's RuntimeError hid it: the real one
        return type(cause)(cause.errno, f"{url}: {cause.strerror or cause}")
    return exc
