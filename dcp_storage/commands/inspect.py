"""``dcp-storage inspect URL``: format, files and a tensor table, from metadata and headers only."""

from __future__ import annotations

import argparse
from typing import Any

from . import _common


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a checkpoint's format, files and tensors (reads no tensor data)",
        description="Describe the checkpoint at URL: format descriptor, files and sizes, and every tensor (key, dtype, "
        "shape, bytes, the file and byte range of each stored chunk), with totals.",
    )
    p.add_argument("url", metavar="URL", help="checkpoint URL (format detected)")
    p.add_argument("--format", metavar="FORMAT", help="format name (default: detected)")
    p.add_argument("--chunks", action="store_true", help="list every chunk of every tensor")
    _common.add_storage_options(p)
    _common.add_json(p)
    _common.add_common(p)
    p.set_defaults(func=run)


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _print_provenance(prov: dict[str, Any]) -> None:
    if "error" in prov:
        print(f"manifest:   unreadable: {prov['error']}")
    if "writer" not in prov:
        return
    print(f"written:    {prov['format']} by {prov['writer']}")
    exts = []
    for e in prov.get("extensions", []):
        source = " ".join(x for x in (e.get("distribution"), e.get("version")) if x)
        exts.append(e["descriptor"] + (f" (from {source})" if source else ""))
    print(f"extensions: {', '.join(exts) if exts else 'none'}")
    sums = prov.get("checksums")
    records = prov.get("checksummed_records", 0)
    print(f"checksums:  {sums}, {records} records" if sums else "checksums:  none recorded")


def run(args: argparse.Namespace) -> int:
    from ..inspection import describe

    info = describe(args.url, _common.storage_options(args), format=args.format)
    if args.json:
        _common.emit_json(info.as_dict())
        return 0
    totals = info.totals
    print(f"checkpoint: {info.url}")
    print(f"format:     {info.format} ({info.layout}) - {info.description}")
    _print_provenance(info.provenance)
    print(f"files:      {totals['files']}, {_common.human_bytes(totals['file_bytes'])}")
    width = max([len(f.name) for f in info.files] + [4])
    for f in info.files:
        print(f"  {f.name:<{width}}  {_common.human_bytes(f.size) if f.size is not None else 'MISSING':>10}")
    print(
        f"tensors:    {totals['tensors']}, {_common.human_bytes(totals['tensor_bytes'])} in {totals['chunks']} chunks"
        + (f"; values: {totals['values']}" if totals["values"] else "")
    )
    rows = [("KEY", "DTYPE", "SHAPE", "BYTES", "FILES", "CHUNKS")]
    for t in info.tensors:
        files = ", ".join(t.files) if t.files else "-"
        rows.append((t.key, t.dtype, _shape(t.shape), _common.human_bytes(t.nbytes), files, str(len(t.chunks))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if args.chunks and r is not rows[0]:
            for c in next(t for t in info.tensors if t.key == r[0]).chunks:
                where = f"{c.file} [{c.offset}, {c.offset + c.length})" if c.file and c.offset is not None and c.length is not None else (c.file or "-")
                print(f"      at {_shape(c.offsets)} size {_shape(c.sizes)}: {where}")
    for v in info.values:
        where = f" in {v.file}" if v.file else ""
        print(f"  value {v.key}{where}")
    return 0
