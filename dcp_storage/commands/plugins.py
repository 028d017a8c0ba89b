"""``dcp-storage plugins``: every registry entry, and what failed to import and why.

``dcp-storage plugins new NAME [--template transport|extension|format] [--dir DIR]`` writes a working plugin
distribution to start from (see :mod:`dcp_storage.commands.plugins`).

``dcp-storage plugins new NAME``: write a working plugin distribution to start from.

A plugin is an ordinary distribution with an entry point in one of dcp-storage's groups (see
:mod:`dcp_storage.registry`). The scaffold writes one that already works and is tested, so an author edits
running code instead of filling in blanks:

* ``--template transport``: serves ``NAME://`` URLs from objects kept as files under a root directory: a
  :class:`dcp_storage.plugin_api.BaseTransport` implementing the six store primitives only, whose tests run
  the core's storage conformance suite;
* ``--template extension``: a torch ``StreamTransformExtension`` that deflate-compresses every item, usable by
  ``FsspecWriter(extensions=[...])`` and torch's ``FileSystemWriter(_extensions=[...])``;
* ``--template format``: a ``FormatSpec`` for ``.NAME`` files (magic, JSON header, raw tensors) with its DCP
  ``StorageReader`` and a ``save_file`` writer, detected by ``open_reader`` and read by ``dcp.load``.

The templates are files in ``dcp_storage/plugin_template/`` with ``string.Template`` placeholders.
"""

from __future__ import annotations

import argparse
import re
import shutil
import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dcp_storage.commands import _common
from dcp_storage.errors import DcpStorageError
from dcp_storage.text import printable

__all__ = ["KINDS", "PluginScaffold", "ScaffoldError", "new_plugin"]


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
        "the entry point, code, README, tests). --template transport serves NAME:// URLs from a directory "
        "(a BaseTransport of six store primitives, tested by the conformance suite); --template extension is a deflate stream extension; --template format reads .NAME files (a "
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


# A PEP 508 project name (the distribution is ``dcp-storage-NAME``), a URL scheme and, with ``-`` as ``_``, a
# Python package: lowercase words of letters and digits joined by '-'. Matched whole (``fullmatch``: ``$``
# alone lets a trailing newline through, which wrote an unparsable pyproject.toml).
_NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")
MAX_NAME_CHARS = 64  # the distribution's directory name stays far below any file system's 255-byte limit


class ScaffoldError(DcpStorageError, ValueError):
    """The plugin name or target directory cannot be used."""


@dataclass(frozen=True)
class _Kind:
    group: str
    module: str
    target_suffix: str
    description: str
    usage: str


KINDS: dict[str, _Kind] = {
    "transport": _Kind(
        group="transports",
        module="transport",
        target_suffix="Transport",
        description="A dcp-storage transport serving $name:// URLs from objects kept as files under a root directory.",
        usage=(
            "## Use\n\n```python\nimport torch.distributed.checkpoint as dcp\nfrom dcp_storage import FsspecReader\n\n"
            'opts = {"root": "/mnt/checkpoints"}  # or set $env_var\n'
            'dcp.load(state_dict, storage_reader=FsspecReader("$name://team/run-7/step-100", opts))\n```'
        ),
    ),
    "extension": _Kind(
        group="extensions",
        module="extension",
        target_suffix="Deflate",
        description="A dcp-storage stream extension compressing checkpoint items with deflate.",
        usage=(
            "## Use\n\n```python\nimport torch.distributed.checkpoint as dcp\nfrom dcp_storage import FsspecReader, "
            "FsspecWriter\nfrom $package.$module import $target\n\n"
            'dcp.save(state_dict, storage_writer=FsspecWriter("ckpt", extensions=[$target(level=6)]))\n'
            'dcp.load(state_dict, storage_reader=FsspecReader("ckpt"))  # found again through the entry point\n```'
        ),
    ),
    "format": _Kind(
        group="formats",
        module="format",
        target_suffix="Format",
        description="A dcp-storage checkpoint format: .$name files, detected by open_reader and read by dcp.load.",
        usage=(
            "## Use\n\n```python\nimport torch.distributed.checkpoint as dcp\nimport dcp_storage as ds\n"
            "from $package.$module import save_file\n\n"
            'save_file({"w": tensor}, "s3://bucket/model.$name", storage_options=opts)\n'
            'dcp.load(state_dict, storage_reader=ds.open_reader("s3://bucket/model.$name", storage_options=opts))\n```'
        ),
    ),
}


@dataclass(frozen=True)
class PluginScaffold:
    """What :func:`new_plugin` wrote."""

    root: Path
    distribution: str
    package: str
    group: str
    entry_point: str
    files: tuple[Path, ...]


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[-_]", name))


def new_plugin(name: str, directory: str | Path = ".", kind: str = "transport") -> PluginScaffold:
    """Write the plugin distribution ``dcp-storage-NAME`` into ``directory/dcp-storage-NAME``.

    ``name`` is the registry name (and, for a transport, the URL scheme): lowercase letters and digits,
    words joined by ``-``. The target directory must not exist yet; nothing is overwritten.
    """
    if kind not in KINDS:
        raise ScaffoldError(f"unknown plugin kind {kind!r}; choose one of {sorted(KINDS)}")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ScaffoldError(
            f"plugin name {name!r}: use lowercase letters and digits, words joined by '-' (it becomes a URL scheme "
            "and a Python package name)"
        )
    if len(name) > MAX_NAME_CHARS:
        raise ScaffoldError(
            f"plugin name {name[:20]!r}... has {len(name)} characters; use at most {MAX_NAME_CHARS} (it names the "
            "distribution's directory, its package and a URL scheme)"
        )
    spec = KINDS[kind]
    distribution = f"dcp-storage-{name}"
    package = distribution.replace("-", "_")
    root = Path(directory) / distribution
    if root.exists():
        raise ScaffoldError(f"{root}: already exists; choose another directory or name")
    values = {
        "name": name,
        "kind": kind,
        "distribution": distribution,
        "package": package,
        "group": spec.group,
        "module": spec.module,
        "target": _camel(name) + spec.target_suffix,
        "reader": _camel(name) + "Reader",  # the format template's StorageReader class
        "env_var": f"DCP_STORAGE_{name.upper().replace('-', '_')}_ROOT",
    }
    values["description"] = string.Template(spec.description).substitute(values)
    values["usage"] = string.Template(spec.usage).substitute(values)
    layout = {
        "pyproject.toml.tmpl": Path("pyproject.toml"),
        "README.md.tmpl": Path("README.md"),
        f"{spec.module}.py.tmpl": Path(package) / f"{spec.module}.py",
        f"test_{spec.module}.py.tmpl": Path("tests") / f"test_{spec.module}.py",
    }
    templates = resources.files("dcp_storage") / "plugin_template"
    written = []
    try:
        for template, relative in layout.items():
            text = string.Template((templates / template).read_text(encoding="utf-8")).substitute(values)
            path = root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            written.append(path)
        init = root / package / "__init__.py"
        init.write_text(
            f'"""{values["description"]}"""\n\nfrom .{spec.module} import {values["target"]}\n\n'
            f'__all__ = ["{values["target"]}"]\n',
            encoding="utf-8",
        )
        written.append(init)
    except OSError as exc:  # a read-only or full directory: say where, and leave no half-written plugin
        shutil.rmtree(root, ignore_errors=True)
        raise ScaffoldError(
            f"{root}: cannot write the plugin there ({exc.strerror or exc}); choose another --dir"
        ) from None
    return PluginScaffold(
        root=root,
        distribution=distribution,
        package=package,
        group=f"dcp_storage.{spec.group}",
        entry_point=f"{name} = {package}.{spec.module}:{values['target']}",
        files=tuple(sorted(written)),
    )
