"""Writers never create buckets or containers; a missing one is named, on save and on load (s3, gs, az).

s3fs's ``makedirs`` used to create a missing bucket, so ``FsspecWriter("s3://typo-bucket/ckpt")`` saved into a
new bucket named by the typo; on gs and az the save failed later with a client error naming no bucket.
Now the coordinator asks once per save whether the bucket exists and raises
:class:`~dcp_storage.errors.BucketNotFoundError` naming it, with the fix (``create_bucket=True``, CLI
``--create-bucket``); loads name it too. Checked on each emulator: moto, fake-gcs-server, azurite.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage.errors import BucketNotFoundError
from dcp_storage.transports import FsspecTransport

from .conftest import Location

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BUCKET_BACKENDS = ("s3", "gs", "az")
NOUN = {"s3": "bucket", "gs": "bucket", "az": "container"}
STATE = {"w": torch.arange(24.0).reshape(6, 4), "b": torch.arange(4, dtype=torch.int32)}
WRITERS = {
    "FsspecWriter": lambda url, opts, **kw: ds.FsspecWriter(url, opts, **kw),
    "SafetensorsWriter": lambda url, opts, **kw: ds.SafetensorsWriter(url, opts, **kw),
}


class Typo:
    """A URL like the location's, in a bucket that does not exist; deletes it afterwards if a test made it."""

    def __init__(self, request: pytest.FixtureRequest, location: Location) -> None:
        self.backend = location.backend
        self.options = location.storage_options
        scheme, rest = location.url.split("://", 1)
        real, _, self.key = rest.partition("/")
        self.bucket = f"{real[:40]}-typo"
        self.url = f"{scheme}://{self.bucket}/{self.key}"
        self._request = request

    def exists(self) -> bool:
        fs = fsspec.filesystem(self.url.split("://")[0], **self.options)
        return bool(fs.exists(self.bucket))

    def delete(self) -> None:
        server = {"s3": "moto_server", "gs": "gcs_server", "az": "azurite_server"}[self.backend]
        admin = self._request.getfixturevalue(server)
        (admin.delete_container if self.backend == "az" else admin.delete_bucket)(self.bucket)


@contextlib.contextmanager
def _typo_of(request: pytest.FixtureRequest, backend: str) -> Iterator[Typo]:
    made = Typo(request, request.getfixturevalue(f"{backend}_location"))
    yield made
    if made.exists():
        with contextlib.suppress(Exception):
            made.delete()


@pytest.fixture(params=BUCKET_BACKENDS)
def typo(request: pytest.FixtureRequest) -> Iterator[Typo]:
    with _typo_of(request, request.param) as made:
        yield made


@pytest.fixture
def s3_typo(request: pytest.FixtureRequest) -> Iterator[Typo]:
    with _typo_of(request, "s3") as made:
        yield made


def _rank_failure(info: pytest.ExceptionInfo[BaseException]) -> BaseException:
    exc = info.value
    if isinstance(exc, CheckpointException):
        failure = next(iter(exc.failures.values()))
        return failure[0] if isinstance(failure, tuple) else failure
    return exc


def _assert_names_bucket(exc: BaseException, typo: Typo, fix: str) -> None:
    assert isinstance(exc, BucketNotFoundError), repr(exc)
    text = str(exc)
    assert f"the {NOUN[typo.backend]} '{typo.bucket}' does not exist" in text, text
    assert fix in text, text


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_save_to_a_missing_bucket_is_refused_and_creates_none(typo: Typo, writer: str) -> None:
    with pytest.raises(CheckpointException) as info:
        dcp.save(dict(STATE), storage_writer=WRITERS[writer](typo.url, typo.options), no_dist=True)
    _assert_names_bucket(_rank_failure(info), typo, "create_bucket=True (--create-bucket)")
    assert not typo.exists()


def test_create_bucket_opts_in(typo: Typo) -> None:
    dcp.save(dict(STATE), storage_writer=ds.FsspecWriter(typo.url, typo.options, create_bucket=True), no_dist=True)
    assert typo.exists()
    dest = {k: torch.zeros_like(v) for k, v in STATE.items()}
    dcp.load(dest, storage_reader=ds.FsspecReader(typo.url, typo.options), no_dist=True)
    assert all(torch.equal(dest[k], STATE[k]) for k in STATE)
    st_url = typo.url + "-st"  # the bucket exists now: create_bucket=True is a no-op
    dcp.save(dict(STATE), storage_writer=ds.SafetensorsWriter(st_url, typo.options, create_bucket=True), no_dist=True)


def test_a_load_from_a_missing_bucket_names_it(typo: Typo) -> None:
    opts = typo.options
    attempts = {
        "FsspecReader": lambda: ds.FsspecReader(typo.url, opts).read_metadata(),
        "SafetensorsReader": lambda: ds.SafetensorsReader(typo.url, opts).read_metadata(),
        "BroadcastingTorchSaveReader": lambda: ds.BroadcastingTorchSaveReader(
            typo.url + "/model.pt", storage_options=opts
        ).read_metadata(),
        "open_reader": lambda: ds.open_reader(typo.url, storage_options=opts),
        "describe": lambda: ds.describe(typo.url, opts),
    }
    for name, attempt in attempts.items():
        with pytest.raises(BucketNotFoundError) as info:
            attempt()
        _assert_names_bucket(info.value, typo, "check the")
        assert "create_bucket" not in str(info.value), name  # a load never offers to create anything
    assert not typo.exists()


class _CountingTransport(FsspecTransport):
    """The real transport, recording every existence question (to count the bucket checks of a save)."""

    asked: list[str]

    def exists(self, path: str) -> bool:
        self.asked.append(path)
        return super().exists(path)


@pytest.mark.parametrize("writer", list(WRITERS))
def test_the_bucket_is_asked_about_once_per_save(s3_location: Location, writer: str) -> None:
    url, opts, _ = s3_location
    fs, _path = fsspec.core.url_to_fs(url, **opts)
    transport = _CountingTransport(fs)
    transport.asked = []
    bucket = url.split("/")[2]
    many = {f"t{i}": torch.full((64,), float(i)) for i in range(12)}  # several data files (thread_count=4)
    kwargs: dict[str, Any] = {"thread_count": 4} if writer == "FsspecWriter" else {"max_shard_size": 600}
    dcp.save(many, storage_writer=WRITERS[writer](url, opts, transport=transport, **kwargs), no_dist=True)
    assert transport.asked.count(bucket) == 1, transport.asked


def test_convert_and_the_cli_refuse_a_missing_bucket_unless_asked(s3_typo: Typo, tmp_path: Path) -> None:
    from tests.cli._helpers import option_flags, run_batch

    typo = s3_typo  # one store is enough for the conversion and CLI paths
    src = str(tmp_path / "src")
    dcp.save(dict(STATE), storage_writer=ds.FsspecWriter(src), no_dist=True)
    with pytest.raises(BucketNotFoundError) as info:
        ds.convert(src, typo.url + "-hf", to="safetensors", storage_options=typo.options)
    _assert_names_bucket(info.value, typo, "--create-bucket")
    with pytest.raises(BucketNotFoundError):
        ds.merge_fsdp_weights(src, typo.url + "-merged", storage_options=typo.options)
    assert not typo.exists()
    flags = option_flags(
        {k: v for k, v in typo.options.items() if k not in ("skip_instance_cache", "use_listings_cache")}, "-o"
    )
    refused, created = run_batch(
        [
            ["convert", src, typo.url + "-cli", "--to", "safetensors", *flags],
            ["convert", src, typo.url + "-cli", "--to", "safetensors", "--create-bucket", *flags],
        ]
    )
    assert refused.rc == 1 and f"'{typo.bucket}' does not exist" in refused.stderr, refused
    assert "pass --create-bucket" in refused.stderr and "create_bucket=" not in refused.stderr, (
        refused
    )  # flags, not keywords
    assert "Traceback" not in refused.stderr, refused
    assert created.rc == 0, created
    assert typo.exists()
    reader = ds.SafetensorsReader(typo.url + "-cli", typo.options)
    dest = {k: torch.zeros_like(v) for k, v in STATE.items()}
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert all(torch.equal(dest[k], STATE[k]) for k in STATE)
