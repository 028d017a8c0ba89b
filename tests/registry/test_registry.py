"""Registry: entry-point discovery, lazy import, failure isolation, conflicts, programmatic use."""

from __future__ import annotations

import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from dcp_storage import registry
from dcp_storage.registry import PluginImportError, PluginNotFoundError


def test_builtins_register_through_entry_points() -> None:
    names = {(p.kind, p.name): p for p in registry.list()}
    assert ("formats", "dcp") in names
    assert names[("formats", "dcp")].distribution == "dcp-storage"
    spec = registry.get("formats", "dcp")
    assert spec.descriptor == "dcp/1"


def test_unknown_name_lists_installed() -> None:
    with pytest.raises(PluginNotFoundError, match="installed: .*dcp"):
        registry.get("formats", "no-such-format")


def test_unknown_kind() -> None:
    with pytest.raises(registry.PluginError, match="unknown plugin kind"):
        registry.list("nope")


def test_programmatic_register_and_restore() -> None:
    original = registry.get("formats", "dcp")
    with registry.registered("formats", "dcp", "json:dumps"):
        import json

        assert registry.get("formats", "dcp") is json.dumps
    assert registry.get("formats", "dcp") is original
    with pytest.raises(registry.PluginError, match="already registered"):
        registry.register("formats", "dcp", "json:dumps")


def test_distribution_of_answers_as_the_full_registry_does() -> None:
    """The shortcut for this package's own names (no scan of every distribution) gives what the scan gives,
    for every registered name of every kind, before and after the scan; a name registered by hand is
    nobody's distribution."""
    registry.reload()
    quick = {(k, n): registry.distribution_of(k, n) for k in registry.KINDS for n in ("dcp", "safetensors", "nope")}
    full = {(p.kind, p.name): (None if p.distribution.startswith("<") else p.distribution) for p in registry.list()}
    for (kind, name), dist in quick.items():
        assert dist == full.get((kind, name)), (kind, name)
    assert quick[("formats", "dcp")] == "dcp-storage"
    for (kind, name), dist in full.items():
        assert registry.distribution_of(kind, name) == dist
    with registry.registered("formats", "dcp", "json:dumps"):
        assert registry.distribution_of("formats", "dcp") is None
    assert registry.distribution_of("formats", "dcp") == "dcp-storage"


def _install_fake_distribution(root: Path, dist: str, module: str, entry_points: str, body: str) -> None:
    """A real ``*.dist-info`` with entry points on sys.path: discovered exactly like an installed wheel."""
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    (info / "RECORD").write_text("")


@pytest.fixture
def plugin_path(tmp_path: Path):
    sys.path.insert(0, str(tmp_path))
    registry.reload()
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("fakeplug")]:
            del sys.modules[name]
        registry.reload()


def test_broken_plugin_is_reported_and_isolated(plugin_path: Path) -> None:
    _install_fake_distribution(
        plugin_path,
        "fakeplug-broken",
        "fakeplug_broken",
        """
        [dcp_storage.formats]
        brokenfmt = fakeplug_broken:FORMAT
        """,
        "raise RuntimeError('boom at import')\n",
    )
    _install_fake_distribution(
        plugin_path,
        "fakeplug-good",
        "fakeplug_good",
        """
        [dcp_storage.planners]
        goodplanner = fakeplug_good:PLANNER
        """,
        "PLANNER = 'the planner'\n",
    )
    with pytest.raises(PluginImportError, match="fakeplug-broken.*boom at import"):
        registry.get("formats", "brokenfmt")
    assert registry.get("planners", "goodplanner") == "the planner"
    assert registry.get("formats", "dcp").name == "dcp"  # the core keeps working
    status = {p.name: p for p in registry.list()}
    assert status["brokenfmt"].status == "failed" and "boom at import" in (status["brokenfmt"].error or "")
    assert status["goodplanner"].status == "loaded"


def test_a_distribution_that_only_calls_itself_dcp_storage_does_not_take_a_builtin_name(plugin_path: Path) -> None:
    """Its METADATA names it ``DCP-Storage`` (another spelling of this package's name), from a folder of
    another name, first on sys.path: the built-in entry point is kept, before and after discovery alike."""
    module = plugin_path / "fakeplug_spelled.py"
    module.write_text("FORMAT = 'impostor'\n")
    info = plugin_path / "aaa-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: DCP-Storage\nVersion: 9.9\n")
    (info / "entry_points.txt").write_text("[dcp_storage.formats]\ndcp = fakeplug_spelled:FORMAT\n")
    (info / "RECORD").write_text("")
    before = registry.distribution_of("formats", "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = {p.name: p for p in registry.list("formats")}["dcp"]
    assert before == registry.distribution_of("formats", "dcp") == kept.distribution == "dcp-storage"
    assert registry.get("formats", "dcp").descriptor == "dcp/1"


def test_name_clash_warns_and_prefers_builtin(plugin_path: Path) -> None:
    _install_fake_distribution(
        plugin_path,
        "fakeplug-clash",
        "fakeplug_clash",
        """
        [dcp_storage.formats]
        dcp = fakeplug_clash:FORMAT
        """,
        "FORMAT = 'impostor'\n",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        infos = {p.name: p for p in registry.list("formats")}
    messages = [str(w.message) for w in caught]
    assert any("fakeplug-clash" in m and "dcp-storage" in m for m in messages), messages
    assert infos["dcp"].distribution == "dcp-storage"
