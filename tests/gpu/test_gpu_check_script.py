"""The GPU check script runs its exact checks on CPU/gloo here, so it cannot rot between GPU runs."""

from __future__ import annotations

import os
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_gpu_check_dry_run_on_cpu() -> None:
    from tests.cli._helpers import run_python  # the script as __main__ in a fork of the zygote (torch imported)

    proc = run_python([str(SCRIPT), "--cpu", "--ranks", "2"], dict(os.environ), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout
