"""``BaseTransport``: a transport for any store from six primitives; the base does the rest.

The :class:`~dcp_storage.transports.protocol.Transport` protocol has twenty members, because that is what the
core asks of a store: ranged reads that coalesce and run concurrently within a byte budget, retries, atomic
writes, counters, a worker pool, URL handling, pickling. Almost none of it depends on the store. A store
really has six operations, which a subclass implements, each as ONE attempt of one request:

========================  =============================================================================
``read_into``             bytes of one object from an offset into a buffer (a ranged GET, a ``pread``)
``object_size``           the size of one object (a HEAD, a ``stat``)
``list_names``            the names directly under a prefix (a delimited LIST, a ``listdir``)
``put``                   write one object whole, replacing any, atomically (a PUT, temp file + rename)
``put_if_absent``         the same, only if nothing is there (``If-None-Match: *``, ``link``/``O_EXCL``)
``delete``                delete one object
========================  =============================================================================

Everything else is built on them here: ``read_ranges`` over the core's planner (coalescing near ranges,
splitting large ones: :func:`~.ranges.plan_fetches`) and runner (:class:`~.ranges.RangeRun`: concurrency on
:meth:`executor`, ``max_inflight_bytes``, ``on_complete``), ``read_file`` with its size limit checked before
any byte is read, ``open_atomic`` (spooled in memory up to ``part_size``, then in a temporary file, and sent
by one ``put`` when the block exits: nothing on an exception), ``create_new`` for the save lock (with the
lost-response check :func:`holds`), ``exists``/``listdir``/``remove_tree`` over listing and
deleting, retries under ``config.retry`` (counted), counters, errors of the project's hierarchy naming the URL,
``reconfigured``, ``close`` and pickling. A store with better ways (streamed multipart uploads, a server-side
recursive delete) overrides the matching method; the protocol's docstring says what each must keep.

Primitives raise ``FileNotFoundError`` for a missing object (``put_if_absent``: ``FileExistsError`` for a
present one) and let other failures out as they are: ``config.retry.classify`` decides which are transient
(connection resets, timeouts, 5xx and throttling, by class, errno, status or code: :func:`~.retry.is_transient`).

A subclass sets ``scheme`` (its URLs are ``scheme://PATH``; paths are what follows ``://``) and takes its
storage options as keyword arguments of ``__init__`` (``from_url`` passes them), calling
``super().__init__(config)``. The ``dcp-storage plugins new NAME`` template is one, over a local directory.

Create-if-absent writes: the one primitive that lets exactly one of two writers win.

A save claims its location by creating a small object that must not exist yet
(:mod:`dcp_storage.formats.commit_claim`). Checking first and writing second is not enough: two writers both see
"absent" and both write. Each store has an atomic primitive, which its transport's ``create_new`` uses
(GCS's is in :mod:`.gcs`, S3's in :mod:`.s3_upload`, ``memory://``'s in :mod:`.fsspec_transport`, the local
disk's and the lost-response check here):

* local disk: ``open(O_CREAT | O_EXCL)``, then the bytes. No ``fsync``: every process sees the file at
  once, and a claim only has to outlive its save's process, not the machine (after a power loss no save
  is running any more);
* S3: ``PutObject`` with ``If-None-Match: *`` (``412 PreconditionFailed`` when the key exists; a
  ``409 ConditionalRequestConflict`` while another conditional write to the key is in flight is retried);
* GCS: an upload with ``ifGenerationMatch=0`` (``412``, which gcsfs maps to ``FileExistsError``);
* anything else: fsspec's ``pipe_file(path, data, mode="create")``. adlfs sends ``If-None-Match: *``
  (azurite and Azure answer ``409 BlobAlreadyExists``, adlfs raises ``FileExistsError``); ``memory://``
  checks its store and then writes, so those calls hold a process-wide lock (the store lives in the
  process, so the lock makes the pair atomic). A filesystem that does not implement ``mode="create"``
  inherits fsspec's default, which checks and then writes: not atomic (a third-party filesystem's own
  limit, stated in the README).

A request retried after a lost response (the store created the object, the answer never arrived) sees its
own object and would report "exists": ``create_new`` then compares the stored bytes with its own
(:func:`holds`; the callers' bytes carry a random save id), so a lost response does not turn a winner
into a loser.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import inspect
import io
import os
import posixpath
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, ClassVar, TypeVar

from dcp_storage.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DcpStorageError,
    FileTooLargeError,
    StorageAccessError,
    TransportError,
)
from dcp_storage.transports.protocol import (
    CountingWriter,
    TransportConfig,
    TransportCounters,
    WorkerPool,
    resolve_config,
)
from dcp_storage.transports.ranges import FetchGroup, RangeRequest, RangeRun, plan_fetches
from dcp_storage.transports.retry import TruncatedReadError, call_with_retry

__all__ = ["BaseTransport", "create_local", "holds"]

T = TypeVar("T")
_B = TypeVar("_B", bound="BaseTransport")


class BaseTransport(abc.ABC):
    """A :class:`~.protocol.Transport` made of six store primitives (see the module docstring).

    Thread-safe as long as the primitives are: they are called from the worker threads of :meth:`executor`
    and from the caller's threads at once.
    """

    scheme: ClassVar[str] = ""
    """The URL scheme served: ``url(path)`` is ``f"{scheme}://{path}"``."""
    is_local: ClassVar[bool] = False
    """Whether paths are local file-system paths (the core then reads them with ``os`` calls, bypassing the
    transport): leave it ``False`` unless they are."""

    def __init__(self, config: TransportConfig | None = None) -> None:
        self.config = resolve_config(config or TransportConfig(), self.is_local)
        self.counters = TransportCounters()
        self._workers = WorkerPool(self.config.max_workers, f"dcp-{self.scheme or 'store'}-io")

    # ------------------------------------------------------------------ the store's primitives (one attempt)
    @abc.abstractmethod
    def read_into(self, path: str, start: int, into: memoryview) -> int:
        """Fill ``into`` with the bytes of ``path`` from ``start``; return how many were read: fewer than
        ``len(into)`` only where the object ends (0 from a ``start`` at or past its end)."""

    @abc.abstractmethod
    def object_size(self, path: str) -> int:
        """The size in bytes of the object ``path``; ``FileNotFoundError`` if there is none."""

    @abc.abstractmethod
    def list_names(self, path: str) -> Iterable[str]:
        """The names (not paths) of the objects and prefixes directly under ``path``; none (or
        ``FileNotFoundError``) where there are none. Writes in progress are not listed."""

    @abc.abstractmethod
    def put(self, path: str, body: IO[bytes], nbytes: int) -> None:
        """Write the object ``path`` from ``body`` (``nbytes`` bytes, read from its current position),
        replacing any: readers see the old object or the new one whole, never a part."""

    @abc.abstractmethod
    def put_if_absent(self, path: str, data: bytes) -> None:
        """Write ``data`` as the object ``path`` only if nothing is there, atomically, else raise
        ``FileExistsError``: of two concurrent callers exactly one succeeds."""

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Delete the object ``path`` (nothing, or ``FileNotFoundError``, if there is none)."""

    # ---------------------------------------------------------------------------------------- building
    @classmethod
    def from_url(
        cls: type[_B],
        url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        config: TransportConfig | None = None,
    ) -> tuple[_B, str]:
        """The transport (``cls(config=config, **storage_options)``) and the path of ``url`` on it; a storage
        option ``__init__`` does not take is refused naming the ones it does."""
        options = dict(storage_options or {})
        params = inspect.signature(cls.__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            taken = [n for n, p in params.items() if n not in ("self", "config") and p.kind is not p.VAR_POSITIONAL]
            unknown = sorted(set(options) - set(taken))
            if unknown:
                raise DcpStorageError(
                    f"{os.fspath(url)}: {cls.__name__} takes no storage option {', '.join(map(repr, unknown))}; "
                    f"it takes {', '.join(map(repr, taken)) or 'none'}"
                )
        transport = cls(config=config, **options)
        return transport, transport.strip_url(os.fspath(url))

    def url(self, path: str) -> str:
        """A URL for ``path``, for messages."""
        return f"{self.scheme}://{path}"

    def strip_url(self, url: str) -> str:
        """``scheme://PATH`` -> ``PATH``; a path without a scheme is returned as is."""
        url = os.fspath(url)
        scheme, sep, rest = url.partition("://")
        if not sep:
            return url.rstrip("/")
        if scheme.lower() != self.scheme:
            raise ValueError(f"{url}: {type(self).__name__} serves {self.scheme}:// URLs")
        return rest.rstrip("/")

    def join(self, root: str, *names: str) -> str:
        return posixpath.join(root.rstrip("/"), *names) if root else posixpath.join(*names)

    # --------------------------------------------------------------------------------- retries, errors
    def _call(self, fn: Callable[[], T], path: str, what: str) -> T:
        """``fn`` retried under ``config.retry`` (retries counted); failures as the project's errors."""
        describe = lambda: f"{what} {self.url(path)}"  # noqa: E731
        try:
            return call_with_retry(fn, self.config.retry, describe, on_retry=lambda _e: self.counters.add(retries=1))
        except (DcpStorageError, NotImplementedError):  # decided already; or the store cannot (create_new)
            raise
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{self.url(path)}: no such file") from exc
        except PermissionError as exc:
            raise StorageAccessError(f"{describe()}: permission denied ({exc})") from exc
        except Exception as exc:
            raise TransportError(f"{describe()} failed: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------------------------------ queries
    def exists(self, path: str) -> bool:
        """Whether an object, or any object under the prefix ``path/``, exists."""
        try:
            self.size(path)
            return True
        except CheckpointNotFoundError:
            return bool(self.listdir(path))

    def size(self, path: str) -> int:
        return int(self._call(lambda: self.object_size(path), path, "size of"))

    def listdir(self, path: str) -> list[str]:
        def names() -> list[str]:
            try:
                return sorted(set(self.list_names(path)))
            except (FileNotFoundError, NotADirectoryError):
                return []  # nothing there, or an object: no names under it

        return self._call(names, path, "list")

    def makedirs(self, path: str) -> None:
        """Nothing: objects are written under any prefix (a store that needs folders makes them in ``put``)."""

    def remove(self, path: str) -> None:
        with contextlib.suppress(CheckpointNotFoundError):
            self._call(lambda: self.delete(path), path, "delete")

    def remove_tree(self, path: str) -> None:
        """Every object under ``path/``, depth first; ``path`` itself where it is an object (lists nothing)."""
        names = self.listdir(path)
        for name in names:
            self.remove_tree(self.join(path, name))
        if not names and path:
            self.remove(path)

    # ------------------------------------------------------------------------------------------ reading
    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """A whole object; its size comes first, so one over ``max_bytes`` is refused before any byte is read.
        At most ``size + 1`` bytes are asked for: an object that grew since is read again, never cut short."""

        def fetch() -> bytes:
            size = self.object_size(path)
            if max_bytes is not None and size > max_bytes:
                raise FileTooLargeError(self.url(path), size, max_bytes)
            buffer = bytearray(size + 1 if max_bytes is None else min(size, max_bytes) + 1)
            got = self.read_into(path, 0, memoryview(buffer))
            self.counters.add(requests=1, bytes_read=got)
            if max_bytes is not None and got > max_bytes:
                raise FileTooLargeError(self.url(path), None, max_bytes)
            if got != size:  # changed between the size and the read: read it again
                raise TruncatedReadError(f"{self.url(path)}: {got} bytes read of a {size}-byte object")
            del buffer[got:]
            return bytes(buffer)

        return self._call(fetch, path, "read")

    def read_range(self, path: str, start: int, end: int) -> memoryview:
        return self.read_ranges([RangeRequest(path, start, end)])[0]  # type: ignore[return-value]

    def read_ranges(self, requests: Sequence[RangeRequest]) -> list[memoryview | None]:
        """Every request, coalesced and split by :func:`~.ranges.plan_fetches`, run by :class:`~.ranges.RangeRun`
        on :meth:`executor` within ``config.max_inflight_bytes``: one ``read_into`` per fetch group."""
        cfg = self.config
        groups = plan_fetches(requests, cfg.coalesce_gap, cfg.max_request_bytes)  # type: ignore[arg-type]
        return RangeRun(requests, groups, self._fetch_group, self.executor(), cfg.max_inflight_bytes).execute()

    def _fetch_group(self, group: FetchGroup, views: list[memoryview]) -> None:
        """One group: straight into its only destination, or into one buffer scattered to several (the gaps
        between coalesced ranges are read and dropped). A short answer from an object long enough is retried."""
        target = views[0] if len(views) == 1 else memoryview(bytearray(group.length))

        def fetch() -> None:
            got = self.read_into(group.path, group.start, target)
            self.counters.add(requests=1, bytes_read=got)
            if got != group.length:
                size = self.object_size(group.path)
                if size < group.end:
                    raise CorruptCheckpointError(
                        f"{self.url(group.path)}: object ends at byte {size} but bytes up to {group.end} were "
                        "expected (truncated file?)"
                    )
                raise TruncatedReadError(f"{self.url(group.path)}: got {got} of {group.length} bytes")

        self._call(fetch, group.path, f"read bytes [{group.start}, {group.end}) of")
        if len(views) > 1:
            for seg, view in zip(group.segments, views):
                view[:] = target[seg.start - group.start : seg.end - group.start]

    # ------------------------------------------------------------------------------------------ writing
    def write_file(self, path: str, data: bytes | bytearray | memoryview) -> None:
        payload = bytes(memoryview(data))  # private: a retry sends these bytes again, whatever the caller does

        def put() -> None:
            self.put(path, io.BytesIO(payload), len(payload))

        self._call(put, path, f"write ({len(payload)} bytes)")
        self.counters.add(requests=1, bytes_written=len(payload))

    def create_new(self, path: str, data: bytes) -> bool:
        """``put_if_absent``: ``True`` if this call created ``path``, also when a retry after a lost answer
        finds its own bytes there (:func:`holds`). One request; not in ``bytes_written``."""
        payload = bytes(data)
        self.counters.add(requests=1)

        def create() -> bool:
            try:
                self.put_if_absent(path, payload)
                return True
            except FileExistsError:
                return False

        return self._call(create, path, "create if absent") or holds(self, path, payload)

    @contextlib.contextmanager
    def open_atomic(self, path: str) -> Iterator[CountingWriter]:
        """Bytes spooled (in memory up to ``config.part_size``, then in a temporary file), then one ``put``,
        retried from the start of the spool: nothing reaches the store on an exception inside the block."""
        with tempfile.SpooledTemporaryFile(max_size=self.config.part_size) as spool:
            writer = CountingWriter(spool, self.counters)  # type: ignore[arg-type]
            yield writer
            nbytes = writer.written

            def put() -> None:
                spool.seek(0)
                self.put(path, spool, nbytes)  # type: ignore[arg-type]

            self._call(put, path, f"write ({nbytes} bytes)")
        self.counters.add(requests=1)

    # ---------------------------------------------------------------------------------------- resources
    def executor(self) -> ThreadPoolExecutor:
        return self._workers.get()

    def reconfigured(self: _B, config: TransportConfig) -> _B:
        """A shallow copy (the same store, client and counters) with ``config`` and threads of its own."""
        other = copy.copy(self)
        other.config = resolve_config(config, self.is_local)
        other._workers = WorkerPool(other.config.max_workers, f"dcp-{self.scheme or 'store'}-io")
        return other

    def close(self) -> None:
        self._workers.shutdown()

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its threads (started again on first use); a subclass holding a client or socket
        drops it here too and builds it again on first use."""
        state = self.__dict__.copy()
        del state["_workers"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._workers = WorkerPool(self.config.max_workers, f"dcp-{self.scheme or 'store'}-io")


# ------------------------------------------------------------------------------ create-if-absent helpers
_OWN_CHECK_LIMIT = 64 * 1024  # a claim is a few hundred bytes: a larger object is not ours, and is not read


def create_local(path: str, data: bytes) -> bool:
    """``O_CREAT | O_EXCL``, then the bytes: ``True`` if this call created ``path``."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise
    finally:
        os.close(fd)
    return True


def holds(transport: Any, path: str, data: bytes) -> bool:
    """Whether the object at ``path`` is ``data``: our own write, whose first response was lost.

    For any transport with ``size`` and ``read_file`` (a plugin's ``create_new`` uses it too).
    """
    try:
        if transport.size(path) != len(data) or len(data) > _OWN_CHECK_LIMIT:
            return False
        return bytes(transport.read_file(path)) == bytes(data)
    except FileNotFoundError:  # removed meanwhile: still not ours
        return False
