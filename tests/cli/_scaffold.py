"""Three generated plugins (a transport, an extension and a format), pip installed once for the scaffold tests.

``dcp-storage plugins new`` runs for each template in one CLI batch process; one real ``pip install`` (a
wheel build from each generated pyproject.toml) puts all three into one target directory; one
``dcp-storage plugins --json`` lists them from there; and one pytest run executes the three generated test
suites unedited, with a JUnit report so that each plugin's own outcomes are checked separately. Before,
each scaffold test paid its own pip install and pytest start-up (about 40 s of the suite's time on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ._helpers import Result, cli_env, run_batch, run_cli, run_python

# plugin name -> (template, generated test module)
PLUGINS = {
    "vaultblob": ("transport", "test_transport"),
    "packz": ("extension", "test_extension"),
    "x": ("format", "test_format"),
}


@dataclass
class Scaffolded:
    root: Path
    made: dict[str, Result]  # plugin -> the output of ``plugins new NAME ... --json`` (``packz``: without --json)
    listed: Result  # ``plugins --json`` with the three installed
    tests: dict[str, Counter[str]]  # plugin -> outcome ("passed", "failed", "error", "skipped") -> count
    pytest_output: str


def scaffold_and_install(root: Path) -> Scaffolded:
    argv = []
    for name, (template, _module) in PLUGINS.items():
        json_flag = [] if name == "packz" else ["--json"]  # the extension's human-readable output is checked
        argv.append(["plugins", "new", name, "--dir", str(root), "--template", template, *json_flag])
    made = dict(zip(PLUGINS, run_batch(argv), strict=True))
    for name, result in made.items():
        assert result.rc == 0, f"plugins new {name}: {result}"
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(target)]
        + [str(root / f"dcp-storage-{name}") for name in PLUGINS],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = cli_env(PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]))
    listed = run_cli("plugins", "--json", env=env)
    report = root / "junit.xml"
    # The transport's suite is the whole conformance suite; its 2-then-3-rank test (a minute under load) runs
    # with DCP_STORAGE_SCAFFOLD_RANKS=1 (the core's tests/conformance runs it on every shared backend).
    ranks = [] if os.environ.get("DCP_STORAGE_SCAFFOLD_RANKS") else ["-k", "not fsdp2_save_2_ranks"]
    # pytest in a process of its own: a fork of the CLI tests' zygote (torch imported once), see run_python.
    proc = run_python(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"--junitxml={report}"]
        + ranks
        + [f"dcp-storage-{name}/tests" for name in PLUGINS],
        env,
        timeout=300,
        cwd=root,
    )
    output = f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    tests: dict[str, Counter[str]] = {name: Counter() for name in PLUGINS}
    modules = {module: name for name, (_t, module) in PLUGINS.items()}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname", "").rsplit(".", 1)[-1]
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            tests.setdefault(modules.get(module, f"(not a plugin test: {module!r})"), Counter())[outcome] += 1
    return Scaffolded(root, made, listed, tests, output)
