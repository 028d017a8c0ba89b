"""``dcp-storage verify URL [--deep]``: completeness (and with --deep, readability) of a checkpoint."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dcp_storage.commands import _common
from dcp_storage.text import printable as shown


def add_parser(sub: Any) -> None:
    p = _common.add_command(
        sub,
        "verify",
        help="check a checkpoint is complete (every file, size, header); --deep reads every tensor",
        description="Check that the checkpoint at URL is complete: metadata present, every file present with the size "
        "its records need, headers valid, chunks covering every tensor. --deep also reads every tensor (one at a "
        "time) and checks recorded checksums. An interrupted save (data or temp files without the commit marker) is "
        "reported as an incomplete checkpoint; in-progress multipart uploads under URL are listed (--cleanup aborts "
        "them, and removes data files .metadata does not name). A checkpoint that needs an extension plugin that is "
        "not installed, and one shard of a sharded set whose siblings or index are missing, are problems too. Exits 1 "
        "naming every problem found: whenever a load would fail.",
        examples=[
            "dcp-storage verify ./step-1000",
            "dcp-storage verify ./hf/model.safetensors.index.json --deep",
            "dcp-storage verify s3://bucket/step-1000 --cleanup --older-than 2h -o profile=ml",
        ],
        format="--format FORMAT",
    )
    p.add_argument("url", metavar="URL", help="checkpoint URL (format detected)")
    p.add_argument("--deep", action="store_true", help="also read every tensor and value, and check checksums")
    p.add_argument("--format", metavar="FORMAT", help="format name (default: detected)")
    p.add_argument(
        "--cleanup",
        action="store_true",
        help="first remove what killed saves left: their stale locks (holder gone, or lease run out), their temp "
        "files (local disks; never while a live save holds the lock), the data files a committed checkpoint's "
        ".metadata does not name (a killed overwrite=True save's; only while no save holds the location) and the "
        "in-progress multipart uploads under URL older than --older-than",
    )
    p.add_argument(
        "--older-than",
        metavar="AGE",
        type=_parse_age,
        default=3600.0,
        help="with --cleanup: only uploads started longer ago than this (seconds, or 30m, 2h, 1d; default 1h, as a "
        "younger upload may belong to a save still running; 0: all)",
    )
    _common.add_storage_options(p)
    _common.add_json(p)
    _common.add_common(p)
    p.set_defaults(func=run)


_AGE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _parse_age(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d`` -> seconds."""
    raw = text.strip().lower()
    scale = _AGE_UNITS.get(raw[-1:], None) if raw else None
    try:
        value = float(raw[:-1] if scale is not None else raw) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an age like 90, 30m, 2h or 1d, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"age must be >= 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    from dcp_storage.inspection import abort_stale_uploads, remove_unreferenced_files, verify  # imports torch: only now
    from dcp_storage.inspection.checks import Cleanup, remove_stale_leftovers

    aborted, removed = [], []
    cleaned = Cleanup()
    if args.cleanup:
        cleaned = remove_stale_leftovers(args.url, _common.storage_options(args))
        aborted = abort_stale_uploads(args.url, _common.storage_options(args), older_than=args.older_than)
        removed = remove_unreferenced_files(args.url, _common.storage_options(args))
    with _common.progress_bar("verify") as bar:
        report = verify(
            args.url,
            _common.storage_options(args),
            deep=args.deep,
            format=args.format,
            progress=bar.update,
            on_start=lambda total: _common.set_total(bar, total),
        )
    if args.json:
        out = report.as_dict()
        if args.cleanup:
            out["aborted_uploads"] = [u.url for u in aborted]
            out["removed_files"] = removed
            out["removed"] = cleaned.removed
            out["not_cleaned"] = cleaned.held
        _common.emit_json(out)
    else:
        for name in cleaned.removed:
            why = cleaned.reasons.get(name)
            print(f"removed: {shown(name)}" + (f" (stale: {shown(why)})" if why else ""))
        if cleaned.held is not None:
            print(f"not cleaned: {shown(cleaned.held)}; a running save's files are never removed")
        for upload in aborted:
            print(f"aborted: {shown(upload.describe())}")
        for url in removed:
            print(f"removed: {shown(url)} (a data file .metadata does not name: a killed save's leftover)")
        checked = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in report.checked.items())
        print(f"checkpoint: {shown(report.url)} ({shown(report.format or 'unknown format')})")
        if checked:
            print(f"checked:    {checked}")
        for problem in report.problems:  # escaped by verify() already; flags as typed here
            print(f"PROBLEM: {_common.as_typed(problem, args)}")
        for note in report.notes:
            print(f"note: {_common.as_typed(note, args)}")
        print("OK" if report.ok else f"FAILED: {len(report.problems)} problem(s)")
    if not report.ok:
        print(f"dcp-storage verify: error: {len(report.problems)} problem(s) in {shown(report.url)}", file=sys.stderr)
        return 1
    return 0
