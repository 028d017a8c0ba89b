"""An HTTP redirect to another origin never takes the checkpoint's credentials along (issue 20).

Two loopback servers on different ports (different origins): ``home`` redirects the checkpoint to
``elsewhere``, which serves other bytes. The client's storage options carry an API-key header and an
``Authorization`` header. Refused by default, before any request reaches ``elsewhere``; a redirect within
``home`` keeps working; with ``cross_origin_redirects="follow-without-credentials"`` the other host is
asked without any header from the storage options.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save as st_save
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage.errors import CrossOriginRedirectError
from dcp_storage.transports import FsspecTransport, RetryPolicy, TransportConfig
from dcp_storage_testing.http_store import HttpStore

API_KEY = "SENTINEL-api-key-7f3a"
BEARER = "Bearer SENTINEL-bearer-91c2"
CONFIG = TransportConfig(retry=RetryPolicy(max_attempts=3, initial_backoff=0.01, deadline=30.0))
GOOD = {"w": torch.arange(64, dtype=torch.float32)}
EVIL = {"w": torch.full((64,), 666.0)}


@pytest.fixture
def servers() -> Iterator[tuple[HttpStore, HttpStore]]:
    with HttpStore() as home, HttpStore({"model.safetensors": st_save(EVIL)}) as elsewhere:
        assert home.server_address[1] != elsewhere.server_address[1]
        home.put("moved.safetensors", st_save(GOOD))
        home.redirects["model.safetensors"] = elsewhere.url("model.safetensors")
        home.redirects["old.safetensors"] = "/moved.safetensors"  # within the same origin
        yield home, elsewhere


def _options(**extra: Any) -> dict[str, Any]:
    return {"headers": {"X-Api-Key": API_KEY, "Authorization": BEARER}, "skip_instance_cache": True, **extra}


def _leaked(server: HttpStore) -> list[str]:
    return [v for r in server.log for v in r.headers.values() if API_KEY in v or "SENTINEL-bearer" in v]


def test_cross_origin_redirect_is_refused_before_any_request_goes_there(servers: Any) -> None:
    home, elsewhere = servers
    transport, path = FsspecTransport.from_url(home.url("model.safetensors"), _options(), CONFIG)
    with transport:
        with pytest.raises(CrossOriginRedirectError, match="another origin") as info:
            transport.read_range(path, 0, 8)
        assert elsewhere.url("model.safetensors") in str(info.value)
        with pytest.raises(CrossOriginRedirectError):
            transport.size(path)
        with pytest.raises(CrossOriginRedirectError):
            transport.read_file(path, max_bytes=1 << 20)
        assert transport.counters.retries == 0
    assert elsewhere.log == []  # not even asked


def test_dcp_load_through_a_cross_origin_redirect_is_refused(servers: Any) -> None:
    home, elsewhere = servers
    reader = ds.SafetensorsReader(home.url("model.safetensors"), _options(), transport_config=CONFIG)
    dest = {"w": torch.zeros(64)}
    with pytest.raises((CrossOriginRedirectError, CheckpointException)) as info:
        dcp.load(dest, storage_reader=reader, no_dist=True)
    assert "another origin" in str(info.value)
    assert not torch.equal(dest["w"], EVIL["w"]) and elsewhere.log == []


def test_same_origin_redirect_is_followed_with_the_headers(servers: Any) -> None:
    home, _ = servers
    reader = ds.SafetensorsReader(home.url("old.safetensors"), _options(), transport_config=CONFIG)
    dest = {"w": torch.zeros(64)}
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert torch.equal(dest["w"], GOOD["w"])
    assert any(r.path == "/moved.safetensors" and r.headers.get("X-Api-Key") == API_KEY for r in home.log)


def test_follow_without_credentials_when_asked(servers: Any) -> None:
    home, elsewhere = servers
    opts = _options(cross_origin_redirects="follow-without-credentials")
    transport, path = FsspecTransport.from_url(home.url("model.safetensors"), opts, CONFIG)
    with transport:
        assert bytes(transport.read_range(path, 0, 8)) == st_save(EVIL)[:8]
    assert elsewhere.log and not _leaked(elsewhere)
    assert _leaked(home)  # the home server did get them: they were the user's for it


def test_a_bad_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="cross_origin_redirects"):
        FsspecTransport.from_url("http://127.0.0.1:1/x", {"cross_origin_redirects": "always"})
