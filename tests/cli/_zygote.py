"""Run ``python -m MODULE ARGS`` / ``python SCRIPT ARGS`` / ``python -c CODE ARGS`` as forks of one process that imported torch once.

Why: every CLI test used to start a fresh interpreter, and each paid ``import torch`` and DCP (seconds on 2
busy cores) before running a command that takes a fraction of that. Here a *zygote* process imports the
third-party libraries the CLI needs (torch, DCP, safetensors, s3fs) and nothing of ``dcp_storage``; each
command line is a plain ``os.fork()`` child of it that then does what the interpreter would: the caller's
environment (``PYTHONPATH`` entries added to ``sys.path``), working directory, ``sys.argv``, stdin, stdout
and stderr (files), ``runpy`` as ``__main__``, the exit code of ``SystemExit`` (or 1 and the traceback for
an uncaught exception) as the process's exit status, atexit handlers, flushed streams. So each command still
runs in a process of its own, with a fresh ``dcp_storage`` (registry, entry points, settings read from the
environment), and its exit status is the process's. What only a new interpreter shows (that ``--help``
imports no torch, a terminal, peak memory, signals) is tested with real interpreters elsewhere.

Protocol (one JSON line each way): the test sends ``{"argv", "env", "cwd", "stdin", "stdout", "stderr"}``
(the last three are file paths); the zygote answers ``{"pid"}`` once forked, then ``{"rc"}`` when the child
ended (``-signal`` if killed). The zygote exits when its stdin closes (the test process ended or died) and
kills a child still running; a child gets SIGKILL when the zygote dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

_PR_SET_PDEATHSIG = 1
# Imported once, before any fork. Third-party only: a dcp_storage module imported here would be shared by
# every command (its registry, its settings), which a fresh interpreter does not do.
_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "safetensors.torch", "numpy")
_PRELOAD_OPTIONAL = ("s3fs", "aiobotocore.session", "gcsfs", "adlfs", "fsspec.implementations.http")


class CliZygote:
    """The test side: one zygote process, commands run one at a time (a lock serialises callers)."""

    def __init__(self, startup_timeout: float = 300.0) -> None:
        self._lock = threading.Lock()
        env = dict(os.environ)
        env.pop("DCP_STORAGE_PROGRESS_DELAY", None)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        line = self._read(startup_timeout)
        if line.get("ready") is not True:
            raise RuntimeError(f"CLI zygote did not start: {line}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self, timeout: float) -> dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"CLI zygote sent nothing within {timeout:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"CLI zygote exited (code {self.proc.poll()})")
        return json.loads(line)

    def run(
        self, argv: list[str], env: dict[str, str], cwd: str, input: str | None, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """``python ARGV`` (``-m MODULE ...``, ``-c CODE ...`` or ``SCRIPT ...``) in a fork; like ``subprocess.run(..., text=True,
        capture_output=True)``, raising :class:`subprocess.TimeoutExpired` (the child killed) after ``timeout``."""
        import tempfile

        with self._lock, tempfile.TemporaryDirectory(prefix="cli-zygote-") as tmp:
            paths = {name: os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")}
            with open(paths["stdin"], "w", encoding="utf-8") as f:
                f.write(input or "")
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(cwd), **paths}) + "\n")
            self.proc.stdin.flush()
            pid = 0
            try:
                pid = self._read(30.0)["pid"]
                rc = self._read(timeout)["rc"]
            except TimeoutError:
                if not pid:  # the zygote never forked: it is stuck, start a new one next time
                    self.close()
                    raise subprocess.TimeoutExpired([sys.executable, *argv], timeout) from None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # never pid 0: that would be this whole process group
                try:
                    self._read(30.0)  # the zygote reaps it and reports
                except BaseException:
                    self.close()  # out of step: the next command starts a new zygote
                    raise
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout) from None
            except BaseException:  # interrupted mid-command (pytest-timeout, ^C): the protocol is out of step
                with contextlib.suppress(ProcessLookupError):
                    if pid:
                        os.kill(pid, signal.SIGKILL)
                self.close()  # the next command starts a new zygote
                raise
            with open(paths["stdout"], encoding="utf-8", errors="replace") as f:
                stdout = f.read()
            with open(paths["stderr"], encoding="utf-8", errors="replace") as f:
                stderr = f.read()
        return subprocess.CompletedProcess([sys.executable, *argv], rc, stdout, stderr)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------------------------------- zygote side
def _child(job: dict[str, Any], base_path: list[str]) -> None:
    """Body of a forked command; never returns."""
    code = 1
    try:
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        import atexit
        import io
        import runpy

        atexit._clear()  # handlers the preloaded libraries registered belong to the zygote...
        if "logging" in sys.modules:  # ...except logging's, which every interpreter runs at exit
            atexit.register(sys.modules["logging"].shutdown)
        for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
            opened = os.open(job[name], mode if fd == 0 else mode | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=sys.__stdin__.encoding)
        sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), encoding=sys.__stdout__.encoding, errors=sys.__stdout__.errors
        )
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False),
            encoding=sys.__stderr__.encoding,
            errors=sys.__stderr__.errors,
            line_buffering=True,
        )
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        os.environ.clear()
        os.environ.update(job["env"])
        if job["env"].get("OMP_NUM_THREADS", "").isdigit():  # torch read it at import, in the zygote
            sys.modules["torch"].set_num_threads(max(1, int(job["env"]["OMP_NUM_THREADS"])))
        os.chdir(job["cwd"])
        argv = list(job["argv"])
        extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        rest = [p for p in base_path if p not in extra]
        try:
            if argv[0] == "-c":
                sys.path[:] = ["", *extra, *rest]
                sys.argv = ["-c", *argv[2:]]
                import builtins
                import types

                main = types.ModuleType("__main__")  # a bare __main__, as the interpreter gives -c
                main.__builtins__ = builtins  # type: ignore[attr-defined]
                sys.modules["__main__"] = main
                exec(compile(argv[1], "<string>", "exec"), vars(main))
            elif argv[0] == "-m":
                sys.path[:] = [os.getcwd(), *extra, *rest]
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                script = os.path.abspath(argv[0])
                sys.path[:] = [os.path.dirname(script), *extra, *rest]
                sys.argv = [argv[0], *argv[1:]]
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
            import traceback

            traceback.print_exc()
            code = 1
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does: join non-daemon threads
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the set-up failed: say why on whatever stderr is
        with contextlib.suppress(BaseException):
            import traceback

            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
        os._exit(code & 0xFF)


def _wait_or_orphaned(child: int) -> int:
    """The child's wait status; if the test process goes away meanwhile (its end of the zygote's stdin
    closes: killed by a CI timeout), the child is killed and this process exits, so neither outlives it."""
    import select

    while True:
        done, raw = os.waitpid(child, os.WNOHANG)
        if done:
            return raw
        # The test process writes nothing while a command runs (it waits for the rc), so stdin turning
        # readable means it closed.
        readable, _, _ = select.select([sys.stdin], [], [], 0.05)
        if readable:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
            os._exit(0)


def _serve() -> None:
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    for name in _PRELOAD_OPTIONAL:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    if threading.active_count() != 1:  # a fork copies only the forking thread: the zygote must have one
        raise RuntimeError(f"CLI zygote has threads after its imports: {threading.enumerate()}")
    out = os.fdopen(os.dup(1), "w")  # the protocol; fd 1 now goes to stderr, so prints cannot garble it
    os.dup2(2, 1)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    child = 0
    try:
        for line in sys.stdin:
            job = json.loads(line)
            child = os.fork()
            if child == 0:
                _child(job, base_path)
            out.write(json.dumps({"pid": child}) + "\n")
            out.flush()
            raw = _wait_or_orphaned(child)
            child = 0
            rc = -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
            out.write(json.dumps({"rc": rc}) + "\n")
            out.flush()
    finally:
        if child:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)


def _shared() -> Any:
    """The one zygote slot of the test process. pytest may import this file under two names (``cli._zygote``
    for the CLI tests, ``tests.cli._zygote`` for tests elsewhere that import the helpers), so the slot lives
    in ``sys.modules``, not in this module's globals."""
    import types

    slot = sys.modules.get(_SLOT)
    if slot is None:
        new = types.ModuleType(_SLOT, "the CLI tests' zygote (tests/cli/_zygote.py)")
        new.zygote = None  # type: ignore[attr-defined]
        new.lock = threading.Lock()  # type: ignore[attr-defined]
        slot = sys.modules.setdefault(_SLOT, new)  # atomic: two first callers get the same slot
    return slot


_SLOT = "_dcp_storage_tests_cli_zygote"


def zygote() -> CliZygote:
    """The test process's zygote, started on first use (or by the root conftest, in the background), closed
    at exit."""
    slot = _shared()
    with slot.lock:
        if slot.zygote is None or not slot.zygote.alive():
            import atexit

            began = time.monotonic()
            slot.zygote = CliZygote()
            slot.zygote.startup_seconds = time.monotonic() - began
            atexit.register(slot.zygote.close)
        return slot.zygote


if __name__ == "__main__":
    _serve()
