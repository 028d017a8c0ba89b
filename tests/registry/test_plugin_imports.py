"""Plugins import dcp-storage through ``dcp_storage.plugin_api`` only.

Every module of the in-tree plugins (``plugins/*/``, their tests included) and every file of the
``dcp-storage plugin new`` template is parsed, and each import of a ``dcp_storage`` module is checked:

* plugin code: ``dcp_storage.plugin_api`` only;
* tests and test support (``tests/``, ``test_*``, ``testing.py``, ``_rank_checks.py``): also the public
  top-level names (``from dcp_storage import FsspecReader``, those in ``dcp_storage.__all__``) and
  ``dcp_storage_testing``, the support the project ships for plugin tests.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import dcp_storage

REPO = Path(__file__).resolve().parents[2]
PLUGINS = sorted(p for p in (REPO / "plugins").iterdir() if (p / "pyproject.toml").is_file())
TEMPLATE = REPO / "dcp_storage" / "plugin_template"
TEST_SUPPORT = {"testing.py", "_rank_checks.py", "conftest.py"}
# White-box test imports, each with its reason; nothing else may reach past the plugin API.
ALLOWED = {
    # counts the bytes one resharded slice fetches through the core's item loader
    ("plugins/dcp-storage-zstd/tests/test_zstd_checkpoints.py", "dcp_storage.formats.dcp_native.item_loader"),
}


def _sources() -> list[Path]:
    files = [f for plugin in PLUGINS for f in sorted(plugin.rglob("*.py"))]
    return files + sorted(TEMPLATE.glob("*.py.tmpl"))


def _is_test(path: Path) -> bool:
    return "tests" in path.parts or path.name.startswith("test_") or path.name in TEST_SUPPORT


def _parse(path: Path) -> ast.Module:
    text = path.read_text()
    if path.suffix == ".tmpl":  # string.Template placeholders ($name, $target) -> identifiers
        text = re.sub(r"\$(\w+)", r"tmpl_\1", text)
    return ast.parse(text, str(path))


def violations(path: Path, root: Path = REPO) -> list[str]:
    """``file:line: import`` for every import of dcp-storage that ``path`` may not make."""
    test = _is_test(path)
    bad = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            modules = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [(node.module, [alias.name for alias in node.names])]
        else:
            continue
        for module, names in modules:
            if module != "dcp_storage" and not module.startswith("dcp_storage."):
                continue
            if module == "dcp_storage.plugin_api":
                continue
            if test and (module == "dcp_storage_testing" or module.startswith("dcp_storage_testing.")):
                continue
            if test and module == "dcp_storage" and names and set(names) <= set(dcp_storage.__all__):
                continue
            if (str(path.relative_to(root)), module) in ALLOWED:
                continue
            bad.append(f"{path.relative_to(root)}:{node.lineno}: {module} {names or ''}")
    return bad


def test_the_plugins_and_the_template_are_found() -> None:
    names = {p.name for p in PLUGINS}
    assert {"dcp-storage-zstd", "dcp-storage-obstore"} <= names
    assert (TEMPLATE / "transport.py.tmpl").is_file()


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_only_the_plugin_api(path: Path) -> None:
    assert violations(path) == []


def test_the_check_catches_an_internal_import(tmp_path: Path) -> None:
    """The attack: a plugin module reaching into the core is reported, in code and in tests alike."""
    plugin = REPO / "plugins" / "dcp-storage-zstd" / "dcp_storage_zstd" / "extension.py"
    source = (
        plugin.read_text() + "\nfrom dcp_storage.transports.ranges import plan_fetches\nimport dcp_storage.errors\n"
    )
    fake = tmp_path / "plugins" / "x" / "x" / "mod.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(source)
    bad = violations(fake, tmp_path)
    assert len(bad) == 2 and "dcp_storage.transports.ranges" in bad[0] and "dcp_storage.errors" in bad[1]


def test_every_plugin_api_name_resolves() -> None:
    import dcp_storage.plugin_api as api

    for name in api.__all__:
        assert getattr(api, name) is not None, name
