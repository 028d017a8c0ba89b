"""One emulator subprocess on 127.0.0.1: start, drain its output, wait until it serves HTTP, stop.

Every emulator launcher shares this: moto (:mod:`dcp_storage_testing.s3_server`), s3rver
(:mod:`dcp_storage_testing.s3rver`), fake-gcs-server (:mod:`dcp_storage_testing.gcs_server`) and azurite
(:mod:`dcp_storage_testing.azurite`). What they share is the part that is easy to get subtly wrong: the
output pipe must be drained continuously (emulators log every request; a full pipe blocks the server),
start-up errors must carry the server's last lines, readiness means a real HTTP round trip (a listening
socket is not enough), a failed start must undo everything it set up (process, environment, temp
directories), and ``stop`` must reap the process on every path. :class:`Launcher` is that bookkeeping;
a launcher adds only its command line, its readiness URL and its client helpers.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["HOST", "Launcher", "ServerProcess", "StartStop"]

HOST = "127.0.0.1"


class ServerProcess:
    """A running server process and the last ``log_lines`` lines of its combined stdout/stderr.

    Args:
        name: how errors call the server (``"fake-gcs-server"``).
        cmd: the command line.
        error: the exception class start-up failures raise (the message carries the output tail).
        port_pattern: a regex whose group 1 is the port the server reports it listens on, for servers
            that bind port 0 and print the port; ``None`` when the caller chose the port itself.
        env, cwd: passed to :class:`subprocess.Popen`.
    """

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        error: Callable[[str], Exception],
        *,
        port_pattern: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        log_lines: int = 200,
    ) -> None:
        self.name = name
        self._error = error
        self._port_re = re.compile(port_pattern) if port_pattern else None
        self.port: int | None = None
        self._port_seen = threading.Event()
        self._log: collections.deque[str] = collections.deque(maxlen=log_lines)
        self._proc: subprocess.Popen[str] = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
            cwd=cwd,
        )
        assert self._proc.stdout is not None
        self._reader = threading.Thread(target=self._drain, args=(self._proc.stdout,), name=f"{name}-log", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def exited(self) -> bool:
        return self._proc.poll() is not None

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of output, for error messages."""
        return "\n".join(list(self._log)[-lines:]) or "<no output>"

    def log_contains(self, text: str) -> bool:
        return any(text in line for line in list(self._log))

    def failure(self, what: str) -> Exception:
        """An exception of the caller's class naming the server, ``what`` happened, and the output tail."""
        return self._error(f"{self.name} {what}; output tail:\n{self.tail()}")

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            self._log.append(line.rstrip("\n"))
            if self._port_re is not None and self.port is None:
                match = self._port_re.search(line)
                if match:
                    self.port = int(match.group(1))
                    self._port_seen.set()

    def wait_port(self, deadline: float) -> int:
        """Block until the server printed its port (``port_pattern``); raise if it exits or ``deadline`` passes."""
        while not self._port_seen.wait(timeout=0.05):
            if self.exited():
                self._reader.join(timeout=2)  # its last words are usually the reason
                raise self.failure(f"exited with code {self._proc.returncode} before reporting its port")
            if time.monotonic() > deadline:
                raise self.failure("did not report its port in time")
        assert self.port is not None
        return self.port

    def wait_http(self, url: str, deadline: float) -> None:
        """Block until ``url`` answers with any HTTP status; raise if the server exits or ``deadline`` passes."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
        while True:
            try:
                with opener.open(url, timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # any HTTP status means it is serving
            except OSError as exc:
                if self.exited():
                    self._reader.join(timeout=2)
                    raise self.failure(f"exited with code {self._proc.returncode}") from exc
                if time.monotonic() > deadline:
                    raise self.failure(f"not answering HTTP at {url}: {exc!r}") from exc
                time.sleep(0.02)

    def wait_ready(self, path: str, deadline: float, expect_port: int | None = None) -> int:
        """Wait for the port banner, then for an HTTP answer at ``http://127.0.0.1:PORT{path}``; return the port.

        On any failure (including ``expect_port`` not being the reported port, i.e. someone else's server
        answered) the process is stopped before the error propagates, so a caller never leaks it.
        """
        try:
            port = self.wait_port(deadline)
            if expect_port is not None and port != expect_port:
                raise self.failure(f"reported a port other than {expect_port}")
            self.wait_http(f"http://{HOST}:{port}{path}", deadline)
        except BaseException:
            self.stop()
            raise
        return port

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; reap the process and the log thread. Idempotent."""
        proc = self._proc
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._reader.join(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()


class StartStop:
    """``with obj:`` means ``obj.start()`` ... ``obj.stop()``, for every server and proxy in this package."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class Launcher(StartStop):
    """The life cycle every emulator launcher shares around one :class:`ServerProcess`.

    A subclass implements :meth:`_launch` (start the process and wait until it serves, by the deadline)
    and, when it prepares more than the process, :meth:`_release`. :meth:`start` refuses a second start
    and undoes a failed one; :meth:`stop` stops the process, releases, and restores every environment
    variable set through :meth:`_set_env`, on every path.
    """

    def __init__(self, startup_timeout: float, log_lines: int) -> None:
        self._startup_timeout = startup_timeout
        self._log_lines = log_lines
        self._server: ServerProcess | None = None
        self._saved_env: dict[str, str | None] = {}

    def start(self) -> None:
        """Start the server and block until it answers HTTP; on failure undo everything and raise."""
        if self._server is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        try:
            self._server = self._launch(time.monotonic() + self._startup_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s), release what start set up. Idempotent."""
        server, self._server = self._server, None
        try:
            if server is not None:
                server.stop()
        finally:
            self._release()
            for name, old in self._saved_env.items():
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old
            self._saved_env.clear()

    def _launch(self, deadline: float) -> ServerProcess:
        """Start the server process and return it once it serves (see :meth:`ServerProcess.wait_ready`)."""
        raise NotImplementedError

    def _release(self) -> None:
        """Undo what :meth:`_launch` prepared besides the process (temp dirs, cached clients)."""

    def _set_env(self, name: str, value: str) -> None:
        """Set ``os.environ[name]`` until :meth:`stop` (the first saved value wins if set twice)."""
        self._saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        if self._server is None or self._server.port is None:
            raise RuntimeError(f"{type(self).__name__} is not running")
        return self._server.port

    @property
    def pid(self) -> int:
        if self._server is None:
            raise RuntimeError(f"{type(self).__name__} is not running")
        return self._server.pid
