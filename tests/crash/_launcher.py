"""Start 2-rank gloo jobs cheaply, many times, so that the test can SIGKILL a rank mid-save.

Why not :func:`dcp_storage_testing.distributed.run_ranks`: it forks ranks from a forkserver that preloads
torch only, so every rank of every trial imports s3fs/aiobotocore again (~1.1 s a rank on 2 cores), and
it hides the rank pids. Here a *zygote* process imports torch, dcp_storage and s3fs once; each job's ranks
are plain ``os.fork()`` children of it (it is single-threaded: imports start no threads, and fsspec starts
its event-loop thread only on first use, in the child). The zygote tells the test the ranks' pids, so the
test can kill one, and reports how each ended.

Protocol (one JSON line each way): the test sends ``{"fn", "args", "world", "store_port", "timeout"}``;
the zygote answers ``{"pids": [...]}`` once the ranks are forked, then ``{"status": [...]}`` when all
have ended (exit code, or ``-signal``). A rank's return value goes to ``{result_dir}/rank{r}.json``.

No process outlives the test: the zygote exits when its stdin closes (the test ended or died) and kills
its ranks; each rank asks the kernel for SIGKILL when the zygote dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_PR_SET_PDEATHSIG = 1


class Zygote:
    """The test's handle on the zygote process; :meth:`close` ends it and any rank still running."""

    def __init__(self, startup_timeout: float = 120.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            cwd=_HERE,
        )
        line = self._read(startup_timeout)
        if line.get("ready") is not True:
            raise RuntimeError(f"zygote did not start: {line}")

    def _read(self, timeout: float) -> dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"zygote sent nothing within {timeout:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"zygote exited (code {self.proc.poll()})")
        return json.loads(line)

    def launch(
        self,
        fn: str,
        args: list[Any],
        result_dir: str,
        world: int = 2,
        timeout: float = 60.0,
        module: str | None = None,
        path: str | None = None,
    ) -> Job:
        """Fork ``world`` ranks running ``_rank_fns.<fn>(rank, world, *args)``; returns once they exist.

        ``module``/``path``: run ``<module>.<fn>`` instead, the module found in the folder ``path`` (another
        test package's rank bodies). Each rank's return value lands in ``{result_dir}/rank{r}.json``.
        """
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
        )
        assert self.proc.stdin is not None
        job = {"fn": fn, "args": args, "world": world, "store_port": store.port, "timeout": timeout, "out": result_dir}
        job.update(module=module, path=path)
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        pids = self._read(timeout)["pids"]
        return Job(self, store, pids, timeout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Job:
    """One launched job: its rank pids; :meth:`wait` returns how each rank ended."""

    def __init__(self, zygote: Zygote, store: Any, pids: list[int], timeout: float) -> None:
        self.zygote = zygote
        self.store = store  # keeps the rendezvous alive while the ranks run
        self.pids = pids
        self.timeout = timeout
        self.status: list[int] | None = None

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> bool:
        """Signal one rank; ``False`` if it had already ended."""
        if self.status is not None:
            return False
        try:
            os.kill(self.pids[rank], sig)
        except ProcessLookupError:
            return False
        return True

    def wait(self, grace: float | None = None) -> list[int]:
        """Exit codes (``-signal`` if killed). With ``grace``, ranks still running after it are SIGKILLed."""
        if self.status is None:
            if grace is not None:
                end = time.monotonic() + grace
                while time.monotonic() < end:
                    if not any(_alive(p) for p in self.pids):
                        break
                    time.sleep(0.005)
                for p in self.pids:
                    with contextlib.suppress(ProcessLookupError):
                        if _alive(p):
                            os.kill(p, signal.SIGKILL)
            self.status = self.zygote._read(self.timeout)["status"]
            del self.store
        return self.status


def _alive(pid: int) -> bool:
    """Whether ``pid`` (a zygote child) still runs; a zombie (ended, not yet reaped) counts as ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


# ------------------------------------------------------------------------------------------- zygote side
def _rank(job: dict[str, Any], rank: int) -> None:
    """Body of a forked rank; never returns."""
    code = 1
    world, store_port, timeout = job["world"], job["store_port"], job["timeout"]
    try:
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            GLOO_SOCKET_IFNAME="lo",
        )
        import datetime
        import importlib

        import torch
        import torch.distributed as dist

        if job.get("path"):  # another test package's rank bodies (tests/manager): its folder, its module
            sys.path.insert(0, job["path"])
        rank_fns = importlib.import_module(job.get("module") or "_rank_fns")

        torch.set_num_threads(1)
        delta = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", store_port, None, False, timeout=delta)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=delta)
        dist.barrier()
        result = getattr(rank_fns, job["fn"])(rank, world, *job["args"])
        dist.destroy_process_group()
        with open(os.path.join(job["out"], f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        code = 0
    except BaseException:  # noqa: BLE001 - a rank's failure goes to stderr; its exit code tells the test
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve() -> None:
    sys.path.insert(0, _HERE)
    import torch
    import torch.distributed
    import torch.distributed.checkpoint  # noqa: F401

    import dcp_storage  # noqa: F401

    with contextlib.suppress(ImportError):
        import aiobotocore.session  # noqa: F401
        import s3fs  # noqa: F401
    import _rank_fns  # type: ignore[import-not-found]  # noqa: F401

    out = os.fdopen(os.dup(1), "w")  # the protocol; fd 1 now goes to stderr, so prints cannot garble it
    os.dup2(2, 1)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    children: list[int] = []
    try:
        for line in sys.stdin:
            job = json.loads(line)
            children = []
            for rank in range(job["world"]):
                pid = os.fork()
                if pid == 0:
                    _rank(job, rank)
                children.append(pid)
            out.write(json.dumps({"pids": children}) + "\n")
            out.flush()
            status = []
            for pid in children:
                _, raw = os.waitpid(pid, 0)
                status.append(-os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw))
            children = []
            out.write(json.dumps({"status": status}) + "\n")
            out.flush()
    finally:
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


if __name__ == "__main__":
    _serve()
