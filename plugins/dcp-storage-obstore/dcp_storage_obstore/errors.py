"""Reading obstore's exceptions: which are worth a retry, and what to tell the user.

obstore raises its own classes (``GenericError`` for most HTTP failures, with the status only in the
message) that derive from ``Exception``, not ``OSError``, so the core's :func:`~dcp_storage.transports.is_transient`
cannot classify them. :func:`is_transient_obstore` adds what it misses; :func:`short_message` trims the
multi-line Rust debug dump that obstore appends, keeping the first line (operation, URL, status).
"""

from __future__ import annotations

import re

from dcp_storage.plugin_api import is_transient

__all__ = [
    "is_not_found",
    "is_not_partial",
    "is_range_mismatch",
    "is_transient_obstore",
    "range_not_satisfiable",
    "short_message",
]

_STATUS_RE = re.compile(r"status(?: code)?:? (\d{3})")
# Connection-level failures as reqwest/hyper word them: the same request may well succeed.
_TRANSIENT_TEXT = (
    "error sending request",
    "error decoding response body",
    "body error",  # "HTTP error: request or response body error": the body was cut short
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "incompletemessage",
    "unexpected eof",
    "timed out",
    "operation timed out",
    "dispatch task is gone",
    "slowdown",
    "reduce your request rate",
)
# object_store's errors for an answer to a ranged GET that is not the range asked for (its client/get.rs):
# a 200, a 206 without or with an unreadable Content-Range, or one naming another range.
_NOT_PARTIAL = "received non-partial response when range requested"
_RANGE_MISMATCH_RE = re.compile(
    r"received non-partial response when range requested|content-range header|content_range header"
    r"|requested \d+\.\.\d+, got \d+\.\.\d+"
)
_PERMANENT_CLASSES = frozenset(
    {
        "NotFoundError",
        "PermissionDeniedError",
        "UnauthenticatedError",
        "InvalidPathError",
        "NotSupportedError",
        "AlreadyExistsError",
        "PreconditionError",
        "NotModifiedError",
        "UnknownConfigurationKeyError",
    }
)


def _is_obstore(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("obstore")


def _status(exc: BaseException) -> int | None:
    match = _STATUS_RE.search(str(exc))
    return int(match.group(1)) if match else None


def is_transient_obstore(exc: BaseException) -> bool:
    """Whether ``exc`` (an obstore error, or anything the core knows) is worth retrying."""
    if _is_obstore(exc):
        if type(exc).__name__ in _PERMANENT_CLASSES:
            return False
        status = _status(exc)
        if status is not None:
            return status >= 500 or status == 429
        text = str(exc).lower()
        return any(marker in text for marker in _TRANSIENT_TEXT)
    return is_transient(exc)


def is_not_found(exc: BaseException) -> bool:
    """obstore raises the builtin ``FileNotFoundError`` (and has a ``NotFoundError`` class) for 404s."""
    return isinstance(exc, FileNotFoundError) or type(exc).__name__ == "NotFoundError"


def is_range_mismatch(exc: BaseException) -> bool:
    """object_store refused an answer to a ranged GET as not the range asked for (status or Content-Range)."""
    return _is_obstore(exc) and _RANGE_MISMATCH_RE.search(str(exc).lower()) is not None


def is_not_partial(exc: BaseException) -> bool:
    """The answer to a ranged GET was a ``200`` (``Range`` ignored): acceptable only for a whole object."""
    return _is_obstore(exc) and _NOT_PARTIAL in str(exc).lower()


def range_not_satisfiable(exc: BaseException) -> bool:
    """S3 answers 416 InvalidRange when a range starts at or past the end of the object."""
    return _status(exc) == 416 or "InvalidRange" in str(exc)


def short_message(exc: BaseException) -> str:
    """``Type: first line`` of an obstore error, without the Rust debug dump and the XML body."""
    text = str(exc).split("\n\nDebug source", 1)[0].strip()
    first = text.splitlines()[0] if text else ""
    first = first.split(": <?xml", 1)[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
