"""``dcp-storage inspect URL``: format, files and a tensor table, from metadata and headers only.

``dcp-storage verify URL [--deep]``: completeness (and with --deep, readability) of a checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from dcp_storage.commands import _common
from dcp_storage.text import printable as shown

if TYPE_CHECKING:
    from dcp_storage.formats.reports import TensorSummary


def add_inspect_parser(sub: Any) -> None:
    p = _common.add_command(
        sub,
        "inspect",
        help="show a checkpoint's format, files and tensors (reads no tensor data)",
        description="Describe the checkpoint at URL: format descriptor, files and sizes, and every tensor (key, dtype, "
        "shape, bytes, the file and byte range of each stored chunk), with totals. Reads metadata and headers only. "
        "Names from the checkpoint are shown with control characters escaped (\\x1b); --json gives them exactly.",
        examples=[
            "dcp-storage inspect ./step-1000",
            "dcp-storage inspect ./model.safetensors --chunks",
            "dcp-storage inspect s3://bucket/step-1000 --json -o client_kwargs.endpoint_url=http://127.0.0.1:9000",
        ],
        format="--format FORMAT",
    )
    p.add_argument("url", metavar="URL", help="checkpoint URL (format detected)")
    p.add_argument("--format", metavar="FORMAT", help="format name (default: detected)")
    p.add_argument("--chunks", action="store_true", help="list every chunk of every tensor")
    _common.add_storage_options(p)
    _common.add_json(p)
    _common.add_common(p)
    p.set_defaults(func=run_inspect)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


_LINES = 4096  # table lines per write
_CACHED = 1 << 16  # distinct shapes, sizes and file lists whose cells are kept


def _cells(summaries: Iterable[TensorSummary]) -> list[tuple[str, ...]]:
    """Each tensor's table cells (every name escaped); a cell repeated across rows is formed once."""
    dtypes: dict[str, str] = {}
    shapes: dict[tuple[int, ...], str] = {}
    sizes: dict[int, str] = {}
    where: dict[tuple[str, ...], str] = {}
    out = []
    for key, dtype, shape, nbytes, files, chunks in summaries:
        d = dtypes.get(dtype)
        if d is None:
            d = dtypes[dtype] = shown(dtype)
        dims = tuple(shape)
        s = shapes.get(dims)
        if s is None:
            s = _shape(dims)
            if len(shapes) < _CACHED:
                shapes[dims] = s
        b = sizes.get(nbytes)
        if b is None:
            b = _common.human_bytes(nbytes)
            if len(sizes) < _CACHED:
                sizes[nbytes] = b
        names = tuple(files)
        f = where.get(names)
        if f is None:
            f = ", ".join(shown(n) for n in names) if names else "-"
            if len(where) < _CACHED:
                where[names] = f
        out.append((shown(key), d, s, b, f, str(chunks)))
    return out


def _print_provenance(prov: dict[str, Any]) -> None:
    if "error" in prov:
        print(f"manifest:   unreadable: {shown(prov['error'])}")
    if "writer" not in prov:
        return
    print(f"written:    {shown(prov['format'])} by {shown(prov['writer'])}")
    exts = []
    for e in prov.get("extensions", []):
        source = " ".join(str(x) for x in (e.get("distribution"), e.get("version")) if x)
        exts.append(shown(e["descriptor"]) + (f" (from {shown(source)})" if source else ""))
    print(f"extensions: {', '.join(exts) if exts else 'none'}")
    sums = prov.get("checksums")
    records = prov.get("checksummed_records", 0)
    print(f"checksums:  {shown(sums)}, {records} records" if sums else "checksums:  none recorded")


def run_inspect(args: argparse.Namespace) -> int:
    from dcp_storage.formats.reports import (
        tensor_summaries,  # imports torch: only when the command runs, never for --help
    )
    from dcp_storage.inspection import describe  # imports torch: only when the command runs, never for --help

    info = describe(args.url, _common.storage_options(args), format=args.format)
    if args.json:
        _common.emit_json(info.as_dict())  # exact names, \uXXXX-escaped by the JSON encoder
        return 0
    # Every name below comes from the checkpoint: each is escaped (shown) as it is printed.
    totals = info.totals
    print(f"checkpoint: {shown(info.url)}")
    print(f"format:     {shown(info.format)} ({shown(info.layout)}) - {shown(info.description)}")
    _print_provenance(info.provenance)
    print(f"files:      {totals['files']}, {_common.human_bytes(totals['file_bytes'])}")
    names = [shown(f.name) for f in info.files]
    width = max([len(n) for n in names] + [4])
    for f, name in zip(info.files, names):
        print(f"  {name:<{width}}  {_common.human_bytes(f.size) if f.size is not None else 'MISSING':>10}")
    print(
        f"tensors:    {totals['tensors']}, {_common.human_bytes(totals['tensor_bytes'])} in {totals['chunks']} chunks"
        + (f"; values: {totals['values']}" if totals["values"] else "")
    )
    rows = [("KEY", "DTYPE", "SHAPE", "BYTES", "FILES", "CHUNKS"), *_cells(tensor_summaries(info.tensors))]
    widths = [max(map(len, column)) for column in zip(*rows)]
    line = "  " + "  ".join(f"{{:<{w}}}" for w in widths)  # each cell left-justified to its column's width
    print(line.format(*rows[0]).rstrip())
    if not args.chunks:
        for start in range(1, len(rows), _LINES):  # a million tensors: a million lines, written in batches
            sys.stdout.write("\n".join([line.format(*r).rstrip() for r in rows[start : start + _LINES]]) + "\n")
    else:
        for t, r in zip(info.tensors, rows[1:]):
            print(line.format(*r).rstrip())
            for c in t.chunks:
                file = shown(c.file) if c.file else "-"
                where = (
                    f"{file} [{c.offset}, {c.offset + c.length})"
                    if c.file and c.offset is not None and c.length is not None
                    else file
                )
                print(f"      at {_shape(c.offsets)} size {_shape(c.sizes)}: {where}")
    for v in info.values:
        where = f" in {shown(v.file)}" if v.file else ""
        print(f"  value {shown(v.key)}{where}")
    return 0


def add_verify_parser(sub: Any) -> None:
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
    p.set_defaults(func=run_verify)


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


def run_verify(args: argparse.Namespace) -> int:
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


def add_parsers(sub: Any) -> None:
    """``inspect`` and ``verify``: the two commands that read a checkpoint and report on it."""
    add_inspect_parser(sub)
    add_verify_parser(sub)
