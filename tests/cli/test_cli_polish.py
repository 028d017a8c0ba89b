"""What a new user meets first: fast ``--help``/``--version``, help that explains each command with examples,
``plugins new`` with only its own options, flags named as typed, and correct units on the progress bar."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ._helpers import REPO, cli_env, run_batch

COMMANDS = ["convert", "merge", "inspect", "verify", "plugins", "plugins list", "plugins new", "demo", "ls", "gc"]

_RUN_AS_MODULE = """
import json, runpy, sys
heavy = ("torch", "numpy", "fsspec", "tqdm", "safetensors")
found = {}
for argv in json.loads(sys.argv[1]):
    sys.argv = ["dcp-storage", *argv]
    try:
        runpy.run_module("dcp_storage.cli", run_name="__main__", alter_sys=True)  # as python -m dcp_storage.cli
    except SystemExit:
        pass
    found[" ".join(argv)] = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
sys.stderr.write(json.dumps(found))
"""


def _helps() -> dict[str, str]:
    results = run_batch([[*c.split(), "--help"] for c in COMMANDS] + [["--help"]])
    assert all(r.rc == 0 for r in results), [str(r) for r in results if r.rc]
    return dict(zip([*COMMANDS, ""], (r.stdout for r in results)))


def test_help_and_version_import_no_torch() -> None:
    """``python -m dcp_storage.cli --help`` (and every command's help, and --version) never imports torch."""
    argvs = [["--help"], ["--version"], *([*c.split(), "--help"] for c in COMMANDS)]
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_AS_MODULE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stderr)
    assert found == {" ".join(a): [] for a in argvs}, found
    assert "usage: dcp-storage" in proc.stdout and "examples:" in proc.stdout
    from dcp_storage import __version__

    assert f"dcp-storage {__version__}\n" in proc.stdout


def test_every_command_explains_itself_with_examples() -> None:
    helps = _helps()
    assert "examples:" in helps[""] and "dcp-storage verify" in helps[""] and "--version" in helps[""]
    for command in COMMANDS:
        text = helps[command]
        description = text.split("\n\n")[1]  # usage, description, arguments..., examples
        assert len(description) > 100, (command, description)
        examples = text.split("examples:\n", 1)[1]
        assert f"  dcp-storage {command} " in examples or f"  dcp-storage {command}\n" in examples, (command, text)
    assert "FSDP2" in helps["demo"] and "S3" in helps["demo"] and "processes that load" in helps["demo"]
    # Every option of every command says what it does.
    from dcp_storage.cli import build_parser

    def parsers(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, argparse.ArgumentParser]]:
        out = [(name, parser)]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    out += parsers(sub, f"{name} {sub_name}".strip())
        return out

    silent = [
        f"{name}: {action.option_strings or action.dest}"
        for name, parser in parsers(build_parser(), "")
        for action in parser._actions
        if action.help is None and not isinstance(action, argparse._SubParsersAction)
    ]
    assert not silent, silent


def test_plugins_new_shows_only_its_own_options(tmp_path: Path) -> None:
    helps = _helps()
    for listing_only in ("--kind", "--strict", "--no-import"):
        assert listing_only not in helps["plugins new"], helps["plugins new"]
        assert listing_only in helps["plugins list"] and listing_only in helps["plugins"]
    assert "--template" in helps["plugins new"] and "--template" not in helps["plugins list"]
    listed, before, kind, made, nameless = run_batch(
        [
            ["plugins", "list", "--json"],
            ["plugins", "--json", "--kind", "formats", "list"],  # options before the action are kept
            ["plugins", "--kind", "formats", "--no-import"],
            ["plugins", "new", "demoplug", "--dir", str(tmp_path), "--json"],
            ["plugins", "new"],
        ]
    )
    assert listed.rc == 0 and {r["kind"] for r in json.loads(listed.stdout)} >= {"formats", "transports"}
    assert before.rc == 0 and {r["kind"] for r in json.loads(before.stdout)} == {"formats"}
    assert kind.rc == 0 and "formats" in kind.stdout and "transports" not in kind.stdout
    assert made.rc == 0 and json.loads(made.stdout)["distribution"] == "dcp-storage-demoplug"
    assert nameless.rc == 2 and "give the plugin's name" in nameless.stderr


def test_messages_name_flags_as_typed(tmp_path: Path, sources: dict[str, Path]) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello, not a checkpoint\n")
    values = tmp_path / "with_values.safetensors"
    inspect, verify, convert, exists, non_tensors = run_batch(
        [
            ["inspect", str(junk)],
            ["verify", str(junk)],
            ["convert", str(junk), str(tmp_path / "out.pt")],
            ["convert", str(sources["dcp"]), str(sources["torch"])],
            ["convert", str(sources["dcp"]), str(values)],
        ]
    )
    assert inspect.rc == 1 and "ass --format FORMAT to choose one" in inspect.stderr, inspect
    assert verify.rc == 1 and "ass --format FORMAT to choose one" in verify.stdout, verify
    assert convert.rc == 1 and "ass --from FORMAT to choose one" in convert.stderr, convert
    assert exists.rc == 1 and "pass --overwrite to replace it" in exists.stderr, exists
    assert non_tensors.rc == 1 and "pass --drop-non-tensors" in non_tensors.stderr, non_tensors
    for r in (inspect, verify, convert, exists, non_tensors):
        assert not re.search(r"\b(format|overwrite|drop_non_tensors)=", r.stdout + r.stderr), r


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_units_are_decimal(monkeypatch: pytest.MonkeyPatch) -> None:
    """tqdm names its prefixes k, M, G: the figures must be powers of 1000 (they were 1024: MiB labelled MB)."""
    from dcp_storage.commands._common import PROGRESS_DELAY_ENV, progress_bar
    from dcp_storage.text import escaped_stdio

    terminal = _Terminal()
    monkeypatch.setenv(PROGRESS_DELAY_ENV, "0")
    monkeypatch.setattr(sys, "stderr", terminal)
    with escaped_stdio(), progress_bar("convert", total=10_000_000) as bar:
        time.sleep(0.05)
        bar.update(3_000_000)
        bar.refresh()
    drawn = terminal.getvalue()
    assert "3.00M/10.0M" in drawn, drawn  # 1024-based would show 2.86M/9.54M
    assert re.search(r"\d MB/s|\dMB/s", drawn), drawn
    assert "\r" in drawn  # the bar draws on the raw stream, not through the CLI's escaping one


def test_lazy_package_exports_everything_it_lists() -> None:
    """``dcp_storage`` imports its public names on first use: the lazy table, ``__all__`` and the names agree."""
    import dcp_storage

    assert set(dcp_storage.__all__) == {name for names in dcp_storage._EXPORTS.values() for name in names}
    assert len(dcp_storage.__all__) <= 25  # what a user needs; the rest lives in its own module
    for name in [*dcp_storage.__all__, "__version__", "fsdp", "registry"]:
        assert getattr(dcp_storage, name) is not None, name
    with pytest.raises(AttributeError):
        dcp_storage.no_such_name  # noqa: B018
