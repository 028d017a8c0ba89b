"""Progress bars on a terminal (and only there); ``dcp-storage plugins`` with a broken plugin installed."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

from ._helpers import REPO, cli_env, run_cli, run_python


def _run_on_pty(argv: list[str], env: dict[str, str], timeout: float = 120) -> tuple[int, str]:
    """Run the CLI with stderr (and stdout) on a pseudo-terminal; return (rc, everything it drew)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a real terminal has a size
    proc = subprocess.Popen(
        [sys.executable, "-m", "dcp_storage.cli", *argv],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=REPO,
        close_fds=True,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return rc, b"".join(chunks).decode("utf-8", "replace")


def test_progress_bar_only_on_a_terminal(tmp_path: Path, sources: dict[str, Path]) -> None:
    env = cli_env(DCP_STORAGE_PROGRESS_DELAY="0")
    rc, drawn = _run_on_pty(["convert", str(sources["dcp_tensors"]), str(tmp_path / "tty.safetensors")], env)
    assert rc == 0, drawn
    assert "convert:" in drawn and "B/s" in drawn, drawn  # tqdm's bar, on the terminal
    assert "converted" in drawn
    # The same command with stderr on a pipe draws nothing (see also test_convert's exit-code test).
    piped = run_cli("verify", str(sources["dcp_tensors"]), "--deep", env=env)
    assert piped.rc == 0 and piped.stderr == "", piped


def _fake_distribution(root: Path, dist: str, module: str, entry_points: str, body: str) -> None:
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    (info / "RECORD").write_text("")


def test_plugins_lists_failures_with_reason(tmp_path: Path) -> None:
    _fake_distribution(
        tmp_path,
        "cliplug-broken",
        "cliplug_broken",
        "[dcp_storage.formats]\nbrokenfmt = cliplug_broken:FORMAT\n",
        "raise ImportError('needs libfoo >= 2')\n",
    )
    _fake_distribution(
        tmp_path,
        "cliplug-good",
        "cliplug_good",
        "[dcp_storage.planners]\ngoodplanner = cliplug_good:PLANNER\n",
        "PLANNER = object()\n",
    )
    env = cli_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    code = textwrap.dedent("""
        import json, sys
        from tests.cli._batch import run_one
        print(json.dumps([run_one(a) for a in (["plugins", "--json"], ["plugins"], ["plugins", "--strict"])]))
    """)
    proc = run_python(["-c", code], env)
    assert proc.returncode == 0, proc.stderr
    as_json, text, strict = json.loads(proc.stdout)
    assert as_json["rc"] == 0
    rows = {(r["kind"], r["name"]): r for r in json.loads(as_json["stdout"])}
    broken = rows[("formats", "brokenfmt")]
    assert broken["status"] == "failed" and broken["distribution"] == "cliplug-broken"
    assert "ImportError: needs libfoo >= 2" in broken["error"]
    assert rows[("planners", "goodplanner")]["status"] == "loaded"
    assert rows[("formats", "dcp")]["status"] == "loaded" and rows[("formats", "dcp")]["distribution"] == "dcp-storage"
    assert (
        text["rc"] == 0
        and "failed: formats/brokenfmt (cliplug-broken): ImportError: needs libfoo >= 2" in text["stdout"]
    )
    assert strict["rc"] == 1
