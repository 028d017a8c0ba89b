"""Storage references in a ``torch.save`` file's ``data.pkl`` that torch itself never writes.

One storage key referenced as two dtypes of the same byte count: ``torch.load`` hands the second tensor
the first reference's typed storage (so its dtype), a byte reinterpretation would give other values; both
are refused. A malformed persistent id is named in the error by its storage class (``torch.FloatStorage``),
never by an object address, so the message is the same on every rank and every read.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.inspection import describe


class _Pid:
    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _Tensor:
    def __init__(self, pid: tuple[Any, ...], n: int) -> None:
        self.args = (_Pid(pid), 0, (n,), (1,), False, collections.OrderedDict())

    def __reduce__(self) -> Any:
        return (torch._utils._rebuild_tensor_v2, self.args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _Pid) else None


def _torch_file(path: Path, state: dict[str, Any]) -> str:
    pkl = io.BytesIO()
    _Pickler(pkl, protocol=2).dump(state)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl.getvalue())
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/data/0", b"\0" * 64)
        zf.writestr("archive/version", b"3\n")
    return str(path)


def test_one_storage_read_as_two_dtypes_is_refused(tmp_path: Path) -> None:
    url = _torch_file(
        tmp_path / "model.pt",
        {
            "f": _Tensor(("storage", torch.FloatStorage, "0", "cpu", 16), 16),
            "i": _Tensor(("storage", torch.LongStorage, "0", "cpu", 8), 8),
        },
    )
    with pytest.raises(CorruptCheckpointError, match=r"model\.pt.*storage '0'.*torch\.float32.*torch\.int64"):
        describe(url)


@pytest.mark.parametrize(
    "pid",
    [("storage", torch.FloatStorage), ("storage", torch.FloatStorage, 0, "cpu", 16)],
    ids=["short", "int-key"],
)
def test_a_malformed_storage_reference_names_its_class_not_an_address(tmp_path: Path, pid: tuple[Any, ...]) -> None:
    url = _torch_file(tmp_path / "model.pt", {"w": _Tensor(pid, 16)})
    with pytest.raises(CorruptCheckpointError) as info:
        describe(url)
    text = str(info.value)
    assert "model.pt" in text and "torch.FloatStorage" in text, text
    assert not re.search(r"0x[0-9a-f]{6,}", text), text
