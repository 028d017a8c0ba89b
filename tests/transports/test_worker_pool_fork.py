"""A transport used before a ``fork`` (a ``DataLoader`` worker, say) still reads in the child.

Before: the child's first request waited forever. The parent's ``ThreadPoolExecutor`` counted its threads as
idle, so it started none in the child, where those threads do not exist.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD_READS = textwrap.dedent(
    """
    import os, sys, time
    from dcp_storage.transports.factory import open_transport
    from dcp_storage.transports.ranges import RangeRequest

    folder = sys.argv[1]
    with open(os.path.join(folder, "data"), "wb") as f:
        f.write(bytes(range(256)) * 64)
    transport, root = open_transport(folder)
    path = transport.join(root, "data")

    def read():
        runs = [RangeRequest(path, 0, 100), RangeRequest(path, 8000, 9000)]
        got = [bytes(b) for b in transport.read_ranges(runs)]
        assert got == [bytes(range(100)), (bytes(range(256)) * 64)[8000:9000]], got
        assert transport.executor().submit(lambda: 7).result() == 7

    read()  # the parent's pool now has threads
    child = os.fork()
    if child == 0:
        try:
            read()
            transport.close()
            os._exit(0)
        except BaseException:
            os._exit(3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            print("child exit", os.waitstatus_to_exitcode(status))
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        os.waitpid(child, 0)
        print("child hung")
    read()  # and the parent's pool still works
    transport.close()
    """
)


def test_a_forked_child_reads_through_the_parents_transport(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_READS, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "child exit 0", proc.stdout + proc.stderr[-3000:]
