"""A transport used before a ``fork`` (a ``DataLoader`` worker, say) still reads in the child.

Before: the child's first request waited forever. The parent's ``ThreadPoolExecutor`` counted its threads as
idle, so it started none in the child, where those threads do not exist.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from dcp_storage_testing.forking import run_forking_script

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from dcp_storage.transports import open_transport
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
    wait_for_child(child, 30)
    read()  # and the parent's pool still works
    transport.close()
    """
)


def test_a_forked_child_reads_through_the_parents_transport(tmp_path: Path) -> None:
    assert run_forking_script(SCRIPT, str(tmp_path)) == "child exit 0"
