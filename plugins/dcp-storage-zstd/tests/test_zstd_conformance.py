"""The core's storage conformance suite (:mod:`dcp_storage_testing.conformance`) with every DCP save
compressed by the zstd extension: on a local directory and on ``memory://``, round trips stay bit-exact,
overwrite and error rules hold (the multi-rank test's rank bodies save without extensions, so it checks the
backend only)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_storage_testing.conformance import Location, StorageConformance, stored, tensor_bytes

from dcp_storage_zstd import ZstdSeekable

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class TestZstdConformance(StorageConformance):
    def extensions(self) -> list[Any]:
        return [ZstdSeekable()]

    def test_the_suite_saves_compressed(self, location: Location) -> None:
        """The attack on this suite itself: were the extension dropped, every test above would still pass."""
        url, options, _ = location
        state = {"zeros": torch.zeros(256, 1024)}
        dcp.save(state, storage_writer=self.dcp_writer(url, options))
        data = {n: size for n, size in stored(location).items() if n.endswith(".distcp")}
        assert data and sum(data.values()) < tensor_bytes(state) // 20, data

    def test_torch_writer_output_read_by_ours(self, location: Any) -> None:
        pytest.skip("torch's own readers know only the extensions registered with their ExtensionRegistry")

    @pytest.fixture(params=["local", "memory"])
    def location(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Location]:
        if request.param == "local":
            yield Location(str(tmp_path / "ckpt"), {}, "local")
        else:
            root = f"/zstd-conformance-{uuid.uuid4().hex}"
            yield Location(f"memory://{root}/ckpt", {}, "memory")
            with contextlib.suppress(FileNotFoundError):
                fsspec.filesystem("memory").rm(root, recursive=True)

    @pytest.fixture
    def shared_location(self, tmp_path: Path) -> Iterator[Location]:
        yield Location(str(tmp_path / "shared"), {}, "local")
