"""Run a function on N real gloo ranks, each in its own spawned process.

Why real processes instead of threads or a fake process group: distributed
checkpointing exercises per-rank file writes, collectives and pickling of
plans across address spaces; only separate interpreters catch the bugs that
live there.

Why ``forkserver`` with torch preloaded rather than ``spawn``: forking the
test process itself is unsafe (it has torch, s3fs/aiohttp event-loop threads,
moto's log reader...), and ``spawn`` pays a fresh interpreter plus
``import torch`` per rank per call -- ~2.5 s for a trivial 2-rank call on a
2-core box, ~0.8 s more for torch's interpreter teardown. The forkserver is a
clean, single-threaded interpreter started once per test process; it imports
torch (and DCP, the package's readers and writers and s3fs) once, and each rank
is a fork of it, so later calls cost ~0.05 s. The
environment variable ``DCP_STORAGE_RUN_RANKS_START_METHOD=spawn`` switches
back to plain spawn (e.g. to rule the forkserver out while debugging).
Ranks get the caller's *current* ``os.environ`` either way, although torch
itself was imported in the forkserver under the environment it started with.

Failure handling is the point of this module. A rank that raises is reported
with its own traceback; a rank that hangs (the usual symptom of a collective
mismatch) is reported with the Python stack of every unfinished rank, dumped
via ``faulthandler`` just before the kill. No child outlives the call: ranks
(and anything they spawned) are killed on every exit path, and each rank
watches a "lifeline" pipe from the caller and exits the moment it closes, so
ranks die even if the caller is SIGKILLed. (A parent-death signal would not
do: under forkserver the OS parent is the forkserver, which outlives the
caller while ranks hold it open.) The forkserver itself stays up until the
test process exits; it is multiprocessing's, shared, and not an orphan.

Arguments and results cross process boundaries as plain pickles (by value),
not through multiprocessing's pickler: torch registers reductions there that
ship tensors through shared memory, which breaks as soon as the sending rank
exits, and would make ranks alias the caller's tensors. Ranks also write to
the caller's *current* stdout/stderr (passed down as file descriptors), so
pytest's per-test capture, ``capfd`` included, sees rank output even though
the forkserver was started during some earlier test.

Rendezvous uses a ``TCPStore`` that the parent binds to 127.0.0.1 port 0, and
gloo is pinned to the loopback interface, so no fixed ports and no traffic
beyond 127.0.0.1.

The rank's own side (environment, inherited stdout/stderr, lifeline, process group) is
:mod:`._rank_process`.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from dcp_storage_testing._rank_process import HOST, InheritedFd, rank_main

__all__ = ["RankFailedError", "RankTimeoutError", "run_ranks", "warm_up"]

_KILL_GRACE_S = 2.0  # between SIGTERM and SIGKILL when tearing ranks down
_EXIT_GRACE_S = 10.0  # a rank that has reported may take this long to exit
_FAILURE_GRACE_S = 0.5  # after one rank fails, how long others may still report
_STACK_DUMP_WAIT_S = 1.0  # most time allowed for faulthandler to write stacks
_START_METHOD_ENV = "DCP_STORAGE_RUN_RANKS_START_METHOD"
# Imported once by the forkserver so that ranks fork with them already loaded.
# "__main__" is multiprocessing's own default preload, kept for other users of
# the (process-global) forkserver. Besides torch: DCP, the package's readers and
# writers and s3fs (aiobotocore), which nearly every rank body imports; without
# them each rank of each call paid ~2-3 s of imports on 2 busy cores. None of
# them starts a thread or reads the environment at import (fsspec starts its
# loop thread on first use, in the rank). A name that fails to import is skipped
# by multiprocessing, so a missing extra only costs the rank that import again.
_FORKSERVER_PRELOAD = [
    "__main__",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "s3fs",
    "dcp_storage.formats.dcp_native.reader",
    "dcp_storage.formats.dcp_native.writer",
    "dcp_storage.formats.safetensors.reader",
    "dcp_storage.formats.safetensors.writer",
    "dcp_storage.strategies",
    __name__,
]


class RankFailedError(Exception):
    """One or more ranks raised (or died) instead of returning.

    ``failures`` maps each rank known to have failed to its formatted
    traceback (or how it died), in the order the failures arrived; ``rank`` is
    the first of them, usually the root cause (its peers then tend to fail
    with "connection closed by peer" and similar).
    """

    def __init__(self, failures: dict[int, str], message: str | None = None) -> None:
        self.failures = dict(failures)
        self.rank = next(iter(self.failures))
        if message is None:
            first, *others = self.failures.items()
            lines = [f"rank {first[0]} failed:\n{first[1]}"]
            lines += [f"rank {rank} failed too:\n{detail}" for rank, detail in others]
            message = "\n".join(lines)
        super().__init__(message)


class RankTimeoutError(RankFailedError):
    """Some ranks did not finish within the timeout; all ranks were killed.

    ``unfinished`` lists them; ``failures`` holds each one's stack dump.
    """

    def __init__(self, unfinished: list[int], timeout: float, stacks: dict[int, str]) -> None:
        self.unfinished = sorted(unfinished)
        lines = [f"ranks {self.unfinished} did not finish within {timeout:.1f}s"]
        lines += [f"rank {rank} stacks at timeout:\n{stacks[rank]}" for rank in self.unfinished]
        super().__init__({rank: stacks[rank] for rank in self.unfinished}, "\n".join(lines))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    ``fn``, ``args``, ``kwargs`` and the return values must be picklable, so
    ``fn`` has to be a module-level function of an importable module; they
    travel by value (each rank gets its own copy of tensor arguments). Each
    rank runs with ``torch.set_num_threads(1)``, ``RANK``/``WORLD_SIZE``/
    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` set, and an initialised (and
    barrier-synchronised) default gloo process group, destroyed after ``fn``
    returns. ``timeout`` (seconds) bounds the whole call, start-up included,
    and is also the process group's collective timeout.

    Returns the per-rank return values, indexed by rank. Raises
    :class:`RankFailedError` if a rank raises or dies, and
    :class:`RankTimeoutError` if any rank is still running at the deadline.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    import torch.distributed as dist  # deferred: keep `import dcp_storage_testing` cheap

    deadline = time.monotonic() + timeout
    # Pickled here, once: an unpicklable fn or argument fails fast in the
    # caller, and every rank gets its own copy.
    payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    ctx = _context()
    store = dist.TCPStore(
        HOST,
        0,
        None,
        True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    procs: list[BaseProcess] = []
    conns: list[Connection] = []
    # Ranks exit when this pipe reports EOF, i.e. when we close it or die.
    lifeline_r, lifeline_w = ctx.Pipe(duplex=False)
    with tempfile.TemporaryDirectory(prefix="run_ranks-") as tmp:
        stack_files = [os.path.join(tmp, f"rank{rank}.stacks") for rank in range(world_size)]
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=rank_main,
                    args=(
                        payload,
                        rank,
                        world_size,
                        store.port,
                        timeout,
                        dict(os.environ),
                        InheritedFd.of(1),
                        InheritedFd.of(2),
                        stack_files[rank],
                        writer,
                        lifeline_r,
                    ),
                    name=f"run_ranks-rank{rank}",
                )
                proc.start()
                writer.close()  # so that the reader sees EOF when the child dies
                procs.append(proc)
                conns.append(reader)
            lifeline_r.close()
            results, failures, unfinished = _collect(procs, conns, deadline)
            if not failures and unfinished:
                stacks = _dump_stacks(procs, unfinished, stack_files)
                _kill(procs)
                raise RankTimeoutError(unfinished, timeout, stacks)
            if failures:
                _kill(procs)
                raise RankFailedError(failures)
            _reap(procs, min(_EXIT_GRACE_S, max(deadline - time.monotonic(), 1.0)))
            return results
        finally:
            _kill(procs)
            for conn in [*conns, lifeline_r, lifeline_w]:
                conn.close()
            del store


def warm_up() -> None:
    """Start the rank forkserver now, in the background, without waiting for it.

    The first :func:`run_ranks` call in a process otherwise pays the
    forkserver's ``import torch`` (seconds on a small box). Calling this early
    (e.g. from ``pytest_sessionstart``) overlaps that with other start-up
    work. A no-op when ranks are started with ``spawn``.
    """
    ctx = _context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _context() -> Any:  # typeshed's BaseContext lacks .Process; concrete contexts have it
    """The multiprocessing context for ranks: preloaded forkserver, else spawn."""
    method = os.environ.get(_START_METHOD_ENV) or "forkserver"
    if method not in multiprocessing.get_all_start_methods() or method == "fork":
        method = "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # Only takes effect if the forkserver is not running yet; harmless after.
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


def _collect(
    procs: list[BaseProcess], conns: list[Connection], deadline: float
) -> tuple[list[Any], dict[int, str], list[int]]:
    """Wait for every rank's report, until the deadline or shortly after a failure.

    After the first failure, other ranks get ``_FAILURE_GRACE_S`` to report
    theirs: the root cause is not always the first report, and its peers'
    errors ("connection closed by peer") help to tell. Returns ``(results,
    failures in arrival order, unfinished ranks)``.
    """
    results: list[Any] = [None] * len(procs)
    failures: dict[int, str] = {}
    pending = set(range(len(procs)))
    while pending:
        now = time.monotonic()
        if now >= deadline:
            break
        waitables: list[Any] = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = set(multiprocessing.connection.wait(waitables, timeout=deadline - now))
        for rank in sorted(pending):
            if conns[rank] not in ready and procs[rank].sentinel not in ready:
                continue
            pending.discard(rank)
            message: tuple[str, Any] | None = None
            if conns[rank].poll():
                try:
                    message = pickle.loads(conns[rank].recv_bytes())
                except (EOFError, OSError):
                    message = None
                except Exception:  # noqa: BLE001 - e.g. result's class not importable here
                    message = ("error", "result could not be unpickled:\n" + traceback.format_exc())
            if message is None:
                # Closed pipe without a report: the process died (segfault,
                # os._exit, OOM kill). Get its exit code for the message.
                procs[rank].join(timeout=_KILL_GRACE_S)
                failures[rank] = f"process {_how_it_ended(procs[rank].exitcode)} without reporting a result"
            elif message[0] == "ok":
                results[rank] = message[1]
            else:
                failures[rank] = message[1]
            if len(failures) == 1 and rank in failures:
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    return results, failures, sorted(pending)


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exited with code {exitcode}"


def _dump_stacks(procs: list[BaseProcess], ranks: list[int], files: list[str]) -> dict[int, str]:
    """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1) and read them."""
    stacks = {rank: "<no stack dump available>" for rank in ranks}
    if not hasattr(signal, "SIGUSR1"):
        return stacks
    for rank in ranks:
        pid = procs[rank].pid
        if pid is not None and procs[rank].is_alive():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
    # faulthandler writes from the signal handler in one go; poll until every
    # rank has written something (or the wait runs out), then read once more.
    end = time.monotonic() + _STACK_DUMP_WAIT_S
    while time.monotonic() < end:
        if all(os.path.exists(files[r]) and os.path.getsize(files[r]) for r in ranks):
            time.sleep(0.05)  # let a multi-thread dump finish
            break
        time.sleep(0.02)
    for rank in ranks:
        try:
            with open(files[rank], encoding="utf-8", errors="replace") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            stacks[rank] = text
    return stacks


def _reap(procs: list[BaseProcess], grace: float) -> None:
    """Join ranks that already reported; kill stragglers stuck in interpreter exit."""
    end = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(end - time.monotonic(), 0.0))


def _kill(procs: list[BaseProcess]) -> None:
    """Terminate, then kill, every live rank and its descendants. Idempotent.

    Descendants (e.g. an async-checkpoint helper process started by ``fn``)
    are found with psutil when it is installed; without it only ranks die.
    """
    try:
        import psutil
    except ImportError:
        psutil = None
    victims: list[Any] = []
    for proc in procs:
        if proc.pid is None or proc.exitcode is not None:
            continue
        if psutil is not None:
            try:
                victims.extend(psutil.Process(proc.pid).children(recursive=True))
            except psutil.Error:
                pass
        proc.terminate()
    end = time.monotonic() + _KILL_GRACE_S
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=max(end - time.monotonic(), 0.0))
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    if psutil is not None and victims:
        for victim in victims:
            try:
                victim.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(victims, timeout=_KILL_GRACE_S)
