"""``dcp-storage plugins new``: the generated distributions install with pip and their own tests pass."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from dcp_storage.commands.plugins import ScaffoldError, new_plugin

from ._helpers import run_cli
from ._scaffold import Scaffolded

MAX_TRANSPORT_METHODS = 8  # what a transport plugin implements (issue 21): the rest comes from BaseTransport


def test_new_writes_installable_plugins_whose_tests_pass(scaffolded: Scaffolded) -> None:
    """The transport and extension templates (the format one: ``test_plugin_scaffold_format.py``), pip installed
    once with it (``_scaffold.py``)."""
    info = json.loads(scaffolded.made["vaultblob"].stdout)
    assert info["distribution"] == "dcp-storage-vaultblob"
    assert info["entry_point"] == "vaultblob = dcp_storage_vaultblob.transport:VaultblobTransport"
    source = (scaffolded.root / "dcp-storage-vaultblob" / "dcp_storage_vaultblob" / "transport.py").read_text()
    [cls] = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "VaultblobTransport"]
    assert [ast.unparse(b) for b in cls.bases] == ["BaseTransport"], "a real transport on the base, not an alias"
    methods = [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) <= MAX_TRANSPORT_METHODS, methods
    assert "dcp_storage.extensions" in scaffolded.made["packz"].stdout

    rows = {(r["kind"], r["name"]): r for r in json.loads(scaffolded.listed.stdout)}
    assert rows[("transports", "vaultblob")]["distribution"] == "dcp-storage-vaultblob"
    assert rows[("transports", "vaultblob")]["status"] == "loaded"
    assert rows[("extensions", "packz")]["status"] == "loaded"

    for plugin in ("vaultblob", "packz"):
        outcomes = scaffolded.tests[plugin]
        assert outcomes["passed"] and set(outcomes) == {"passed"}, f"{plugin}: {outcomes}\n{scaffolded.pytest_output}"


def test_bad_names_and_existing_directories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ScaffoldError, match="lowercase letters and digits"):
        new_plugin("My_Blob", tmp_path)
    with pytest.raises(ScaffoldError, match="unknown plugin kind"):
        new_plugin("ok", tmp_path, kind="planner")
    new_plugin("ok", tmp_path)
    with pytest.raises(ScaffoldError, match="already exists"):
        new_plugin("ok", tmp_path)
    usage = run_cli("plugins", "new")
    assert usage.rc == 2 and "give the plugin's name" in usage.stderr
    clash = run_cli("plugins", "new", "ok", "--dir", str(tmp_path))
    assert clash.rc == 2 and "already exists" in clash.stderr
