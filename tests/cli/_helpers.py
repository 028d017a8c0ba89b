"""Running the ``dcp-storage`` CLI from tests: processes of their own (forks of a zygote that imported torch
once), storage options as flags, bit-exact checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dcp_storage_testing.compare import same_bits

BATCH = Path(__file__).with_name("_batch.py")
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DCP_STORAGE_PROGRESS_DELAY", None)
    env.update(extra)
    return env


# Set to 1 to run each command in a new interpreter instead of a fork of the zygote (``_zygote.py``).
SPAWN_ENV = "DCP_STORAGE_CLI_TESTS_SPAWN"


def run_python(
    argv: list[str], env: dict[str, str], input: str | None = None, timeout: float = 120, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """``python ARGV`` (``-m MODULE ...``, ``-c CODE ...`` or ``SCRIPT ...``) from ``cwd``, in a process of its own:
    a fork of the CLI zygote, which imported torch once (``_zygote.py``), or a new interpreter when
    ``DCP_STORAGE_CLI_TESTS_SPAWN=1``."""
    if os.environ.get(SPAWN_ENV, "") not in ("", "0"):
        return subprocess.run(
            [sys.executable, *argv],
            input=input,
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
        )
    from ._zygote import zygote

    return zygote().run(argv, env, str(cwd), input, timeout)


def run_cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> Result:
    """``python -m dcp_storage.cli ARGV`` in a process of its own (see :func:`run_python`)."""
    proc = run_python(["-m", "dcp_storage.cli", *argv], env or cli_env(), timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def run_batch(commands: list[list[str]], timeout: float = 300, env: dict[str, str] | None = None) -> list[Result]:
    """Several command lines through ``dcp_storage.cli.main`` in one process of its own (see ``_batch.py``
    and :func:`run_python`)."""
    proc = run_python([str(BATCH)], env or cli_env(), input=json.dumps(commands), timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return [Result(**r) for r in json.loads(proc.stdout)]


def option_flags(options: dict[str, Any], flag: str = "--storage-option", prefix: str = "") -> list[str]:
    """``{"client_kwargs": {"endpoint_url": u}, "key": "k"}`` -> ``[flag, "client_kwargs.endpoint_url=u", ...]``."""
    out: list[str] = []
    for key, value in options.items():
        if isinstance(value, dict):
            out += option_flags(value, flag, f"{prefix}{key}.")
        else:
            out += [flag, f"{prefix}{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return out


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not same_bits(got[k], want[k])]
    assert not bad, f"tensors differ: {bad}"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> dotted keys (as DCP flattens them)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}
