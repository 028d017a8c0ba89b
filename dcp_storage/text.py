"""Text we show: untrusted text made printable, and credentials kept out of it.

Keeping credentials out of what we print: storage-option values, and botocore's debug log records.

``storage_options`` carry secrets (``secret``, ``token``, ``password``, connection strings, account keys).
Nothing in dcp-storage puts option values into a message, a repr or a file; this module is for the few
places that must show options or text that may hold them:

* :func:`redacted_options` - a copy fit to print: secret-looking keys' values replaced by ``"***"``;
* :func:`redact` - ``text`` with given secret values replaced;
* :func:`mask_credentials` - ``text`` with tokens, key ids and authorization headers masked by pattern, and
  the secrets a URL can carry (:func:`redact_urls`);
* :func:`redact_urls` - ``text`` with every secret inside a URL masked: a presigned signature
  (``X-Amz-Signature``, ``X-Goog-Signature``, their credentials and session tokens), an Azure SAS ``sig=``,
  ``token=``, ``key=`` and other secret-looking query parameters, and the password of ``user:pass@host``.
  A checkpoint URL may be presigned, and it is shown in every message that names a file: so every
  library error (:class:`~dcp_storage.errors.DcpStorageError`), ``describe``'s and ``verify``'s reports and
  the CLI's output pass through it;
* :class:`CredentialLogFilter` - botocore logs every signed request at DEBUG level, session token and
  access key id included (``x-amz-security-token:...``, ``Credential=AKIA...``). The filter, installed on
  those loggers by :func:`install_log_redaction` (idempotent; done when :mod:`dcp_storage.transports` is
  imported), masks them by pattern, so a user who turns on DEBUG logging to debug a load does not paste credentials
  into a bug report.

Untrusted text made safe to show: :func:`printable`, and :class:`EscapingStream` for the CLI.

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

The stream also masks the secrets a URL may carry (:func:`~dcp_storage.text.redact_urls`: a presigned
signature, a SAS ``sig=``, a password), in every line the CLI prints, ``--json`` included.

JSON output (``--json``) is not escaped by this module: it carries exact values (a script must be able to
match the stored key), written with ``ensure_ascii`` so that every control and non-ASCII character is a
``\\uXXXX`` escape of the JSON text and no raw control character reaches the terminal.
"""

from __future__ import annotations

import io
import logging
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any, TextIO

__all__ = [
    "CredentialLogFilter",
    "EscapingStream",
    "MASK",
    "escaped_stdio",
    "install_log_redaction",
    "is_secret_key",
    "mask_credentials",
    "printable",
    "printable_lines",
    "redact",
    "redact_urls",
    "redacted_options",
    "scrub_chain",
    "secret_values",
    "unescaped",
]


MASK = "***"
_SECRET_WORDS = (
    "secret",
    "token",
    "password",
    "passwd",
    "credential",
    "connection_string",
    "sas",
    "account_key",
    "private_key",
    "api_key",
    "apikey",
    "auth",
    "session",
)
_SECRET_KEYS = {"key", "access_key", "client_secret"}
# Loggers that print signed requests (aiobotocore reuses botocore's logger names).
# torch's DCP loggers log the ``checkpoint_id`` (a URL, maybe presigned) of every failed load or save, and
# the fsspec clients log each URL they request at DEBUG.
REDACTED_LOGGERS = (
    "botocore.auth",
    "botocore.endpoint",
    "botocore.awsrequest",
    "botocore.httpsession",
    "c10d-NullHandler-dcp_logger",
    "c10d-NullHandler-default",
    "fsspec",
    "fsspec.http",
    "s3fs",
    "gcsfs",
    "adlfs",
)
# Each pattern with a word it cannot match without (lower case): an ASCII text without the word is not
# scanned. torch's checkpoint logger alone sends two records per planner call through the filter (400+ per
# save), at 9 us each when every pattern scanned every record.
_PATTERNS = [
    (re.compile(r"(?i)(x-amz-security-token\s*[:=]\s*)[^\s&'\"]+"), r"\1" + MASK, "x-amz-security-token"),
    (re.compile(r"(?i)('x-amz-security-token'\s*:\s*b?')[^']*"), r"\1" + MASK, "x-amz-security-token"),
    (re.compile(r"(?i)(credential=)[^\s/,'\"&]+"), r"\1" + MASK, "credential="),
    (re.compile(r"(?i)(x-amz-credential=)[^\s&'\"]+"), r"\1" + MASK, "credential="),
    (re.compile(r"(?i)('authorization'\s*:\s*b?')[^']*"), r"\1" + MASK, "authorization"),
]


# A query parameter in a URL (anywhere in a text): ``?name=value`` / ``&name=value`` / ``;name=value``.
# The value stops at a separator, at whitespace or a quote, or at a ``:`` that ends it (``URL: message``).
_QUERY_PARAM = re.compile(r"([?&;])([A-Za-z0-9_.\-]+)=((?:[^&#;:\s'\"<>]|:(?![\s]|$))*)")
# ``scheme://user:password@host``: the password (whatever it holds up to the last ``@`` before the path).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^/\s:@'\"<>]*:)[^/\s'\"<>]*@")
# Query parameters that are secrets although their name has none of _SECRET_WORDS.
_SECRET_PARAMS = {"sig", "signature", "x-amz-signature", "x-goog-signature", "code", "pwd", "pass"}


def redact_urls(text: str) -> str:
    """``text`` with the secrets of any URL in it masked: secret-looking query values and userinfo passwords.

    The rest of the URL stays (scheme, host, path, and harmless parameters such as an expiry), so a message
    still says which file it is about.
    """
    if "=" in text:
        text = _QUERY_PARAM.sub(_mask_param, text)
    if "@" in text:
        text = _USERINFO.sub(r"\1" + MASK + "@", text)
    return text


def _shows_url_secret(exc: BaseException) -> bool:
    text = str(exc)
    return redact_urls(text) != text


def scrub_chain(exc: BaseException) -> None:
    """Mask URL secrets along the chain Python shows of ``exc`` (each ``__cause__``, or ``__context__`` unless
    suppressed): every exception's string arguments and an ``OSError``'s file names are masked in place, and
    one whose text still shows a secret (a client error that formats its URL from other fields, like
    aiohttp's ``ClientResponseError``) is cut off the chain; the error above it already says what it was."""
    seen: set[int] = set()
    above: BaseException | None = None
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        try:
            current.args = tuple(redact_urls(a) if isinstance(a, str) else a for a in current.args)
            for name in ("filename", "filename2"):
                if isinstance(getattr(current, name, None), str):
                    setattr(current, name, redact_urls(getattr(current, name)))
        except (AttributeError, TypeError):  # an exception type with read-only fields: judged by its text below
            pass
        if above is not None and _shows_url_secret(current):
            above.__cause__, above.__suppress_context__ = None, True
            return
        above = current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)


def _mask_param(match: re.Match[str]) -> str:
    name = match.group(2)
    if not match.group(3) or not (name.lower() in _SECRET_PARAMS or is_secret_key(name)):
        return match.group(0)
    return f"{match.group(1)}{name}={MASK}"


def is_secret_key(name: str) -> bool:
    """Whether a storage option named ``name`` holds a credential (``key``, ``secret``, ``token``, ...)."""
    lowered = name.lower()
    return lowered in _SECRET_KEYS or any(word in lowered for word in _SECRET_WORDS)


def redacted_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``options`` with every secret-looking value (nested ones too) replaced by ``MASK``."""
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if isinstance(value, Mapping):
            out[name] = redacted_options(value)
        elif is_secret_key(str(name)) and value is not None:
            out[name] = MASK
        else:
            out[name] = value
    return out


def secret_values(options: Mapping[str, Any] | None) -> list[str]:
    """The string values of ``options``' secret-looking keys (nested too), longest first."""
    found: list[str] = []
    for name, value in (options or {}).items():
        if isinstance(value, Mapping):
            found += secret_values(value)
        elif isinstance(value, str) and value and is_secret_key(str(name)):
            found.append(value)
    return sorted(set(found), key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each of ``secrets`` (non-empty strings) replaced by ``MASK``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return text


def mask_credentials(text: str) -> str:
    """``text`` with session tokens, access key ids, authorization headers and URL secrets masked, by pattern."""
    # Non-ASCII text is scanned by every pattern: (?i) also matches letters that ``lower`` leaves apart
    # (the long s, the Kelvin sign).
    lowered = text.lower() if text.isascii() else None
    for pattern, replacement, word in _PATTERNS:
        if lowered is None or word in lowered:
            text = pattern.sub(replacement, text)
    return redact_urls(text)


class CredentialLogFilter(logging.Filter):
    """Masks session tokens and access key ids in a record's formatted message; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is logging's problem, not ours
            return True
        masked = mask_credentials(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


_FILTER = CredentialLogFilter()


def install_log_redaction(names: Iterable[str] = REDACTED_LOGGERS) -> None:
    """Attach the credential filter to the loggers that print signed requests (once per logger)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, CredentialLogFilter) for f in logger.filters):
            logger.addFilter(_FILTER)


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
