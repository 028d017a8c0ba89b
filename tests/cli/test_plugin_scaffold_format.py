"""``dcp-storage plugins new NAME --template format``: a format plugin that pip installs, that
``dcp-storage plugins`` lists as loaded, and whose generated tests pass unedited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ._helpers import run_cli


def test_format_template_installs_and_its_tests_pass(tmp_path: Path) -> None:
    made = run_cli("plugins", "new", "x", "--dir", str(tmp_path), "--template", "format", "--json")
    assert made.rc == 0, made
    info = json.loads(made.stdout)
    assert info["group"] == "dcp_storage.formats" and info["entry_point"] == "x = dcp_storage_x.format:XFormat"
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(target), str(tmp_path / "dcp-storage-x")],
        check=True,
        capture_output=True,
        timeout=180,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    listed = run_cli("plugins", "--json", env=env)
    rows = {(r["kind"], r["name"]): r for r in json.loads(listed.stdout)}
    assert rows[("formats", "x")]["distribution"] == "dcp-storage-x"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path / "dcp-storage-x",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "4 passed" in proc.stdout, proc.stdout
