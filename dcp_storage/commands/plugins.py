"""``dcp-storage plugins``: every registry entry, and what failed to import and why.

``dcp-storage plugins new NAME [--template transport|extension] [--dir DIR]`` writes a working plugin
distribution to start from (see :mod:`dcp_storage.plugin_scaffold`).
"""

from __future__ import annotations

import argparse
from typing import Any

from . import _common


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plugins",
        help="list plugins with their import status, or start a new plugin ('plugins new NAME')",
        description="List every plugin entry (built-in ones register the same way), importing each to report its "
        "status: loaded, or failed with the error. 'plugins new NAME' writes a working, tested plugin distribution "
        "dcp-storage-NAME to start from.",
    )
    p.add_argument("action", nargs="?", choices=["list", "new"], default="list", help="list (default) or new")
    p.add_argument("name", nargs="?", help="with 'new': the plugin's registry name (and URL scheme), e.g. 'myblob'")
    p.add_argument("--dir", default=".", help="with 'new': where to create dcp-storage-NAME/ (default: .)")
    p.add_argument("--template", dest="template_kind", choices=["transport", "extension"], default="transport",
                   help="with 'new': what the plugin provides (default: transport)")
    p.add_argument("--kind", choices=["transports", "formats", "strategies", "planners", "extensions"],
                   help="only this kind")
    p.add_argument("--no-import", dest="load", action="store_false", help="list without importing (status: not loaded)")
    p.add_argument("--strict", action="store_true", help="exit 1 if any plugin fails to import")
    _common.add_json(p)
    _common.add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "new":
        return _new(args)
    if args.name is not None:
        raise _common.UsageError(f"unexpected argument {args.name!r} (did you mean 'plugins new {args.name}'?)")
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


def _new(args: argparse.Namespace) -> int:
    from ..plugin_scaffold import ScaffoldError, new_plugin

    if not args.name:
        raise _common.UsageError("plugins new: give the plugin's name, e.g. 'dcp-storage plugins new myblob'")
    try:
        made = new_plugin(args.name, args.dir, args.template_kind)
    except ScaffoldError as exc:
        raise _common.UsageError(str(exc)) from None
    if args.json:
        _common.emit_json({"root": str(made.root), "distribution": made.distribution, "package": made.package,
                           "group": made.group, "entry_point": made.entry_point,
                           "files": [str(f) for f in made.files]})
    else:
        print(f"created {made.root} ({made.distribution}, entry point [{made.group}] {made.entry_point})")
        print(f"next: pip install -e {made.root} && dcp-storage plugins --kind {made.group.split('.')[-1]}"
              f" && python -m pytest {made.root / 'tests'}")
    return 0
