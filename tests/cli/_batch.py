"""Run several ``dcp-storage`` command lines in one interpreter (one ``import torch`` for all of them).

Usage: ``python _batch.py`` with a JSON list of argv lists on stdin; prints a JSON list of
``{"rc", "stdout", "stderr"}``. Each command goes through :func:`dcp_storage.cli.main` exactly as the
console script does (argparse exits become their status codes). Used by the CLI tests to keep their wall
time down; exit codes, TTY behaviour and memory are also checked with one real process per command.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def run_one(argv: list[str]) -> dict[str, object]:
    from dcp_storage.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse usage errors and --help
            rc = exc.code if isinstance(exc.code, int) else 1
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    commands = json.load(sys.stdin)
    json.dump([run_one(argv) for argv in commands], sys.stdout)
