"""Every snippet of the README's "Common tasks" section runs, as written, as a script of its own.

The section promises complete scripts, so each ```python block is written to a file in a fresh directory
and run in a process of its own (hub downloads off): a fork of the CLI tests' zygote, which imported torch
once (``tests/cli/_zygote.py``; ``DCP_STORAGE_CLI_TESTS_SPAWN=1`` for a new interpreter). A block whose first line is
``# torchrun --nproc-per-node N ...`` runs under torchrun with N gloo ranks on loopback. A snippet that
raises, asserts or hangs fails its test with the script's output.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Common tasks"
TORCHRUN = re.compile(r"#\s*torchrun\s+--nproc-per-node\s+(\d+)\b")
TOPICS = (
    "Hugging Face",
    "one rank",
    "optimizer",
    "async_save",
    "checkpoint process",
    "training job on a bucket",
    "meta device",
    "Trust",
)


def common_tasks() -> list[tuple[str, str]]:
    """(title, code) of each python block in the section; the title is the bold lead-in before it."""
    text = README.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end != -1 else len(text)]
    blocks = []
    for match in re.finditer(r"\*\*(?P<title>[^*]+)\*\*(?:(?!\*\*).)*?```python\n(?P<code>.*?)```", section, re.S):
        blocks.append((match["title"].strip().rstrip("."), match["code"]))
    return blocks


def test_the_section_covers_every_common_task() -> None:
    titles = " / ".join(title for title, _ in common_tasks())
    assert len(common_tasks()) == len(TOPICS), titles
    text = README.read_text(encoding="utf-8")
    section = text[text.index(SECTION) :]
    for topic in TOPICS:
        assert topic in section, f"the Common tasks section no longer covers {topic!r}"


@pytest.mark.parametrize(("title", "code"), common_tasks(), ids=[t for t, _ in common_tasks()])
def test_snippet_runs(title: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(README.parent), env.get("PYTHONPATH")]))
    first = code.splitlines()[0]
    launcher = TORCHRUN.match(first)
    if not launcher:  # one process: a fork of the CLI tests' zygote (torch imported once), run as a script
        from tests.cli._helpers import run_python

        try:
            done = run_python([str(script)], env, timeout=180, cwd=tmp_path)
        except subprocess.TimeoutExpired:
            pytest.fail(f"README snippet {title!r} hung (killed after 180 s)")
        assert done.returncode == 0, f"README snippet {title!r} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        return
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={launcher[1]}"]
    # Own session, so a hung snippet's ranks die with their launcher when the timeout kills the group.
    proc = subprocess.Popen(
        [*argv, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"README snippet {title!r} hung (killed after 180 s):\n{out[-4000:]}\n{err[-4000:]}")
    assert proc.returncode == 0, f"README snippet {title!r} failed:\n{out[-4000:]}\n{err[-4000:]}"
