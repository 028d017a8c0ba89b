"""``dcp-storage plugins``: every registry entry, and what failed to import and why."""

from __future__ import annotations

import argparse
from typing import Any

from . import _common


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plugins",
        help="list transports, formats, strategies, planners and extensions, with import status",
        description="List every plugin entry (built-in ones register the same way), importing each to report its "
        "status: loaded, or failed with the error.",
    )
    p.add_argument("--kind", choices=["transports", "formats", "strategies", "planners", "extensions"],
                   help="only this kind")
    p.add_argument("--no-import", dest="load", action="store_false", help="list without importing (status: not loaded)")
    p.add_argument("--strict", action="store_true", help="exit 1 if any plugin fails to import")
    _common.add_json(p)
    _common.add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import registry

    entries = registry.list(args.kind)
    if args.load:
        for info in entries:
            try:
                registry.get(info.kind, info.name)
            except registry.PluginImportError:
                pass  # recorded on the entry
        entries = registry.list(args.kind)
    rows = [
        {
            "kind": e.kind,
            "name": e.name,
            "distribution": e.distribution,
            "target": e.target_name,
            "status": e.status,
            "error": e.error,
        }
        for e in entries
    ]
    if args.json:
        _common.emit_json(rows)
    else:
        table = [("KIND", "NAME", "DISTRIBUTION", "STATUS", "TARGET")]
        table += [(r["kind"], r["name"], r["distribution"], r["status"], r["target"]) for r in rows]
        widths = [max(len(str(t[i])) for t in table) for i in range(len(table[0]))]
        for t in table:
            print("  ".join(str(c).ljust(w) for c, w in zip(t, widths)).rstrip())
        for r in rows:
            if r["error"]:
                print(f"failed: {r['kind']}/{r['name']} ({r['distribution']}): {r['error']}")
    failed = [r for r in rows if r["status"] == "failed"]
    return 1 if failed and args.strict else 0
