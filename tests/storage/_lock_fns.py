"""A save that holds its lock and stays in its first data file until told otherwise, run as its own process
by ``test_lock_takeover.py`` (``python -m tests.storage._lock_fns PATH [--host NAME]``), so a test can
SIGKILL, SIGSTOP, SIGINT or SIGTERM a real save in the middle of its write.

It prints ``WRITING`` once the lock is held and the temp file of its one data file is open (the write
runs on the main thread: one file, ``thread_count=1``), then sleeps there. ``--host`` makes it report
another host name in its lock, so only the lease can tell the test that it stopped.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--host")
    args = parser.parse_args()
    if args.host:
        socket.gethostname = lambda: args.host  # type: ignore[assignment]

    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecWriter

    def stuck(self: Any, raw: Any, name: str, items: Any, planner: Any) -> Any:
        print("WRITING", flush=True)
        time.sleep(600)
        raise AssertionError("not reached")

    FsspecWriter._write_records = stuck  # type: ignore[method-assign]
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save({"w": torch.arange(1000.0)}, storage_writer=FsspecWriter(args.path, thread_count=1), no_dist=True)
    except CheckpointException as exc:  # what an application sees of Ctrl-C: torch wraps KeyboardInterrupt
        if any(isinstance(e, KeyboardInterrupt) for e, _trace in exc.failures.values()):
            print("interrupted", file=sys.stderr)
            return 130
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
