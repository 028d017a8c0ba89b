"""One rank of :func:`~dcp_storage_testing.distributed.run_ranks`, in its own process.

The caller's side (starting ranks, collecting reports, dumping the stacks of a hung rank, killing every
rank) is :mod:`.distributed`; this is what runs in each rank: take the caller's environment and its
stdout/stderr, exit the moment the caller's lifeline closes, join a gloo (or, for GPU checks, NCCL)
process group over a ``TCPStore`` on the loopback, run the function, and report exactly one message.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["HOST", "InheritedFd", "rank_main"]

HOST = "127.0.0.1"


class InheritedFd:
    """A file descriptor of the caller, duplicated into the rank on unpickling.

    multiprocessing transfers it (pass_fds under spawn, SCM_RIGHTS to the
    forkserver) because ``DupFd`` is called while the Process is pickled.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def of(cls, fd: int) -> InheritedFd | None:
        try:
            os.fstat(fd)
        except OSError:
            return None  # closed in the caller: let the rank keep its own
        return cls(fd)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_detach_fd, (reduction.DupFd(self.fd),))


def _detach_fd(dup: Any) -> int:
    return int(dup.detach())


def _redirect(fd: int | None, target: int) -> None:
    """Point ``target`` (1 or 2) at ``fd``, flushing Python's buffers first."""
    if fd is None or fd == target:  # spawn passes the fd under its own number
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os.dup2(fd, target)
    os.close(fd)


def _loopback_ifname() -> str:
    """Name of the loopback interface, for ``GLOO_SOCKET_IFNAME``."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        names = set()
    return "lo0" if "lo0" in names and "lo" not in names else "lo"


def _exit_when_closed(lifeline: Connection) -> None:
    """Block until the caller closes the lifeline (or dies), then end this rank."""
    try:
        while True:
            lifeline.recv_bytes()  # the caller never writes; this returns on EOF
    except (EOFError, OSError):
        pass
    os._exit(1)


def rank_main(
    payload: bytes,
    rank: int,
    world_size: int,
    store_port: int,
    timeout: float,
    env: dict[str, str],
    stdout_fd: int | None,
    stderr_fd: int | None,
    stack_file: str,
    conn: Connection,
    lifeline: Connection,
) -> None:
    """Body of one rank: set up, run ``fn``, report exactly one message on ``conn``."""
    threading.Thread(target=_exit_when_closed, args=(lifeline,), name="run_ranks-lifeline", daemon=True).start()
    # A forkserver child inherits the forkserver's environment, which is
    # frozen at its start; give the rank the caller's environment of now.
    os.environ.clear()
    os.environ.update(env)
    _redirect(stdout_fd, 1)
    _redirect(stderr_fd, 2)
    import faulthandler

    stack_out = open(stack_file, "w", encoding="utf-8")  # noqa: SIM115 (lives until exit)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_ifname()
    # The usual torchrun variables, for code under test that reads them.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn, args, kwargs = pickle.loads(payload)
        store = dist.TCPStore(HOST, store_port, None, False, timeout=datetime.timedelta(seconds=timeout))
        # GPU checks run the same helper with NCCL (benchmarks/gpu_check.py): one device per rank.
        backend = os.environ.get("DCP_STORAGE_RUN_RANKS_BACKEND", "gloo")
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        # init returns on a rank once *its* side of gloo's mesh is connected; a
        # rank whose fn returns at once could then tear the group down under a
        # peer still connecting ("Connection closed by peer"). Sync first.
        dist.barrier()
        result = fn(rank, world_size, *args, **kwargs)
        dist.destroy_process_group()
        # Pickle before sending, so a result that cannot be pickled is reported
        # as this rank's error rather than leaving a half-written message.
        message = pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
        conn.send_bytes(message)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        with contextlib.suppress(Exception):  # if the parent is gone, nobody is left to tell
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        _destroy_quietly()
    finally:
        conn.close()


def _destroy_quietly() -> None:
    """Best-effort process-group teardown after a failure."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
