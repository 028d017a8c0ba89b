"""Prefix strategies: data files spread over key prefixes, and every reader (ours and torch's) still loads
the checkpoint through ``.metadata``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as TorchFsspecReader
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage import FsspecReader, FsspecWriter, open_reader, registry, verify
from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.strategies import (
    BinaryPrefixStrategy,
    DecimalPrefixStrategy,
    HexPrefixStrategy,
    RoundRobinPrefixStrategy,
)
from dcp_storage.strategies.prefixes import rank_directory
from dcp_storage_testing.compare import same_bits
from dcp_storage_testing.distributed import run_ranks

from . import _prefix_fns as P


def test_numeric_prefixes_vary_in_their_first_character() -> None:
    hex16 = [HexPrefixStrategy().directory(r, 16) for r in range(16)]
    assert hex16[:3] == ["0000000000", "1000000000", "2000000000"] and hex16[15] == "f000000000"
    assert len({d[0] for d in hex16}) == 16  # the keys part at the first character
    assert HexPrefixStrategy().directory(16, 17) == "0100000000"  # two digits once 16 are not enough
    assert BinaryPrefixStrategy(min_length=3).directory(2, 4) == "010"
    assert DecimalPrefixStrategy(min_length=2, epoch=7).directory(13, 20) == "31/epoch_7"
    assert HexPrefixStrategy(count=2).directory(3, 8) == HexPrefixStrategy(count=2).directory(1, 8)
    assert RoundRobinPrefixStrategy(["a", "b/c"]).directory(3, 4) == "b/c"


@pytest.mark.parametrize(
    "bad",
    [
        lambda: HexPrefixStrategy(min_length=0),
        lambda: HexPrefixStrategy(count=0),
        lambda: RoundRobinPrefixStrategy([]),
        lambda: RoundRobinPrefixStrategy(["../up"]),
        lambda: DecimalPrefixStrategy(epoch=-1),
    ],
)
def test_bad_options_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError):
        bad()


def _load(reader: Any) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in P.full_state().items()}
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def _same(out: dict[str, torch.Tensor]) -> bool:
    return all(same_bits(out[k], v) for k, v in P.full_state().items())


def test_two_ranks_local_every_reader(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_ranks(P.save_sharded, 2, str(path), {}, timeout=120)
    data = sorted(str(p.relative_to(path)) for p in path.rglob("*.distcp"))
    assert sorted({d.split("/")[0] for d in data}) == ["0000", "1000"], data  # one prefix per rank
    assert all(d.startswith(("0000/__0_", "1000/__1_")) for d in data), data
    assert not list(path.glob("*.distcp"))
    for reader in (dcp.FileSystemReader(str(path)), TorchFsspecReader(str(path)), FsspecReader(str(path))):
        assert _same(_load(reader)), type(reader)
    report = verify(path, deep=True)
    assert report.ok and report.checked["checksum_records"] == 4, report


def test_s3_our_readers_and_overwrite_retires_old_files(s3_url: Any) -> None:
    url, options = s3_url
    strategy = RoundRobinPrefixStrategy(["p0", "p1"], epoch=2)
    for _ in range(2):  # the second save replaces the first: its data files are retired, not left behind
        dcp.save(
            P.full_state(),
            storage_writer=FsspecWriter(url, options, overwrite=True, prefix_strategy=strategy),
            no_dist=True,
        )
    fs = fsspec.filesystem("s3", **options)
    data = [p for p in fs.find(url.split("://", 1)[1]) if p.endswith(".distcp")]
    assert len({name.rsplit("/", 1)[1].split("_")[2] for name in data}) == 1, data  # one save's files only
    assert all(name.split("/")[-3:-1] == ["p0", "epoch_2"] for name in data), data
    assert _same(_load(FsspecReader(url, options)))
    assert _same(_load(open_reader(url, storage_options=options)))
    assert verify(url, storage_options=options, deep=True).ok


def test_registered_strategy_by_name_and_bad_ones(tmp_path: Path) -> None:
    with registry.registered("strategies", "test-prefixes", RoundRobinPrefixStrategy(["shelf"])):
        dcp.save(
            P.full_state(), storage_writer=FsspecWriter(tmp_path / "a", prefix_strategy="test-prefixes"), no_dist=True
        )
    assert list((tmp_path / "a" / "shelf").glob("__0_*.distcp"))
    assert _same(_load(dcp.FileSystemReader(str(tmp_path / "a"))))
    with pytest.raises(TypeError, match="directory"):
        FsspecWriter(tmp_path / "b", prefix_strategy=42)  # type: ignore[arg-type]

    class Escaping:
        def directory(self, rank: int, world_size: int) -> str:
            return "../outside"

    with pytest.raises(CorruptCheckpointError, match="escapes the checkpoint"):
        rank_directory(Escaping(), 0, 1)
    with pytest.raises(CheckpointException, match="escapes the checkpoint"):  # torch wraps ours
        dcp.save(P.full_state(), storage_writer=FsspecWriter(tmp_path / "c", prefix_strategy=Escaping()), no_dist=True)
    assert not (tmp_path / "outside").exists() and not list((tmp_path / "c").rglob("*.distcp"))
