"""``dcp-storage verify URL [--deep]``: completeness (and with --deep, readability) of a checkpoint."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import _common


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="check a checkpoint is complete (every file, size, header); --deep reads every tensor",
        description="Check that the checkpoint at URL is complete: metadata present, every file present with the size "
        "its records need, headers valid, chunks covering every tensor. --deep also reads every tensor (one at a "
        "time) and checks recorded checksums. Exits 1 naming every problem found.",
    )
    p.add_argument("url", metavar="URL", help="checkpoint URL (format detected)")
    p.add_argument("--deep", action="store_true", help="also read every tensor and value, and check checksums")
    p.add_argument("--format", metavar="FORMAT", help="format name (default: detected)")
    _common.add_storage_options(p)
    _common.add_json(p)
    _common.add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..inspection import verify

    with _common.progress_bar("verify") as bar:
        report = verify(
            args.url, _common.storage_options(args), deep=args.deep, format=args.format, progress=bar.update,
            on_start=lambda total: _common.set_total(bar, total),
        )
    if args.json:
        _common.emit_json(report.as_dict())
    else:
        checked = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in report.checked.items())
        print(f"checkpoint: {report.url} ({report.format or 'unknown format'})")
        if checked:
            print(f"checked:    {checked}")
        for problem in report.problems:
            print(f"PROBLEM: {problem}")
        for note in report.notes:
            print(f"note: {note}")
        print("OK" if report.ok else f"FAILED: {len(report.problems)} problem(s)")
    if not report.ok:
        print(f"dcp-storage verify: error: {len(report.problems)} problem(s) in {report.url}", file=sys.stderr)
        return 1
    return 0
