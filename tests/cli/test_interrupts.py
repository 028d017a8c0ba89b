"""Ctrl-C (SIGINT) and SIGTERM during ``convert`` and ``merge`` (issue 20, failure paths).

Before: to ``.pt`` the process aborted (SIGABRT, ``terminate called after throwing an instance of
'c10::Error'``) when the signal landed inside torch's zip writer (it calls our stream's ``write`` from C++);
to a DCP directory the user read ``RuntimeError: [enforce fail at inline_container.cc:672]`` and the output
directory stayed; SIGTERM killed the process outright, leaving the lock. Now every target exits 130 with one
line, leaves no output (files this run committed are removed, a directory it created too) and no lock.
The signals come from inside the running command (``_interrupt_driver``): after N bytes written, or after
N tensors read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ._helpers import cli_env, run_python

DRIVER = Path(__file__).with_name("_interrupt_driver.py")


def _drive(jobs: list[dict]) -> list[dict]:
    # A process of its own (a fork of the CLI tests' zygote, see run_python): an abort ends it, not the test.
    proc = run_python([str(DRIVER)], cli_env(), input=json.dumps(jobs), timeout=600)
    assert proc.returncode == 0, (
        f"rc={proc.returncode} (a C++ abort, or a SIGTERM not handled, kills the whole batch)\n{proc.stderr[-3000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # after what the commands printed


def test_interrupted_conversions_exit_130_in_one_line_and_leave_nothing(
    tmp_path: Path, sources: dict[str, Path]
) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "in.safetensors"
    save_file({f"t{i}": torch.full((128, 256), float(i)) for i in range(8)}, str(src))  # 8 x 128 KiB
    existing = tmp_path / "existing"  # an output directory that was there before: it must stay, empty
    existing.mkdir()
    outputs = {
        "pt": ["out.pt"],
        "dcp": ["out_dcp", "--to", "dcp", "--max-shard-size", "300KB"],
        "st": ["out.safetensors"],
        "st-sharded": ["out_st", "--to", "safetensors", "--max-shard-size", "300KB"],
        "pt-sharded": ["out_pt", "--to", "torch", "--max-shard-size", "300KB"],
        "existing-dcp": ["existing", "--to", "dcp", "--max-shard-size", "300KB"],
    }
    points = [("write", 1), ("write", 200_000), ("write", 700_000), ("read", 3)]
    jobs, labels = [], []
    for name, (out, *flags) in outputs.items():
        for k, (at, after) in enumerate(points):
            sig = "SIGINT" if k % 2 == 0 else "SIGTERM"
            labels.append((name, at, after, sig))
            jobs.append(
                {"signal": sig, "at": at, "after": after, "argv": ["convert", str(src), str(tmp_path / out), *flags]}
            )
    merged = tmp_path / "merged"
    for sig in ("SIGINT", "SIGTERM"):
        labels.append(("merge", "write", 1000, sig))
        jobs.append({"signal": sig, "at": "write", "after": 1000, "argv": ["merge", str(sources["dcp_tensors"]), str(merged), "--max-shard-size", "2KB"]})  # fmt: skip
    for label, got in zip(labels, _drive(jobs)):
        assert got["sent"], label
        assert got["rc"] == 130, (label, got)
        lines = got["stderr"].strip().splitlines()
        assert lines == [f"dcp-storage {jobs[labels.index(label)]['argv'][0]}: interrupted ({label[3]})"], (label, got)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["existing", "in.safetensors"], left
    assert list(existing.iterdir()) == []  # no lock, no temp file, no data file


def test_after_an_interrupt_the_same_conversion_succeeds(tmp_path: Path, sources: dict[str, Path]) -> None:
    out = tmp_path / "out_dcp"
    first, second = _drive(
        [
            {"signal": "SIGTERM", "at": "write", "after": 1, "argv": ["convert", str(sources["torch"]), str(out), "--to", "dcp"]},
            {"signal": "SIGINT", "at": "never", "after": 0, "argv": ["convert", str(sources["torch"]), str(out), "--to", "dcp"]},
        ]
    )  # fmt: skip
    assert first["rc"] == 130 and second["rc"] == 0, (first, second)
    assert (out / ".metadata").is_file() and not (out / ".dcp_storage.lock").exists()
