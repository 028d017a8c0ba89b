"""The GPU check script runs its exact checks on CPU/gloo here, so it cannot rot between GPU runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_gpu_check_dry_run_on_cpu() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--ranks", "2"], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout
