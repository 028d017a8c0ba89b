"""Two storage entries of a DCP ``.metadata`` may not claim the same bytes of a data file.

Every writer stores each item in its own record, so two keys (or two chunks) whose byte ranges overlap in
one file are an edited or damaged ``.metadata``. When the two keys have the same dtype and shape, each
record check passes and the load fills the second key with the first one's values, silently (checksums
agree too: they are recorded per byte range). The check runs where ``.metadata`` is read, naming both keys
and the file.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo

from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.inspection import verify


def _edited(root: Path, edit: Any) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"a": torch.arange(4.0), "b": torch.arange(4.0) + 10, "c": torch.ones(2)},
            storage_writer=FsspecWriter(str(root), thread_count=1),
            no_dist=True,
        )
    md = pickle.loads((root / ".metadata").read_bytes())
    keys = {k.fqn: k for k in md.storage_data}
    edit(md, keys)
    (root / ".metadata").write_bytes(pickle.dumps(md))
    return root


def _alias(md: Any, keys: dict[str, Any]) -> None:  # "b" read from "a"'s record
    md.storage_data[keys["b"]] = md.storage_data[keys["a"]]


def _inside(md: Any, keys: dict[str, Any]) -> None:  # "c"'s range starts inside "a"'s record
    a, c = md.storage_data[keys["a"]], md.storage_data[keys["c"]]
    md.storage_data[keys["c"]] = _StorageInfo(a.relative_path, a.offset + 1, c.length)


@pytest.mark.parametrize("edit", [_alias, _inside], ids=["same-range", "overlapping"])
def test_entries_sharing_bytes_are_refused(tmp_path: Path, edit: Any) -> None:
    root = _edited(tmp_path / "ckpt", edit)
    with pytest.raises(CorruptCheckpointError) as info:
        FsspecReader(str(root)).read_metadata()
    message = str(info.value)
    assert ".metadata" in message and "__0_0.distcp" in message and "'a'" in message, message
    assert "overlap" in message, message
    report = verify(str(root), deep=True)
    assert not report.ok and any("overlap" in p for p in report.problems), report.problems


def test_entries_in_different_files_at_the_same_offsets_are_fine(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"a": torch.arange(4.0), "b": torch.arange(4.0) + 10}
        dcp.save(state, storage_writer=FsspecWriter(str(tmp_path), single_file_per_rank=False), no_dist=True)
    md = FsspecReader(str(tmp_path)).read_metadata()
    assert len({i.relative_path for i in md.storage_data.values()}) == 2
    assert len({i.offset for i in md.storage_data.values()}) == 1
