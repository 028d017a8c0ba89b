"""``BaseTransport``: a store's six primitives are a whole transport.

:class:`DictStore` below implements only the base's abstract methods, over a dict of bytes (a real store:
every object a ``bytes`` value, written whole under a lock, like a key-value service), and passes the whole
storage conformance suite through the registry, as a plugin would; the save lock goes through its
``put_if_absent`` (two saves racing to one location: one wins), never through the check-then-write fallback.
"""

from __future__ import annotations

import inspect
import pickle
import threading
import uuid
import warnings
from collections.abc import Iterable, Iterator
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage import FsspecReader, FsspecWriter, registry
from dcp_storage.errors import CheckpointExistsError, DcpStorageError, TransportError
from dcp_storage.plugin_api import BaseTransport, RetryPolicy, Transport, TransportConfig
from dcp_storage.transports import open_transport
from dcp_storage_testing.conformance import Location, StorageConformance, assert_state_equal, unwrap

MAX_ABSTRACT = 8
SCHEME = "basekv"
_OBJECTS: dict[str, bytes] = {}  # the store's objects, by path (paths carry a fresh id per test)
_LOCK = threading.Lock()
_CREATES: list[str] = []  # every put_if_absent that created an object


class DictStore(BaseTransport):
    """A key-value store of whole objects: the six primitives, nothing else."""

    scheme = SCHEME

    def read_into(self, path: str, start: int, into: memoryview) -> int:
        with _LOCK:
            data = _OBJECTS.get(path)
        if data is None:
            raise FileNotFoundError(path)
        chunk = data[start : start + len(into)]
        into[: len(chunk)] = chunk
        return len(chunk)

    def object_size(self, path: str) -> int:
        with _LOCK:
            if path not in _OBJECTS:
                raise FileNotFoundError(path)
            return len(_OBJECTS[path])

    def list_names(self, path: str) -> Iterable[str]:
        prefix = path.rstrip("/") + "/"
        with _LOCK:
            return {key[len(prefix) :].split("/", 1)[0] for key in _OBJECTS if key.startswith(prefix)}

    def put(self, path: str, body: IO[bytes], nbytes: int) -> None:
        data = body.read(nbytes)
        with _LOCK:
            _OBJECTS[path] = data

    def put_if_absent(self, path: str, data: bytes) -> None:
        with _LOCK:
            if path in _OBJECTS:
                raise FileExistsError(path)
            _OBJECTS[path] = bytes(data)
            _CREATES.append(path)

    def delete(self, path: str) -> None:
        with _LOCK:
            if _OBJECTS.pop(path, None) is None:
                raise FileNotFoundError(path)


@pytest.fixture
def store() -> Iterator[str]:
    """A fresh ``basekv://`` location, with the transport registered under its scheme as a plugin is."""
    root = uuid.uuid4().hex
    with registry.registered("transports", SCHEME, DictStore):
        yield f"{SCHEME}://{root}/ckpt"
    with _LOCK:
        for key in [k for k in _OBJECTS if k.startswith(root + "/")]:
            del _OBJECTS[key]


def own_methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if inspect.isfunction(value)}


def test_the_base_leaves_at_most_eight_methods_to_implement() -> None:
    abstract = set(BaseTransport.__abstractmethods__)
    assert len(abstract) <= MAX_ABSTRACT, sorted(abstract)
    assert abstract == {"read_into", "object_size", "list_names", "put", "put_if_absent", "delete"}
    members = [n for n in dir(Transport) if not n.startswith("_") or n in ("__enter__", "__exit__")]
    protocol = {n for n in members if callable(getattr(Transport, n, None))} | set(Transport.__annotations__)
    assert "create_new" in protocol, "create-if-absent is declared, not a hidden extra"
    with registry.registered("transports", SCHEME, DictStore):
        t, _ = open_transport(f"{SCHEME}://x/y")
    with t:
        assert isinstance(t, Transport)
        missing = [n for n in protocol if not hasattr(t, n)]
        assert not missing, missing
    assert own_methods(DictStore) == abstract, "the store below implements the abstract methods, no more"


class TestDictStoreConformance(StorageConformance):
    """The whole suite on a store made of the six primitives only."""

    @pytest.fixture
    def location(self, store: str) -> Location:
        return Location(store, {}, SCHEME)

    def test_fsdp2_save_2_ranks_load_3_ranks(self) -> None:  # type: ignore[override]
        pytest.skip("the dict lives in this process; the scaffold's directory store runs this test")


def _save(url: str, state: dict[str, Any], **kwargs: Any) -> None:
    dcp.save(state, storage_writer=FsspecWriter(url, **kwargs), no_dist=True)


def test_the_save_lock_goes_through_put_if_absent(store: str) -> None:
    """Two saves racing to one location: exactly one wins, each round, through the store's own primitive."""
    for round_ in range(3):
        url = f"{store}-{round_}"
        states = [{"w": torch.full((64,), float(who + 10 * round_)), "step": who} for who in range(2)]
        outcomes: list[BaseException | None] = [None, None]
        barrier = threading.Barrier(2)

        def race(who: int, url: str = url, states: list[dict[str, Any]] = states) -> None:
            barrier.wait()
            try:
                _save(url, states[who])
            except CheckpointException as exc:
                outcomes[who] = unwrap(exc)

        before = len(_CREATES)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            threads = [threading.Thread(target=race, args=(who,)) for who in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
        assert not [w for w in caught if "create_new" in str(w.message)], [str(w.message) for w in caught]
        assert any(p.endswith(".dcp_storage.lock") for p in _CREATES[before:]), _CREATES[before:]
        losers = [o for o in outcomes if o is not None]
        assert len(losers) == 1 and isinstance(losers[0], CheckpointExistsError), outcomes
        winner = outcomes.index(None)
        out = {"w": torch.zeros(64), "step": -1}
        dcp.load(out, storage_reader=FsspecReader(url), no_dist=True)
        assert_state_equal(out, states[winner])


def test_create_new_answers_its_own_write_after_a_lost_response(store: str) -> None:
    """The first attempt creates the object and then fails (its answer lost): the retry finds it, ``True``."""
    lost = []

    class LosingStore(DictStore):
        def put_if_absent(self, path: str, data: bytes) -> None:
            super().put_if_absent(path, data)
            if not lost:
                lost.append(path)
                raise ConnectionResetError("answer lost")

    fast = TransportConfig(retry=RetryPolicy(initial_backoff=0.001, max_backoff=0.002))
    transport, root = LosingStore.from_url(store, {}, fast)
    with transport:
        path = transport.join(root, "lock")
        assert transport.create_new(path, b"mine") is True and lost == [path]
        assert transport.counters.retries == 1
        assert transport.create_new(path, b"other") is False
        assert transport.create_new(path, b"mine") is True  # its own bytes: a retried request of ours


def test_a_store_without_create_if_absent_falls_back_with_a_warning(store: str) -> None:
    class NoCreate(DictStore):
        def put_if_absent(self, path: str, data: bytes) -> None:
            raise NotImplementedError("this store has no conditional write")

    with registry.registered("transports", SCHEME, NoCreate):
        with pytest.warns(UserWarning, match=r"has no create_new\(\)"):
            _save(store, {"w": torch.ones(4)})
        out = {"w": torch.zeros(4)}
        dcp.load(out, storage_reader=FsspecReader(store), no_dist=True)
        assert torch.equal(out["w"], torch.ones(4))


def test_an_unknown_storage_option_is_refused_by_name(store: str) -> None:
    class Rooted(DictStore):
        def __init__(self, root: str = "/", *, config: TransportConfig | None = None) -> None:
            super().__init__(config)
            self.root = root

    with pytest.raises(DcpStorageError, match=r"Rooted takes no storage option 'anon'; it takes 'root'"):
        Rooted.from_url(store, {"anon": True, "root": "/srv"})
    with pytest.raises(DcpStorageError, match=r"takes no storage option 'root'; it takes none"):
        DictStore.from_url(store, {"root": "/srv"})
    transport, _ = Rooted.from_url(store, {"root": "/srv"})
    with transport:
        assert transport.root == "/srv"


def test_store_errors_name_the_url_and_pickling_keeps_the_store(store: str) -> None:
    class Broken(DictStore):
        def object_size(self, path: str) -> int:
            raise ValueError("the store answered nonsense")

    transport, root = Broken.from_url(store)
    with transport, pytest.raises(TransportError, match=f"{SCHEME}://.*/ckpt/x.bin.*nonsense"):
        transport.size(transport.join(root, "x.bin"))

    transport, root = DictStore.from_url(store)
    with transport:
        transport.write_file(transport.join(root, "a.bin"), b"abc")
        transport.read_ranges([])  # starts the worker threads: they stay behind when pickled
        again = pickle.loads(pickle.dumps(transport))
    with again:
        assert again.read_file(again.join(root, "a.bin")) == b"abc"
        assert again.counters.bytes_written == 3
