"""``describe`` and ``inspect`` on lazy metadata over columns: the same report, byte for byte, as on torch's.

With columns, rows are built from arrays when asked for (``CheckpointInfo.tensors`` is a
:class:`~dcp_storage.formats.reports.TensorRows`); everything a caller sees must equal the plain path's:
rows, totals, ``as_dict``, ``inspect``'s table (with and without ``--chunks``) and its JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import FsspecWriter, describe
from dcp_storage.cli import main
from dcp_storage.formats.columns import ColumnTensors
from dcp_storage.formats.reports import TensorRows
from dcp_storage_testing.columns import columns_forced, synthetic_checkpoint


@pytest.fixture(autouse=True)
def _plain_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain side reads torch's objects even where the environment serves views at any size."""
    monkeypatch.setenv("DCP_STORAGE_METADATA_DECODER", "off")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("columns")
    saved = root / "saved"
    g = torch.Generator().manual_seed(3)
    state = {
        "model": {"w": torch.randn(8, 4, generator=g), "b": torch.zeros(4, dtype=torch.bfloat16)},
        "step": 7,
        "scale": torch.tensor(2.0),
    }
    dcp.save(state, storage_writer=FsspecWriter(saved), no_dist=True)
    return [synthetic_checkpoint(root / "synthetic"), saved]


def _inspect(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["inspect", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("which", [0, 1], ids=["synthetic", "saved"])
def test_describe_on_columns_equals_describe_on_torch_metadata(
    checkpoints: list[Path], which: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(checkpoints[which])
    plain = describe(path)
    with columns_forced(monkeypatch):
        lazy = describe(path)
    assert isinstance(lazy.tensors, ColumnTensors) and not isinstance(plain.tensors, TensorRows)
    assert lazy == plain and plain == lazy
    assert lazy.tensors == plain.tensors and plain.tensors == lazy.tensors
    assert list(lazy.tensors) == plain.tensors
    assert [lazy.tensors[i] for i in range(-len(plain.tensors), len(plain.tensors))] == plain.tensors * 2
    assert lazy.tensors[1:4] == plain.tensors[1:4]
    assert lazy.values == plain.values and lazy.files == plain.files
    assert lazy.totals == plain.totals
    assert lazy.as_dict() == plain.as_dict()
    assert json.dumps(lazy.as_dict()) == json.dumps(plain.as_dict())
    with pytest.raises(IndexError):
        lazy.tensors[len(plain.tensors)]


def test_describe_on_columns_sees_every_kind_of_entry(checkpoints: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    with columns_forced(monkeypatch):
        info = describe(str(checkpoints[0]))
    rows = {t.key: t for t in info.tensors}
    assert len(rows["model.layers.1.w"].chunks) == 4 and rows["model.layers.1.w"].files == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert rows["model.layers.1.b"].chunks[0].offsets == [6]  # the file's order of chunks
    assert rows["model.norm.scale"].shape == [] and rows["model.norm.scale"].nbytes == 4
    assert rows["model.empty"].nbytes == 0 and rows["model.q"].dtype == "float8_e4m3fn"
    assert [v.key for v in info.values] == ["step", "extra_state"]
    assert info.totals["chunks"] == 18 and info.totals["values"] == 2


@pytest.mark.parametrize("which", [0, 1], ids=["synthetic", "saved"])
@pytest.mark.parametrize("flags", [(), ("--chunks",), ("--json",)], ids=["table", "chunks", "json"])
def test_inspect_on_columns_prints_the_same_bytes(
    checkpoints: list[Path],
    which: int,
    flags: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = str(checkpoints[which])
    plain = _inspect(capsys, path, *flags)
    with columns_forced(monkeypatch):
        lazy = _inspect(capsys, path, *flags)
    assert lazy == plain
    if which == 0 and not flags:
        assert "model.\\x1b[2Jodd" in plain and "\x1b" not in plain  # names escaped on both paths
        assert "__0_0.distcp, __1_0.distcp" in plain


def test_inspect_table_is_unchanged(checkpoints: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The table's layout, pinned (streaming it must not move a column)."""
    out = _inspect(capsys, str(checkpoints[0]))
    table = out[out.index("  KEY") :].splitlines()
    assert table[0] == "  KEY                 DTYPE          SHAPE    BYTES  FILES                       CHUNKS"
    assert table[1] == "  model.embed.weight  float32        [16, 8]  512 B  __0_0.distcp                1"
    assert table[4] == "  model.layers.1.w    float64        [6, 4]   192 B  __0_0.distcp, __1_0.distcp  4"
    assert table[11] == "  model.\\x1b[2Jodd    int32          [3]      12 B   __0_0.distcp                1"
    assert table[-2] == "  value step in __1_0.distcp"
