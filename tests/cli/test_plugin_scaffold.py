"""``dcp-storage plugins new``: the generated distributions install with pip and their own tests pass."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_storage.commands.plugins import ScaffoldError, new_plugin

from ._helpers import run_cli

MAX_TRANSPORT_METHODS = 8  # what a transport plugin implements (issue 21): the rest comes from BaseTransport


def test_new_writes_installable_plugins_whose_tests_pass(tmp_path: Path) -> None:
    made = run_cli("plugins", "new", "vaultblob", "--dir", str(tmp_path), "--json")
    assert made.rc == 0, made
    info = json.loads(made.stdout)
    assert info["distribution"] == "dcp-storage-vaultblob"
    assert info["entry_point"] == "vaultblob = dcp_storage_vaultblob.transport:VaultblobTransport"
    source = (tmp_path / "dcp-storage-vaultblob" / "dcp_storage_vaultblob" / "transport.py").read_text()
    [cls] = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "VaultblobTransport"]
    assert [ast.unparse(b) for b in cls.bases] == ["BaseTransport"], "a real transport on the base, not an alias"
    methods = [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) <= MAX_TRANSPORT_METHODS, methods
    ext = run_cli("plugins", "new", "packz", "--dir", str(tmp_path), "--template", "extension")
    assert ext.rc == 0, ext
    assert "dcp_storage.extensions" in ext.stdout

    # A real pip install (wheel build from the generated pyproject.toml) into a target directory.
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(tmp_path / "dcp-storage-vaultblob"),
            str(tmp_path / "dcp-storage-packz"),
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    listed = run_cli("plugins", "--json", env=env)
    rows = {(r["kind"], r["name"]): r for r in json.loads(listed.stdout)}
    assert rows[("transports", "vaultblob")]["distribution"] == "dcp-storage-vaultblob"
    assert rows[("transports", "vaultblob")]["status"] == "loaded"
    assert rows[("extensions", "packz")]["status"] == "loaded"

    # The transport's suite is the whole conformance suite; its 2-then-3-rank test (a minute under load) runs
    # with DCP_STORAGE_SCAFFOLD_RANKS=1 (the core's tests/conformance runs it on every shared backend).
    ranks = [] if os.environ.get("DCP_STORAGE_SCAFFOLD_RANKS") else ["-k", "not fsdp2_save_2_ranks"]
    for plugin in ("dcp-storage-vaultblob", "dcp-storage-packz"):
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ranks, "tests"],
            cwd=tmp_path / plugin,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, f"{plugin}:\n{proc.stdout}\n{proc.stderr}"


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
