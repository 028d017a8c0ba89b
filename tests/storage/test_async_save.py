"""``dcp.async_save`` with our writers, in both of torch's modes, on a local disk and on ``s3://`` (moto).

THREAD mode runs the save on a thread of this process; PROCESS mode pickles the writer (and the staged
state) into a checkpoint process torch spawns once per rank, which is what torchtitan's async
checkpointing uses. Writers must pickle without their pools, locks and clients and open their transport
again there. Each test runs a training loop that changes its parameters right after ``async_save``
returns (after staging, for background stagers) and checks every save bit-exactly, with every stager
configuration torch offers on this machine (pinned memory only where CUDA exists).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import FsspecWriter, SafetensorsWriter
from dcp_storage_testing.compare import same_bits
from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.s3_server import MotoS3Server, S3Location

from . import _async_fns as A

KINDS = ("dcp", "safetensors")
SENTINEL = "Sentinel0SecretForAsyncSave9"


def _target(backend: str, tmp_path: Path, s3_url: Any) -> tuple[str, dict[str, Any]]:
    if backend == "local":
        return str(tmp_path / "ckpt"), {}
    url, options = s3_url
    return url, {**options, "secret": SENTINEL}  # moto takes any secret: a sentinel to look for


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def target(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    s3 = request.getfixturevalue("s3_url") if backend == "s3" else None
    return _target(backend, tmp_path, s3)


def _check(kind: str, saved: list[tuple[str, dict[str, torch.Tensor]]], options: dict[str, Any]) -> None:
    assert len(saved) == len(A.STAGERS)
    for url, expected in saved:
        out = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(out, storage_reader=A.make_reader(kind, url, options), no_dist=True)
        bad = [k for k in expected if not same_bits(out[k], expected[k])]
        assert not bad, f"{url}: {bad} differ from the state at the time of async_save"
    first, second = saved[0][1], saved[1][1]
    assert not any(same_bits(first[k], second[k]) for k in first)  # the loop did change the parameters


def _no_secret_stored(options: dict[str, Any], url: str) -> None:
    if not url.startswith("s3://"):
        return
    import fsspec

    fs = fsspec.filesystem("s3", **options)
    names = fs.find(url.split("://", 1)[1])
    assert names
    assert not [n for n in names if SENTINEL.encode() in fs.cat_file(n)]


@pytest.mark.parametrize("kind", KINDS)
def test_thread_mode(kind: str, target: tuple[str, dict[str, Any]]) -> None:
    url, options = target
    saved = A.train_and_save(kind, url, options, "THREAD", A.STAGERS)
    _check(kind, saved, options)
    _no_secret_stored(options, url)


@pytest.fixture(scope="module")
def process_mode(moto_server: MotoS3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every PROCESS-mode scenario in one rank and one torch checkpoint process (``A.process_mode_all``): the
    saves of both writers locally and on ``s3://``, and the failed save and its retry. Returns each backend's
    ``(url, options)``, each scenario's outcome, and what the rank and the checkpoint process printed (they
    inherit the descriptors 1 and 2 current at the call, pointed here at a file for the duration)."""
    root = tmp_path_factory.mktemp("process_mode")
    s3_url, s3_options = moto_server.new_location("ckpt", skip_instance_cache=True, use_listings_cache=False)
    targets = {"local": _target("local", root, None), "s3": _target("s3", root, (s3_url, s3_options))}
    retry = (str(root / "retry"), {})
    printed = root / "printed.txt"
    saved_fds = [os.dup(1), os.dup(2)]
    try:
        with open(printed, "wb") as sink:
            for fd in (1, 2):
                os.dup2(sink.fileno(), fd)
            (outcomes,) = run_ranks(A.process_mode_all, 1, list(KINDS), targets, retry, timeout=240)
    finally:
        for fd, saved in zip((1, 2), saved_fds, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
    yield {"targets": targets, "retry": retry, "outcomes": outcomes, "printed": printed.read_text(errors="replace")}
    moto_server.delete_bucket(s3_url.split("/")[2])  # moto is in-memory: give it back


def test_process_mode(process_mode: dict[str, Any], backend: str) -> None:
    """Both writers in one rank, so torch spawns one checkpoint process for the two (seconds each)."""
    url, options = process_mode["targets"][backend]
    saved = process_mode["outcomes"][backend]
    assert isinstance(saved, dict), saved  # else the scenario's traceback
    for kind in KINDS:
        _check(kind, saved[kind], options)
    _no_secret_stored(options, url)
    assert SENTINEL not in process_mode["printed"]  # the checkpoint process's output (it inherits the rank's stdio)


def test_process_mode_retry_after_a_failed_save(process_mode: dict[str, Any]) -> None:
    """A PROCESS-mode save that fails after taking its lock, then the same writer again (a new pickled copy
    in the same checkpoint process). Before: the retry was refused, "another save holds this location",
    naming the checkpoint process (thread mode took the lock back); now its ended save's lock is taken over."""
    url = process_mode["retry"][0]
    outcomes = process_mode["outcomes"]["retry"]
    assert isinstance(outcomes, dict), outcomes  # else the scenario's traceback
    assert "injected write failure" in outcomes["failed"], outcomes
    assert outcomes["retry"] == "ok", outcomes
    out = {k: torch.zeros_like(v) for k, v in A.initial_state().items()}
    dcp.load(out, storage_reader=A.make_reader("dcp", url, {}), no_dist=True)
    assert all(same_bits(out[k], v) for k, v in A.initial_state().items())
    assert not (Path(url) / ".dcp_storage.lock").exists()


@pytest.mark.parametrize("cls", [FsspecWriter, SafetensorsWriter])
def test_writers_pickle_without_live_state_and_reopen(cls: type, s3_url: S3Location) -> None:
    """What PROCESS mode relies on: credentials travel, pools/locks/clients/groups do not; the copy
    opens its own transport on first use and the original keeps working."""
    url, options = s3_url
    options = {**options, "secret": SENTINEL}
    writer = cls(url, options)
    writer.transport.exists(writer.root)  # a live client and session in the original
    copy = pickle.loads(pickle.dumps(writer))
    assert "transport" not in copy.__dict__ and copy.storage_options["secret"] == SENTINEL
    assert copy.transport is not writer.transport and copy.transport.fs.storage_options["secret"] == SENTINEL
    assert copy.root == writer.root and copy.counters["requests"] == 0
    assert SENTINEL not in repr(copy)
    assert writer.transport.exists(writer.root) is False


def test_a_given_transport_pickles_too(tmp_path: Path) -> None:
    from dcp_storage.transports import FsspecTransport

    transport, _ = FsspecTransport.from_url(str(tmp_path))
    transport.executor()  # a live thread pool
    writer = FsspecWriter(str(tmp_path / "ckpt"), transport=transport)
    copy = pickle.loads(pickle.dumps(writer))
    assert copy.transport is not transport and copy._given_transport is copy.transport
    dcp.save({"w": torch.arange(4.0)}, storage_writer=copy, no_dist=True)
    assert (tmp_path / "ckpt" / ".metadata").exists()
