"""The emulator launchers themselves: port handling, start-up errors, bucket/container isolation.

The conformance suite leans on these; if a launcher silently talked to the wrong server or hid why it
failed, the suite's failures would be noise.
"""

from __future__ import annotations

import os
import socket
import urllib.request

import fsspec
import pytest

from dcp_storage.errors import DcpStorageError
from dcp_storage_testing import gcs_server as gcs_module
from dcp_storage_testing.azurite import AzuriteError, AzuriteServer
from dcp_storage_testing.gcs_server import FakeGcsServer, FakeGcsServerError


def test_fake_gcs_retries_when_its_port_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first port we pick is taken by a listening socket: the server must not mistake it for itself."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real_free_port = gcs_module._free_port
        monkeypatch.setattr(gcs_module, "_free_port", lambda: next(ports, None) or real_free_port())
        with FakeGcsServer() as server:
            assert server.port != taken
            endpoint = server.endpoint_url
            with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=5) as response:
                assert response.status == 200
            assert os.environ["STORAGE_EMULATOR_HOST"] == endpoint
            assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
        assert os.environ.get("STORAGE_EMULATOR_HOST") != endpoint  # restored at stop


def test_fake_gcs_gives_up_with_the_log_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        monkeypatch.setattr(gcs_module, "_free_port", lambda: taken)
        server = FakeGcsServer(port_attempts=2)
        with pytest.raises(FakeGcsServerError) as info:
            server.start()
    assert isinstance(info.value, DcpStorageError)
    assert "address already in use" in str(info.value) and "output tail" in str(info.value)
    with pytest.raises(RuntimeError, match="not running"):
        server.port  # noqa: B018 - the property raises


def test_fake_gcs_refuses_a_gcsfs_imported_with_the_probing_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """Imported without the switch, gcsfs would wait ~60 s per bucket: start() must say so at once.

    When ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` is not ``false`` at import, gcsfs's ``__init__`` rebinds
    ``gcsfs.GCSFileSystem`` to a subclass of ``gcsfs.core.GCSFileSystem`` (``ExtendedGcsFileSystem``, whose
    import pulls in gRPC: seconds); a subclass of our own stands in for it.
    """
    import gcsfs
    import gcsfs.core

    class ProbingGcsFileSystem(gcsfs.core.GCSFileSystem):
        pass

    monkeypatch.setattr(gcsfs, "GCSFileSystem", ProbingGcsFileSystem)
    before = dict(os.environ)
    with pytest.raises(FakeGcsServerError, match="GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false"):
        FakeGcsServer().start()
    assert dict(os.environ) == before, "a refused start must restore the environment"


def test_gcs_locations_are_isolated(gcs_server: FakeGcsServer) -> None:
    a = gcs_server.new_location(skip_instance_cache=True)
    b = gcs_server.new_location(skip_instance_cache=True)
    assert a.url != b.url and a.url.startswith("gs://")
    fs, path = fsspec.core.url_to_fs(a.url, **a.storage_options)
    fs.pipe_file(f"{path}/x.bin", b"abc")
    fs_b, path_b = fsspec.core.url_to_fs(b.url, **b.storage_options)
    assert not fs_b.exists(f"{path_b}/x.bin")
    gcs_server.delete_bucket(a.url.split("/")[2])  # deletes the objects first
    gcs_server.delete_bucket(b.url.split("/")[2])
    with pytest.raises(FakeGcsServerError, match="HTTP 404"):
        gcs_server.delete_bucket(a.url.split("/")[2])


def test_azurite_locations_are_isolated(azurite_server: AzuriteServer) -> None:
    a = azurite_server.new_location(skip_instance_cache=True)
    b = azurite_server.new_location(skip_instance_cache=True)
    assert a.url != b.url and a.url.startswith("az://")
    assert azurite_server.endpoint_url.startswith("http://127.0.0.1:")
    fs, path = fsspec.core.url_to_fs(a.url, **a.storage_options)
    fs.pipe_file(f"{path}/x.bin", b"abc")
    assert fs.cat_file(f"{path}/x.bin") == b"abc"
    fs_b, path_b = fsspec.core.url_to_fs(b.url, **b.storage_options)
    assert not fs_b.exists(f"{path_b}/x.bin")
    for location in (a, b):
        azurite_server.delete_container(location.url.split("/")[2])


def test_azurite_missing_install_is_named(tmp_path: os.PathLike[str]) -> None:
    server = AzuriteServer(prefix=os.path.join(tmp_path, "nowhere"), install=False)
    with pytest.raises(AzuriteError, match="not installed under .*nowhere"):
        server.start()
