"""Untrusted text made safe to show: :func:`printable`, and :class:`EscapingStream` for the CLI.

Tensor names, file names, format and extension descriptors, dtype strings and writer names come from the
checkpoint, so from whoever wrote it. Printed verbatim, an ESC or BEL sequence in one of them rewrites the
terminal (a key can clear the screen and print "OK: checkpoint verified"), a CR or a newline forges a line,
and a bidi override (U+202E) shows text in another order than it is stored. Every message this library
forms (errors, ``verify`` reports, warnings, CLI lines) therefore shows such characters escaped, the way
Python's ``repr`` does: ``\\x1b``, ``\\x07``, ``\\r``, ``\\u202e``, ``\\udc80`` for a lone surrogate. The
escaped form is the Python literal of the character, so a user can still find (and type) the key.

What is escaped: every character :meth:`str.isprintable` rejects, which is every C0 and C1 control, DEL,
the format characters (bidi embeddings, overrides and isolates, zero-width characters), line and
paragraph separators, spaces other than U+0020, surrogates, private-use and unassigned code points.
Printable text, any script, passes unchanged. Backslashes are left alone, so escaping is idempotent (an
error message escaped when formed and again when printed reads the same) and Windows paths stay readable;
for an exact, unambiguous spelling of a key use ``repr`` (``{key!r}``), which messages do where they quote
keys.

The stream also masks the secrets a URL may carry (:func:`~dcp_storage.redaction.redact_urls`: a presigned
signature, a SAS ``sig=``, a password), in every line the CLI prints, ``--json`` included.

JSON output (``--json``) is not escaped by this module: it carries exact values (a script must be able to
match the stored key), written with ``ensure_ascii`` so that every control and non-ASCII character is a
``\\uXXXX`` escape of the JSON text and no raw control character reaches the terminal.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, TextIO

from dcp_storage.redaction import redact_urls

__all__ = ["EscapingStream", "escaped_stdio", "printable", "printable_lines", "unescaped"]

_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(ch: str) -> str:
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: object) -> str:
    """``str(text)`` with every non-printable character escaped as in ``repr`` (``\\x1b``, ``\\u202e``)."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable():  # the common case: one C-level scan
        return s
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in s)


def printable_lines(text: str) -> str:
    """As :func:`printable`, but newlines kept: for whole multi-line outputs the program itself formats."""
    if text.isprintable() or text.replace("\n", "").isprintable():  # C-level scans: many lines at once
        return text
    return "\n".join(printable(line) for line in text.split("\n"))


class EscapingStream(io.TextIOBase):
    """A text stream that escapes what :func:`printable_lines` escapes before writing to ``raw``.

    The CLI's last line of defence: ``sys.stdout`` and ``sys.stderr`` are wrapped while a command runs, so
    a message that missed escaping where it was formed (a foreign library's exception, a warning) still
    reaches the terminal harmless. ``raw`` stays reachable for the one writer that draws with control
    characters on purpose (the progress bar).
    """

    def __init__(self, raw: TextIO) -> None:
        super().__init__()
        self.raw = raw

    def write(self, text: str) -> int:
        self.raw.write(printable_lines(redact_urls(text)))  # and no secret of a (presigned) URL is shown
        return len(text)

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.raw.isatty()

    def fileno(self) -> int:
        return self.raw.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.raw, "encoding", None) or "utf-8"

    def __getattr__(self, name: str) -> Any:  # errors, buffer, ... of the wrapped stream
        return getattr(self.raw, name)


def unescaped(stream: TextIO) -> TextIO:
    """The stream under an :class:`EscapingStream` (or ``stream`` itself): for the progress bar's drawing."""
    return stream.raw if isinstance(stream, EscapingStream) else stream


@contextmanager
def escaped_stdio() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` wrapped in :class:`EscapingStream` for the ``with`` block."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (s if isinstance(s, EscapingStream) else EscapingStream(s) for s in saved)
    try:
        yield
    finally:
        for wrapped in (sys.stdout, sys.stderr):
            with suppress(OSError, ValueError):  # a closed pipe (``| head``) or stream: nothing more to say
                wrapped.flush()
        sys.stdout, sys.stderr = saved
