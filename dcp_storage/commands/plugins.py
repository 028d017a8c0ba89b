"""``dcp-storage plugins``: every registry entry, and what failed to import and why.

``dcp-storage plugins new NAME [--template transport|extension|format] [--dir DIR]`` writes a working plugin
distribution to start from (see :mod:`dcp_storage.plugin_scaffold`).
"""

from __future__ import annotations

import argparse
from typing import Any

from dcp_storage.commands import _common
from dcp_storage.text import printable


def _add_list_options(p: argparse.ArgumentParser, *, on_action: bool) -> None:
    """Options of the listing, on ``plugins`` itself and on ``plugins list``. On the action they default to
    SUPPRESS, so ``plugins --json list`` keeps what was given before the action's name."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if on_action else value

    p.add_argument(
        "--kind",
        choices=["transports", "formats", "strategies", "planners", "extensions"],
        default=default(None),
        help="only this kind",
    )
    p.add_argument(
        "--no-import",
        dest="load",
        action="store_false",
        default=default(True),
        help="list without importing (status: not loaded)",
    )
    p.add_argument("--strict", action="store_true", default=default(False), help="exit 1 if any plugin fails to import")
    p.add_argument("--json", action="store_true", default=default(False), help="print the result as JSON on stdout")


def add_parser(sub: Any) -> None:
    p = _common.add_command(
        sub,
        "plugins",
        help="list plugins with their import status, or start a new plugin ('plugins new NAME')",
        description="List every plugin entry (built-in ones register the same way), importing each to report its "
        "status: loaded, or failed with the error ('plugins' alone is 'plugins list'). 'plugins new NAME' writes a "
        "working, tested plugin distribution dcp-storage-NAME to start from.",
        examples=[
            "dcp-storage plugins",
            "dcp-storage plugins --kind extensions --strict",
            "dcp-storage plugins new myblob --template transport",
        ],
    )
    _add_list_options(p, on_action=False)
    _common.add_common(p)
    p.set_defaults(func=run)
    actions = p.add_subparsers(dest="action", metavar="ACTION", title="actions (default: list)", required=False)
    listing = _common.add_command(
        actions,
        "list",
        help="list every plugin entry and its import status (the default)",
        description="List every plugin entry of every kind (transports, formats, strategies, planners, extensions) "
        "with its distribution and target, importing each to report loaded or failed, with the error.",
        examples=["dcp-storage plugins list", "dcp-storage plugins list --kind formats --json"],
    )
    _add_list_options(listing, on_action=True)
    _common.add_common(listing)
    listing.set_defaults(func=run)
    new = _common.add_command(
        actions,
        "new",
        help="write a working plugin distribution dcp-storage-NAME to start from",
        description="Write dcp-storage-NAME/: a plugin distribution that already works and is tested (pyproject with "
        "the entry point, code, README, tests). --template transport serves NAME:// URLs by mounting them on another "
        "fsspec URL; --template extension is a deflate stream extension; --template format reads .NAME files (a "
        "FormatSpec, its StorageReader and a writer). Install it with 'pip install -e "
        "dcp-storage-NAME' and edit from there.",
        examples=["dcp-storage plugins new myblob", "dcp-storage plugins new packz --template extension --dir ~/src"],
    )
    new.add_argument("name", nargs="?", help="the plugin's registry name (and URL scheme), e.g. 'myblob'")
    new.add_argument("--dir", default=".", help="where to create dcp-storage-NAME/ (default: .)")
    new.add_argument(
        "--template",
        dest="template_kind",
        choices=["transport", "extension", "format"],
        default="transport",
        help="what the plugin provides (default: transport)",
    )
    new.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print what was written as JSON")
    _common.add_common(new)
    new.set_defaults(func=_new)


def run(args: argparse.Namespace) -> int:
    from dcp_storage import registry  # imports every plugin it lists: only when listing

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
                print(f"failed: {r['kind']}/{r['name']} ({r['distribution']}): {printable(r['error'])}")
    failed = [r for r in rows if r["status"] == "failed"]
    return 1 if failed and args.strict else 0


def _new(args: argparse.Namespace) -> int:
    from dcp_storage.plugin_scaffold import ScaffoldError, new_plugin  # only when writing a plugin, never for --help

    if not args.name:
        raise _common.UsageError("plugins new: give the plugin's name, e.g. 'dcp-storage plugins new myblob'")
    try:
        made = new_plugin(args.name, args.dir, args.template_kind)
    except ScaffoldError as exc:
        raise _common.UsageError(str(exc)) from None
    if args.json:
        _common.emit_json(
            {
                "root": str(made.root),
                "distribution": made.distribution,
                "package": made.package,
                "group": made.group,
                "entry_point": made.entry_point,
                "files": [str(f) for f in made.files],
            }
        )
    else:
        print(f"created {made.root} ({made.distribution}, entry point [{made.group}] {made.entry_point})")
        print(
            f"next: pip install -e {made.root} && dcp-storage plugins --kind {made.group.split('.')[-1]}"
            f" && python -m pytest {made.root / 'tests'}"
        )
    return 0
