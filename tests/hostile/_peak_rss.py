"""Run hostile cases through the public entry points in this process, reporting each one's peak memory.

``python -m tests.hostile._peak_rss`` reads a JSON list of ``[name, family, url, culprit, in_metadata,
marker, keys]`` from stdin and prints one JSON line per (case, entry): the error's class and message, the
seconds taken, and the peak resident memory above the level before the call (Linux: ``VmHWM``, reset
before each call through ``/proc/self/clear_refs``). A separate process, so that one case's peak is
not hidden behind the test runner's own.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
import warnings
from typing import Any

ENTRIES = ("open_reader", "describe", "verify", "convert")


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _convert(url: str) -> None:
    from dcp_storage import convert

    with tempfile.TemporaryDirectory() as out:
        convert(url, out + "/out", to="safetensors")


def main() -> None:
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    from tests.hostile.corpus import Case
    from tests.hostile.harness import run_entry

    cases = [Case(*row) for row in json.load(sys.stdin)]
    for case in cases:
        for entry in ENTRIES:
            _reset_peak()
            before = _kib("VmRSS")
            start = time.monotonic()
            error: Any = None
            if entry == "convert":
                try:
                    _convert(case.url)
                except Exception as exc:  # noqa: BLE001 - reported
                    error = exc
                raised, message = (type(error).__name__, str(error)) if error else (None, "")
                from dcp_storage.errors import DcpStorageError

                ours = isinstance(error, DcpStorageError)
            else:
                out = run_entry(case, entry)
                raised, message, ours = out.raised, out.message or "; ".join(out.problems), out.ours
            seconds = time.monotonic() - start
            peak = _kib("VmHWM")
            row = {
                "case": case.name,
                "entry": entry,
                "raised": raised,
                "ours": ours,
                "message": message[:400],
                "seconds": round(seconds, 3),
                "peak_mib_above": round(max(0, peak - before) / 1024, 1),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
