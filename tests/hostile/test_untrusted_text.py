"""Names from a checkpoint never reach a terminal raw: every message, CLI line and JSON value escapes them.

The checkpoints (:mod:`.untrusted_names`) hold keys, file names, dtypes, format, writer and extension
descriptors made of ESC/OSC sequences, BEL, CR, backspace, newlines, C1 controls, bidi overrides and lone
surrogates, in DCP, safetensors, an HF index and ``torch.save`` files. They go through the Python API
(``verify``, ``describe``, ``open_reader`` + ``dcp.load``) and the CLI (``inspect``, ``verify``, ``convert``, in
one batch process and in real processes whose stdout and stderr are pipes). The rules: no character that
``str.isprintable`` rejects in any message or output line, the escaped form of each hostile name shown so
the user can find the key, exact names in ``--json`` output, and valid checkpoints still load bit-exactly.
"""

from __future__ import annotations

import json
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_storage.text import printable

from .untrusted_names import NAMES, Hostile, build_all, raw_controls


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Hostile]:
    return {c.name: c for c in build_all(tmp_path_factory.mktemp("untrusted"))}


def _load(case: Hostile) -> dict[str, Any]:
    """``open_reader`` + ``dcp.load`` into a state dict with the hostile keys; the loaded state."""
    import torch.distributed.checkpoint as dcp

    from dcp_storage import DynamicMetaLoadPlanner, describe, open_reader

    info = describe(case.url)
    dest: dict[str, Any] = {t.key: torch.zeros(t.shape) for t in info.tensors}
    planner = DynamicMetaLoadPlanner() if case.name.startswith("pt-") else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(dest, storage_reader=open_reader(case.url), planner=planner, no_dist=True)
    return dest


def test_printable_escapes_what_rewrites_a_terminal_and_nothing_else() -> None:
    assert printable(NAMES["clear-and-fake-ok"]) == "\\x1b[2J\\x1b[HOK: checkpoint verified\\x07"
    assert printable("a\rb\nc\td\x08\x7f\x9b\u202e\u2066\u200b\u2028\udc80\U000e0001") == (
        "a\\rb\\nc\\td\\x08\\x7f\\x9b\\u202e\\u2066\\u200b\\u2028\\udc80\\U000e0001"
    )
    for plain in ("model.layers.0.weight", "модель.вес", "模型.权重", "C:\\ckpt\\x1b", "café ü 🙂"):
        assert printable(plain) == plain
    for name in NAMES.values():
        once = printable(name)
        assert not raw_controls(once) and printable(once) == once  # idempotent: escaping twice reads the same
        assert once == repr(name)[1:-1]  # the Python literal of the key (no quotes or backslashes in these)


def test_our_errors_escape_their_messages_and_survive_pickling() -> None:
    from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

    key = NAMES["clear-and-fake-ok"]
    for err in (
        CorruptCheckpointError(f"/ckpt/x: tensor {key}: bad"),
        CheckpointNotFoundError(f"/ckpt/{key}: no such file"),
        UnsafeCheckpointError(f"/ckpt/{key}", "os\x1b.system", "detail \x07"),
    ):
        assert not raw_controls(str(err)) and printable(key) in str(err), str(err)
        again = pickle.loads(pickle.dumps(err))  # DCP gathers rank errors by pickle
        assert type(again) is type(err) and str(again) == str(err)
    unsafe = UnsafeCheckpointError(f"/ckpt/{key}", "os.system")
    assert unsafe.path == f"/ckpt/{key}"  # fields stay exact for programs


def test_python_api_escapes_every_message(cases: dict[str, Hostile]) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_storage import describe, verify
    from dcp_storage.errors import DcpStorageError

    failures = []
    for case in cases.values():
        report = verify(case.url, deep=True)
        text = "\n".join(report.problems + report.notes)
        if raw_controls(text, "\n"):
            failures.append(f"{case.name}: verify report holds {raw_controls(text, chr(10))}")
        if report.ok != case.loads:
            failures.append(f"{case.name}: verify ok={report.ok}: {report.problems}")
        if not case.loads and not any(printable(n) in text for n in case.names):
            failures.append(f"{case.name}: no problem names {[printable(n) for n in case.names]}: {text[:300]}")
        for name, call in (("describe", lambda c=case: describe(c.url)), ("load", lambda c=case: _load(c))):
            try:
                call()
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - judged
                if case.loads:
                    failures.append(f"{case.name}: {name} raised {exc!r}")
                inner = exc
                if isinstance(exc, CheckpointException):
                    inner = next(iter(exc.failures.values()))
                    inner = inner[0] if isinstance(inner, tuple) else inner
                if raw_controls(str(exc), "\n"):  # CheckpointException: one traceback per rank, many lines
                    failures.append(f"{case.name}: {name}: raw {raw_controls(str(exc), chr(10))} in {str(exc)[:300]!r}")
                if not isinstance(inner, DcpStorageError):
                    failures.append(f"{case.name}: {name}: not our error: {inner!r}")
                elif name == "describe" and not any(printable(n) in str(inner) for n in case.names):
                    failures.append(f"{case.name}: {name}: the error names no hostile name: {str(inner)[:300]}")
    assert not failures, "\n".join(failures)


def test_valid_hostile_names_load_exactly(cases: dict[str, Hostile]) -> None:
    from dcp_storage import describe

    for case in (cases["dcp-valid"], cases["st-valid"], cases["pt-valid"]):
        keys = {t.key for t in describe(case.url).tensors}
        assert keys >= set(NAMES.values()) - ({NAMES["lone-surrogate"]} if case.name == "st-valid" else set())
        loaded = _load(case)
        for i, name in enumerate(NAMES.values()):
            if name in loaded:
                assert torch.equal(loaded[name], torch.full_like(loaded[name], float(i))), (case.name, name)


def _cli_text_ok(case: Hostile, out: str, failures: list[str], what: str, names: bool = True) -> None:
    if raw_controls(out, "\n"):
        failures.append(f"{case.name} [{what}]: raw {raw_controls(out, chr(10))} in output:\n{out[:400]!r}")
    if names and not any(printable(n) in out for n in case.names):
        failures.append(f"{case.name} [{what}]: no hostile name shown escaped:\n{out[:400]}")


def test_cli_escapes_every_line(cases: dict[str, Hostile], tmp_path: Path) -> None:
    from tests.cli._helpers import run_batch

    # (case, argv, expected exit status: None when it depends on the case, text that must be in the output)
    runs: list[tuple[Hostile, list[str], int | None, str]] = []
    for case in cases.values():
        runs += [
            (case, ["inspect", case.url, "--chunks"], None, ""),
            (case, ["verify", case.url, "--deep"], 0 if case.loads else 1, ""),
            (case, ["inspect", case.url, "--json"], None, ""),
        ]
        if not case.loads:
            runs.append((case, ["verify", case.url, "--json"], 1, ""))
        if case.loads:
            runs.append((case, ["convert", case.url, str(tmp_path / f"{case.name}.pt")], 0, "converted"))
    surrogate = printable(NAMES["lone-surrogate"])
    values = cases["dcp-values"]
    runs += [  # what safetensors cannot hold is refused or left out, named escaped
        (
            cases["dcp-valid"],
            ["convert", cases["dcp-valid"].url, str(tmp_path / "a.safetensors"), "--drop-non-tensors"],
            1,
            f"UnsupportedKeyError: safetensors cannot store the keys '{surrogate}'",
        ),
        (values, ["convert", values.url, str(tmp_path / "b.safetensors")], 1, "NonTensorStateError"),
        (values, ["convert", values.url, str(tmp_path / "c.safetensors"), "--drop-non-tensors"], 0, "left out 2"),
    ]
    failures: list[str] = []
    for (case, argv, rc, must), res in zip(runs, run_batch([argv for _c, argv, _rc, _m in runs])):
        what = " ".join(a for a in argv if a != case.url and not a.startswith(str(tmp_path)))
        out = res.stdout + res.stderr
        if rc is not None and res.rc != rc:
            failures.append(f"{case.name} [{what}]: exit status {res.rc}, expected {rc}\n{res}")
        if must not in out:
            failures.append(f"{case.name} [{what}]: {must!r} not in the output\n{res}")
        if "--json" in argv:
            if not res.stdout.isascii():
                failures.append(f"{case.name} [{what}]: JSON output is not ASCII")
            if argv[0] == "inspect" and case.loads:  # exact names for scripts
                keys = {t["key"] for t in json.loads(res.stdout)["tensors"]} | {
                    v["key"] for v in json.loads(res.stdout)["values"]
                }
                if not keys >= set(case.names):
                    failures.append(f"{case.name} [{what}]: JSON keys are not the exact names: {sorted(keys)!r}")
        shows_names = argv[0] == "inspect" and "--json" not in argv or (argv[0] != "inspect" and res.rc != 0)
        _cli_text_ok(case, out, failures, what, names=shows_names and "--json" not in argv)
    assert not failures, "\n".join(failures)


_REAL_STREAMS = """
import json, sys
from dcp_storage.cli import main
for argv in json.loads(sys.argv[1]):
    print("=== rc", main(argv), flush=True)
"""


def test_cli_on_real_pipes(cases: dict[str, Hostile]) -> None:
    """The console script's real stdout and stderr (pipes; the batch runner swaps in StringIO), one process:
    the same rules, no encoding error on a lone surrogate, and --debug's traceback escaped too."""
    import subprocess

    from tests.cli._helpers import REPO, cli_env

    runs = [
        (cases["dcp-valid"], ["inspect"], 0),
        (cases["pt-global"], ["verify", "--deep"], 1),
        (cases["dcp-format"], ["--debug", "inspect"], 1),
    ]
    argvs = [[*argv, case.url] for case, argv, _rc in runs]
    proc = subprocess.run(
        [sys.executable, "-c", _REAL_STREAMS, json.dumps(argvs)],
        capture_output=True,
        env=cli_env(),
        cwd=REPO,
        timeout=120,
        check=False,
    )
    stdout, stderr = proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")  # strict: no surrogates got out
    assert proc.returncode == 0, stderr
    assert [int(line.split()[-1]) for line in stdout.splitlines() if line.startswith("=== rc")] == [
        r for *_x, r in runs
    ]
    failures: list[str] = []
    for case, _argv, _rc in runs:
        _cli_text_ok(case, stdout + stderr, failures, "real pipes")
    assert "Traceback" in stderr and "UnicodeEncodeError" not in stderr, stderr
    assert not failures, "\n".join(failures)


def test_cli_escapes_what_no_message_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last line of defence: raw text a command prints on stdout and stderr (as a warning would) and a
    foreign exception's message, with and without --debug, all reach the streams escaped."""
    from dcp_storage import cli
    from dcp_storage.commands import inspect as inspect_command

    evil = NAMES["clear-and-fake-ok"]

    def hostile_command(args: Any) -> int:
        print(f"raw {evil}")
        print(f"warned {evil}", file=sys.stderr)
        raise ValueError(f"foreign {evil}")

    monkeypatch.setattr(inspect_command, "run_inspect", hostile_command)
    for argv in (["inspect", "x"], ["--debug", "inspect", "x"]):
        assert cli.main(argv) == 1
        got = capsys.readouterr()
        out = got.out + got.err
        assert not raw_controls(out, "\n"), out
        for what in ("raw", "warned", "foreign"):
            assert f"{what} {printable(evil)}" in out, out
    assert "Traceback" in out
