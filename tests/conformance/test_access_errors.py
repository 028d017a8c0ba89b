"""Credential and permission failures are :class:`~dcp_storage.errors.StorageAccessError`, on s3, gs and az.

They used to surface as the client's bare errors ("Unable to locate credentials", ``PermissionError: The AWS
Access Key Id you provided does not exist in our records``, azure-core's ``HttpResponseError``), naming no
URL, no operation and no fix. Now each names the operation and the URL, keeps the store's own reason, says
where credentials come from (``storage_options``/``-o``, the environment, a profile), is a
``PermissionError`` and a ``DcpStorageError``, and is not retried.

The stores answer for real where they can: moto checks signatures, keys and IAM permissions inside
:meth:`~dcp_storage_testing.s3_server.MotoS3Server.iam_auth`; azurite answers a wrong account key with a 403.
fake-gcs-server checks no credentials at all, so for ``gs://`` a :class:`FaultProxy` in front of it answers
with the 403 JSON body GCS sends (``forbidden_403``).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage.errors import DcpStorageError, StorageAccessError, TransportError
from dcp_storage_testing.azurite import ACCOUNT_KEY
from dcp_storage_testing.fault_proxy import FaultProxy, FaultRule
from dcp_storage_testing.gcs_server import FakeGcsServer
from dcp_storage_testing.s3_server import MotoS3Server

from .conftest import Location

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STATE = {"w": torch.arange(12.0).reshape(3, 4)}
S3_FIX = ("-o key=... -o secret=...", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "profile=NAME", "AWS_PROFILE")


def _saved(location: Location) -> Location:
    dcp.save(dict(STATE), storage_writer=ds.FsspecWriter(location.url, location.storage_options), no_dist=True)
    return location


def _rank_failure(exc: BaseException) -> BaseException:
    if isinstance(exc, CheckpointException):
        failure = next(iter(exc.failures.values()))
        return failure[0] if isinstance(failure, tuple) else failure
    return exc


def _access_error(fn: Any) -> StorageAccessError:
    """Run ``fn``; return the StorageAccessError it raised (directly or as DCP's rank failure)."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - inspected below
        inner = _rank_failure(exc)
        assert isinstance(inner, StorageAccessError), repr(inner)
        assert isinstance(inner, PermissionError) and isinstance(inner, DcpStorageError)
        assert not isinstance(inner, TransportError)  # not "gave up after N attempts": never retried
        return inner
    pytest.fail("no error")


def _assert_message(exc: BaseException, operation_url: str, reason: str, fixes: tuple[str, ...]) -> None:
    text = str(exc)
    assert operation_url in text and reason in text, text
    assert all(fix in text for fix in fixes), text


# ------------------------------------------------------------------------------------------------ s3
@pytest.fixture
def s3_auth(moto_server: MotoS3Server, s3_location: Location) -> Iterator[tuple[Location, dict[str, tuple[str, str]]]]:
    """A saved checkpoint; IAM users (created before auth is on); then moto checking every request."""
    _saved(s3_location)
    keys = {"nobody": moto_server.create_access_key(f"nobody-{uuid.uuid4().hex[:8]}")}  # no policy: may do nothing
    with moto_server.iam_auth():
        yield s3_location, keys


def test_s3_rejected_and_denied_credentials(s3_auth: tuple[Location, dict[str, tuple[str, str]]]) -> None:
    (url, opts, _), keys = s3_auth
    metadata_url = f"read {url}/.metadata"

    unknown = ds.FsspecReader(url, opts)  # moto's default keys: not in IAM
    exc = _access_error(unknown.read_metadata)
    _assert_message(exc, metadata_url, "InvalidAccessKeyId", ("the store rejected the credentials", *S3_FIX))
    assert unknown.counters["retries"] == 0

    key_id, _secret = keys["nobody"]
    exc = _access_error(ds.FsspecReader(url, {**opts, "key": key_id, "secret": "not-the-secret"}).read_metadata)
    _assert_message(exc, metadata_url, "SignatureDoesNotMatch", S3_FIX)

    nobody = {**opts, "key": key_id, "secret": keys["nobody"][1]}
    exc = _access_error(ds.FsspecReader(url, nobody).read_metadata)
    _assert_message(exc, metadata_url, "AccessDenied", ("access denied", "do not allow this operation", *S3_FIX))
    exc = _access_error(lambda: dcp.save(dict(STATE), storage_writer=ds.FsspecWriter(url + "-2", nobody), no_dist=True))
    # the writer's first request that needs rights: a HEAD, whose 403 has no body (no code beyond the status)
    _assert_message(exc, f"exists {url}-2/.metadata", "403", S3_FIX)
    exc = _access_error(lambda: ds.open_reader(url, storage_options=nobody))
    _assert_message(exc, f"list {url}", "AccessDenied", S3_FIX)


def test_s3_without_any_credentials(s3_location: Location, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    url, opts, _ = _saved(s3_location)
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    bare = {k: v for k, v in opts.items() if k not in ("key", "secret")}  # anon=False (the default)
    reader = ds.FsspecReader(url, bare)
    exc = _access_error(reader.read_metadata)
    _assert_message(
        exc, f"read {url}/.metadata", "Unable to locate credentials", ("no credentials were found", *S3_FIX)
    )
    assert reader.counters["retries"] == 0
    exc = _access_error(lambda: dcp.save(dict(STATE), storage_writer=ds.FsspecWriter(url + "-2", bare), no_dist=True))
    _assert_message(exc, "s3://", "Unable to locate credentials", S3_FIX)


# ------------------------------------------------------------------------------------------------ gs
@pytest.fixture
def gs_forbidding(gcs_server: FakeGcsServer, gs_location: Location) -> Iterator[tuple[Location, FaultProxy]]:
    """A saved checkpoint, reached through a proxy that can answer 403 as GCS does."""
    _saved(gs_location)
    with FaultProxy(gcs_server.endpoint_url, dialect="gcs", rewrite_location=True) as proxy:
        yield Location(gs_location.url, {**gs_location.storage_options, "endpoint_url": proxy.url}, "gs"), proxy


def test_gs_forbidden(gs_forbidding: tuple[Location, FaultProxy]) -> None:
    (url, opts, _), proxy = gs_forbidding
    gs_fix = ("-o token=PATH", "GOOGLE_APPLICATION_CREDENTIALS", "gcloud auth application-default login")
    dest = {"w": torch.zeros(3, 4)}
    dcp.load(dest, storage_reader=ds.FsspecReader(url, opts), no_dist=True)  # through the proxy, no rule yet
    assert torch.equal(dest["w"], STATE["w"])

    proxy.set_rules([FaultRule("forbidden_403")])
    reader = ds.FsspecReader(url, opts)
    exc = _access_error(reader.read_metadata)
    _assert_message(
        exc,
        f"read {url}/.metadata",
        "does not have storage.objects.get access",
        ("the store refused the request", *gs_fix),
    )
    # .metadata and the manifest are fetched together on an object store: two requests, neither retried
    assert reader.counters["retries"] == 0 and proxy.counters().faults["forbidden_403"] == 2
    exc = _access_error(lambda: dcp.save(dict(STATE), storage_writer=ds.FsspecWriter(url + "-2", opts), no_dist=True))
    _assert_message(exc, "gs://", "HTTP 403", gs_fix)


# ------------------------------------------------------------------------------------------------ az
def test_az_wrong_account_key(az_location: Location) -> None:
    url, opts, _ = _saved(az_location)
    wrong = base64.b64encode(b"not the account key" * 4).decode()
    bad = {**opts, "connection_string": opts["connection_string"].replace(ACCOUNT_KEY, wrong)}
    az_fix = ("-o account_name=... -o account_key=...", "AZURE_STORAGE_CONNECTION_STRING", "az login")
    reader = ds.FsspecReader(url, bad)
    exc = _access_error(reader.read_metadata)
    _assert_message(exc, f"read {url}/.metadata", "AuthorizationFailure", az_fix)
    assert "Time:" not in str(exc) and "RequestId" not in str(exc)  # the store's first line only
    assert reader.counters["retries"] == 0
    exc = _access_error(lambda: dcp.save(dict(STATE), storage_writer=ds.FsspecWriter(url + "-2", bad), no_dist=True))
    _assert_message(exc, "az://", "AuthorizationFailure", az_fix)
