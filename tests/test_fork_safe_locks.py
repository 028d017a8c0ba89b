"""A child forked while one of the parent's threads holds a module's lock still takes that lock.

Before: the child's first use waited forever (the thread holding the lock does not exist in the child): a
``DataLoader`` worker forked while a transport counted a request, while the disk thread was being made, or
while a save's lease was renewed.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from dcp_storage_testing.forking import run_forking_script

SCRIPT = textwrap.dedent(
    """
    import os, sys, threading
    from dcp_storage import registry
    from dcp_storage.formats import commit_lease
    from dcp_storage.transports import fsspec_transport, local, open_transport, s3, s3_stream

    transport, root = open_transport(sys.argv[1])
    locks = {
        "counters": transport.counters._lock,
        "disk": local._DISK_LOCK,
        "lease": commit_lease._ACTIVE_LOCK,
    }
    uses = {
        "counters": lambda: transport.counters.add(requests=1),
        "disk": lambda: local._disk_thread().submit(lambda: 1).result(),
        "lease": commit_lease.active_claims,
    }

    def taken(lock):
        if not lock.acquire(timeout=5):
            os._exit(3)  # still held in the child
        lock.release()

    for name, lock in {
        "registry": registry._REGISTRY._lock,
        "s3 direct state": s3._STATE_LOCK,
        "botocore loaders": s3_stream._LOADERS_LOCK,
        "memory:// writes": fsspec_transport._MEMORY_LOCK,
    }.items():
        locks[name] = lock
        uses[name] = lambda lock=lock: taken(lock)
    held, release = threading.Event(), threading.Event()

    def hold():
        for lock in locks.values():
            lock.acquire()
        held.set()
        release.wait()
        for lock in locks.values():
            lock.release()

    threading.Thread(target=hold).start()
    held.wait()
    child = os.fork()
    if child == 0:
        for name, use in uses.items():
            use()
            print("child used", name, flush=True)
        os._exit(0)
    release.set()
    wait_for_child(child, 20)
    for use in uses.values():
        use()  # the parent's locks are its own still
    transport.close()
    """
)


def test_a_child_forked_while_a_lock_is_held_can_take_it(tmp_path: Path) -> None:
    assert run_forking_script(SCRIPT, str(tmp_path)) == "child exit 0"
