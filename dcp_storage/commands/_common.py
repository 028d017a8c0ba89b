"""What every subcommand shares: storage options, ``--json`` output, progress bars, usage errors.

Exit codes: 0 ok, 1 failure (an error, or ``verify`` finding problems), 2 usage error (argparse's own, and
:class:`UsageError`). Errors print one line; ``--debug`` shows the traceback (see :func:`dcp_storage.cli.main`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from dcp_storage.errors import DcpStorageError
from dcp_storage.text import unescaped

__all__ = [
    "HelpFormatter",
    "UsageError",
    "add_command",
    "add_common",
    "add_create_bucket",
    "add_json",
    "add_storage_options",
    "as_typed",
    "emit_json",
    "human_bytes",
    "parse_storage_option",
    "progress_bar",
    "storage_options",
]

PROGRESS_DELAY_ENV = "DCP_STORAGE_PROGRESS_DELAY"  # seconds before a bar appears (tests set 0)


class UsageError(DcpStorageError):
    """Bad command-line input found after parsing; ``dcp-storage`` exits with status 2."""


def parse_storage_option(text: str) -> tuple[tuple[str, ...], Any]:
    """``key=value`` -> (key path, value). The value is JSON when it parses as JSON (``true``, ``3``,
    ``{"a": 1}``, ``'"007"'`` for a string of digits), else the raw string; dotted keys nest
    (``client_kwargs.endpoint_url=http://...``)."""
    key, sep, raw = text.partition("=")
    parts = tuple(p.strip() for p in key.split("."))
    if not sep or not key.strip() or any(not p for p in parts):
        shown = f"{key!r}=..." if sep else "an argument without '='"  # never echo a value: it may be a secret
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE (dotted keys nest, e.g. client_kwargs.region_name=x), got {shown}"
        )
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return parts, value


def merge_options(
    pairs: Sequence[tuple[tuple[str, ...], Any]] | None, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Nest ``pairs`` into a dict (over a copy of ``base``); a key both a value and a group is a usage error."""
    out: dict[str, Any] = json.loads(json.dumps(base)) if base else {}
    for parts, value in pairs or ():
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UsageError(f"storage option {'.'.join(parts[: i + 1])} is set to a value and used as a group")
            node = child
        if isinstance(node.get(parts[-1]), dict) and not isinstance(value, dict):
            raise UsageError(f"storage option {'.'.join(parts)} is a group and also set to a value")
        node[parts[-1]] = value
    return out


class HelpFormatter(argparse.HelpFormatter):
    """argparse's wrapping for descriptions; text with line breaks (the examples epilog) kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text:
            return super()._fill_text(text, width, indent)
        return "".join(indent + line for line in text.splitlines(keepends=True))


def add_command(
    sub: Any, name: str, *, help: str, description: str, examples: Sequence[str], **flags: str
) -> argparse.ArgumentParser:
    """A subcommand's parser: ``help`` in the command list, ``description`` and ``examples`` in its ``--help``.

    ``flags`` maps library keywords to this command's flags, for :func:`as_typed` (``format="--format FORMAT"``).
    """
    parser = sub.add_parser(
        name,
        help=help,
        description=description,
        epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
        formatter_class=HelpFormatter,
    )
    parser.set_defaults(flags=flags)
    return parser


def add_create_bucket(parser: argparse.ArgumentParser) -> None:
    """``--create-bucket`` for commands that write: without it a missing output bucket is an error."""
    parser.add_argument(
        "--create-bucket",
        action="store_true",
        help="create the output's bucket (Azure: container) if it does not exist; without it a missing bucket "
        "is an error, so a typo in its name never creates a new one",
    )


def add_storage_options(parser: argparse.ArgumentParser, *, sides: bool = False) -> None:
    group = parser.add_argument_group("storage")
    group.add_argument(
        "-o",
        "--storage-option",
        dest="storage_option",
        action="append",
        type=parse_storage_option,
        metavar="KEY=VALUE",
        help="fsspec storage option for every URL (repeatable; JSON values; dotted keys nest, e.g. "
        "client_kwargs.endpoint_url=http://127.0.0.1:9000)",
    )
    if sides:
        group.add_argument(
            "--src-storage-option",
            action="append",
            type=parse_storage_option,
            metavar="KEY=VALUE",
            help="storage option for the input only (over --storage-option)",
        )
        group.add_argument(
            "--dst-storage-option",
            action="append",
            type=parse_storage_option,
            metavar="KEY=VALUE",
            help="storage option for the output only (over --storage-option)",
        )


def storage_options(args: argparse.Namespace, side: str | None = None) -> dict[str, Any] | None:
    """The storage options for ``side`` (``"src"``/``"dst"``/``None``) from parsed arguments."""
    opts = merge_options(getattr(args, "storage_option", None))
    if side is not None:
        opts = merge_options(getattr(args, f"{side}_storage_option", None), opts)
    return opts or None


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def add_common(parser: argparse.ArgumentParser) -> None:
    """``--debug`` after the subcommand as well as before it."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")


def as_typed(message: str, args: argparse.Namespace) -> str:
    """``message`` with the library's keyword hints (``pass format=...``) spelled as this command's flags.

    A subcommand declares its flags with ``set_defaults(flags={"format": "--format FORMAT"})``; a hint that
    already names the flag (``overwrite=True (--overwrite)``) becomes the flag alone.
    """
    for keyword, flag in (getattr(args, "flags", None) or {}).items():
        pattern = rf"(?<![\w.-]){re.escape(keyword)}=(?:\.\.\.|True)(?: \({re.escape(flag.split()[0])}\))?"
        message = re.sub(pattern, lambda _match, flag=flag: flag, message)
    return message


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # unreachable


def _delay() -> float:
    try:
        return max(0.0, float(os.environ.get(PROGRESS_DELAY_ENV, "1")))
    except ValueError:
        return 1.0


@contextmanager
def progress_bar(desc: str, total: int | None = None) -> Iterator[Any]:
    """A tqdm byte counter on stderr, shown only when stderr is a terminal and the job outlives ~1 s.

    Yields the bar (``bar.total`` may be set later, ``bar.update(n)`` counts bytes); tqdm itself decides
    visibility (``disable=None``: off unless stderr is a TTY; ``delay``: nothing drawn before it). Sizes and
    rates are decimal (kB, MB/s: powers of 1000), the units tqdm's prefixes name. The bar draws with control
    characters, so it writes to the stream under the CLI's escaping one; its text is ours alone.
    """
    from tqdm import tqdm  # when a command runs, not for --help (see dcp_storage.cli)

    bar = tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        file=unescaped(sys.stderr),
        disable=None,
        delay=_delay(),
        leave=False,
        dynamic_ncols=True,
    )
    try:
        yield bar
    finally:
        bar.close()


def set_total(bar: Any, total: int) -> None:
    if not getattr(bar, "disable", True):
        bar.total = total
        bar.refresh()
