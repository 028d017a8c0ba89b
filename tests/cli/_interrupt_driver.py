"""Run ``dcp-storage`` commands that signal themselves part-way, in one process (the Ctrl-C / SIGTERM tests).

stdin: a JSON list of jobs ``{"signal": "SIGINT", "at": "write", "after": N, "argv": [...]}``; stdout: a JSON
list of ``{"rc": ..., "stderr": ...}``. ``at="write"``: the signal is sent from inside the output stream's
``write`` once ``after`` bytes were written (for torch's zip writer that is a Python call made from C++,
where a ``KeyboardInterrupt`` used to abort the process: the whole batch would die); ``at="read"``: after
``after`` tensors were read from the source. Each command then ends as the CLI decides.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
from typing import Any

from dcp_storage.cli import main
from dcp_storage.conversion.source import TensorSource
from dcp_storage.transports.local import LocalWriter
from dcp_storage.transports.protocol import CountingWriter

state: dict[str, Any] = {}


def fire(amount: int, at: str) -> None:
    if state.get("at") != at or state["sent"]:
        return
    state["n"] += amount
    if state["n"] >= state["after"]:
        state["sent"] = True
        os.kill(os.getpid(), state["signal"])


real_write = CountingWriter.write
real_local_write = LocalWriter.write
real_read = TensorSource.read_tensors


def write(self: CountingWriter, data: Any) -> int:
    n = real_write(self, data)
    fire(n, "write")
    return n


def local_write(self: LocalWriter, data: Any) -> int:
    n = real_local_write(self, data)
    fire(n, "write")
    return n


def read_tensors(self: TensorSource, wanted: Any) -> Any:
    got = real_read(self, wanted)
    fire(len(got), "read")
    return got


CountingWriter.write = write  # type: ignore[method-assign]
LocalWriter.write = local_write  # type: ignore[method-assign]
TensorSource.read_tensors = read_tensors  # type: ignore[method-assign]

results = []
for job in json.loads(sys.stdin.read()):
    state.update(at=job["at"], after=job["after"], n=0, sent=False, signal=getattr(signal, job["signal"]))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(job["argv"])
    results.append({"rc": rc, "stderr": err.getvalue(), "sent": state["sent"]})
print(json.dumps(results))
