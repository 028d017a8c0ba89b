"""``dcp-storage plugins new NAME``: write a working plugin distribution to start from.

A plugin is an ordinary distribution with an entry point in one of dcp-storage's groups (see
:mod:`dcp_storage.registry`). The scaffold writes one that already works and is tested, so an author edits
running code instead of filling in blanks:

* ``--template transport``: serves ``NAME://`` URLs by mounting them on another fsspec URL (``base_url``), a
  factory that opens the base URL's transport through :func:`dcp_storage.plugin_api.open_transport`;
* ``--template extension``: a torch ``StreamTransformExtension`` that deflate-compresses every item, usable by
  ``FsspecWriter(extensions=[...])`` and torch's ``FileSystemWriter(_extensions=[...])``;
* ``--template format``: a ``FormatSpec`` for ``.NAME`` files (magic, JSON header, raw tensors) with its DCP
  ``StorageReader`` and a ``save_file`` writer, detected by ``open_reader`` and read by ``dcp.load``.

The templates are files in ``dcp_storage/plugin_template/`` with ``string.Template`` placeholders.
"""

from __future__ import annotations

import re
import shutil
import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dcp_storage.errors import DcpStorageError

__all__ = ["KINDS", "PluginScaffold", "ScaffoldError", "new_plugin"]

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
        description="A dcp-storage transport serving $name:// URLs from a mounted fsspec base URL.",
        usage=(
            "## Use\n\n```python\nimport torch.distributed.checkpoint as dcp\nfrom dcp_storage import FsspecReader\n\n"
            'opts = {"base_url": "s3://company-checkpoints"}  # or set $env_var\n'
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
        "env_var": f"DCP_STORAGE_{name.upper().replace('-', '_')}_BASE_URL",
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
