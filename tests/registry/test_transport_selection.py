"""Transports from the registry: by URL scheme, or by the ``transport`` storage option."""

from __future__ import annotations

from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import FsspecReader, FsspecWriter, registry
from dcp_storage.registry import PluginNotFoundError
from dcp_storage.transports import FsspecTransport, TransportConfig, open_transport


class VaultTransport(FsspecTransport):
    """A third-party transport serving ``vault://`` URLs (here: backed by fsspec's memory filesystem)."""

    opened: list[str] = []

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any] | None = None, config: TransportConfig | None = None):
        cls.opened.append(url)
        path = "/vault/" + url.split("://", 1)[1]
        return cls(fsspec.filesystem("memory"), config), path


def test_plugin_scheme_just_works() -> None:
    sd = {"w": torch.arange(20.0).reshape(4, 5)}
    with registry.registered("transports", "vault", VaultTransport):
        dcp.save(sd, storage_writer=FsspecWriter("vault://ckpt/step1"))
        out = {"w": torch.zeros(4, 5)}
        dcp.load(out, storage_reader=FsspecReader("vault://ckpt/step1"))
    assert torch.equal(out["w"], sd["w"])
    assert "vault://ckpt/step1" in VaultTransport.opened


def test_transport_option_selects_by_name() -> None:
    with registry.registered("transports", "vaultish", VaultTransport):
        transport, path = open_transport("memory://x/y", {"transport": "vaultish"})
    assert isinstance(transport, VaultTransport) and path == "/vault/x/y"
    transport, _ = open_transport("memory://x/y", {"transport": "fsspec"})
    assert type(transport) is FsspecTransport
    with pytest.raises(PluginNotFoundError, match="no transports plugin named 'nope'"):
        open_transport("memory://x/y", {"transport": "nope"})
