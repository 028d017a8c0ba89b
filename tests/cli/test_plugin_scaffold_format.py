"""``dcp-storage plugins new NAME --template format``: a format plugin that pip installs, that
``dcp-storage plugins`` lists as loaded, and whose generated tests pass unedited."""

from __future__ import annotations

import json

from ._scaffold import Scaffolded


def test_format_template_installs_and_its_tests_pass(scaffolded: Scaffolded) -> None:
    """Generated and pip installed with the other templates' plugins, once (``_scaffold.py``)."""
    info = json.loads(scaffolded.made["x"].stdout)
    assert info["group"] == "dcp_storage.formats" and info["entry_point"] == "x = dcp_storage_x.format:XFormat"
    rows = {(r["kind"], r["name"]): r for r in json.loads(scaffolded.listed.stdout)}
    assert rows[("formats", "x")]["distribution"] == "dcp-storage-x"
    assert scaffolded.tests["x"] == {"passed": 4}, f"{scaffolded.tests['x']}\n{scaffolded.pytest_output}"
