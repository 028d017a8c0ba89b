"""Wrong bytes are never delivered silently, without ``verify=True``: s3, gs and az.

Two ways the bytes a load reads can differ from those written while every header is right: a bit flipped
in the stored object (at rest), and a server or cache that answers a ranged GET with a ``206`` whose status,
``Content-Range`` and ``Content-Length`` are exact and whose body has one bit flipped (the fault proxy's
``flip_body``). No transport check can see either; before default verification both loaded silently. Now a
default ``FsspecReader`` refuses both, with a :class:`CorruptCheckpointError` naming the file, the key and
the fix, through its block digests (a slice) or its record digest (a small record).
"""

# ruff: noqa: F811 - the fixtures imported from test_range_faults are parameters named after them

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage.formats.dcp_native.reader import FsspecReader
from dcp_storage.formats.dcp_native.writer import FsspecWriter
from dcp_storage.transports import open_transport
from dcp_storage_testing.fault_proxy import FaultRule

from .test_gcs_faults import gcs_proxy, gcs_server  # noqa: F401 - fixtures used by name below
from .test_range_faults import TOLERANT, Store, _config, proxy, store  # noqa: F401 - fixtures used by name

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(20)
    return {"big": torch.randn(640, 1024, generator=g), "small": torch.randn(100, generator=g)}  # 2.5 MiB + 400 B


def _load(store: Store, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dest = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(dest, storage_reader=FsspecReader(store.url, store.options, transport_config=_config(TOLERANT)))
    return dest


def _refused(store: Store, like: dict[str, torch.Tensor]) -> str:
    with pytest.raises(CheckpointException) as info:
        _load(store, like)
    text = str(info.value)
    assert "CorruptCheckpointError" in text and ".distcp" in text and "restore the file" in text, text
    assert "'big'" in text or "'small'" in text, text
    return text


@pytest.fixture
def saved(store: Store, proxy: Any) -> tuple[Store, dict[str, torch.Tensor]]:
    state = _state()
    writer = FsspecWriter(store.url, store.options, overwrite=True, transport_config=_config(TOLERANT))
    dcp.save(state, storage_writer=writer)
    return store, state


def test_a_body_with_a_flipped_bit_and_right_headers_is_refused(saved: tuple[Store, Any], proxy: Any) -> None:
    store, state = saved
    proxy.set_rules([FaultRule("flip_body", path=r"\.distcp")])
    _refused(store, state)
    assert proxy.counters().faults["flip_body"] >= 1
    proxy.clear_rules()
    got = _load(store, state)
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_a_bit_flipped_at_rest_is_refused(saved: tuple[Store, Any], proxy: Any) -> None:
    store, state = saved
    transport, root = open_transport(store.url, store.options)
    with transport:
        names = [transport.join(root, n.rsplit("/", 1)[-1]) for n in transport.listdir(root)]
        name = next(p for p in names if p.endswith(".distcp") and transport.size(p) > 1 << 20)
        data = bytearray(transport.read_range(name, 0, transport.size(name)))
        data[len(data) // 2] ^= 0x04  # inside 'big''s elements: the record still decodes
        transport.write_file(name, bytes(data))
    _refused(store, state)


# ------------------------------------------------------------------------------------ http(s)://
def test_http_a_flipped_bit_in_transit_or_at_rest_is_refused(
    proxied_s3: Any, fault_proxy: Any, moto_server: Any
) -> None:
    """The same checkpoint on moto, public, read as plain HTTP URLs through the proxy."""
    state = _state()
    dcp.save(state, storage_writer=FsspecWriter(proxied_s3.url, proxied_s3.storage_options), no_dist=True)
    s3, root = open_transport(proxied_s3.url, proxied_s3.storage_options)
    bucket, prefix = root.split("/", 1)
    client = moto_server.client()
    with s3:
        names = s3.listdir(root)
        for name in names:
            client.put_object_acl(Bucket=bucket, Key=f"{prefix}/{name}", ACL="public-read")
        http = Store("http", f"{fault_proxy.url}/{root}", {}, fault_proxy)
        assert all(torch.equal(v, state[k]) for k, v in _load(http, state).items())
        fault_proxy.set_rules([FaultRule("flip_body", path=r"\.distcp")])
        _refused(http, state)
        fault_proxy.clear_rules()
        big = max((s3.join(root, n) for n in names if n.endswith(".distcp")), key=s3.size)
        data = bytearray(s3.read_range(big, 0, s3.size(big)))
        data[len(data) // 2] ^= 0x04
        s3.write_file(big, bytes(data))
        client.put_object_acl(Bucket=bucket, Key=big.split("/", 1)[1], ACL="public-read")
        _refused(http, state)
