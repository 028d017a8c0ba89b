"""``plugins new NAME``: the name is validated whole (issue 20, turn 3).

Before: ``"blob\\n"`` passed the name check (``re.match`` with ``$`` allows a trailing newline) and wrote a
``pyproject.toml`` that does not parse; a 300-character name failed with a bare ``OSError`` (file name too
long). Now both are usage errors (exit 2, one line) and nothing is written.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_storage.commands.plugins import MAX_NAME_CHARS, ScaffoldError, new_plugin

from ._helpers import run_cli


@pytest.mark.parametrize("name", ["blob\n", "blob\nx = 1", "x" * 300, "a" * (MAX_NAME_CHARS + 1), "Blob", "b_lob"])
def test_bad_plugin_names_are_refused_before_anything_is_written(tmp_path: Path, name: str) -> None:
    with pytest.raises(ScaffoldError, match="plugin name"):
        new_plugin(name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_a_name_with_a_newline_or_too_long_in_one_line(tmp_path: Path) -> None:
    for name in ("blob\n", "y" * 300):
        got = run_cli("plugins", "new", name, "--dir", str(tmp_path))
        assert got.rc == 2, got
        assert "plugin name" in got.stderr and len(got.stderr.strip().splitlines()) == 1, got
        assert "Traceback" not in got.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_directory_is_our_error_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ScaffoldError, match="cannot write the plugin there"):
        new_plugin("okname", blocker)


def test_the_longest_allowed_name_works(tmp_path: Path) -> None:
    import tomllib

    made = new_plugin("a" * MAX_NAME_CHARS, tmp_path)
    tomllib.loads((made.root / "pyproject.toml").read_text())
