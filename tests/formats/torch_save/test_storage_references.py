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


def _views_of_one_storage() -> dict[str, Any]:
    """Values (tuples: non-tensor items for DCP) holding many tensors over the storage of ``w`` (1 MiB),
    as the same object, as distinct views, and as broadcast views: ``torch.load`` gives views of one
    storage each time, so the file stays near 1 MiB."""
    w = torch.arange(256 * 1024, dtype=torch.float32)
    return {
        "w": w,
        "same": tuple([w] * 64),
        "views": tuple(w[i * 1024 :] for i in range(64)),
        "expanded": tuple(w[:1].expand(1 << 20) for _ in range(64)),
    }


def test_tensors_sharing_a_storage_in_a_value_are_read_once(tmp_path: Path) -> None:
    """A value holding N tensors over one storage decodes to N views of one storage read, as ``torch.load``
    gives. Before, each tensor was read and materialised on its own: a 1 MiB file whose tuple repeats one
    tensor 10,000 times (a few bytes of pickle each) made ``value_bytes`` read and hold 10 GiB, on the
    coordinator of ``BroadcastingTorchSaveReader`` and in ``convert``."""
    from dcp_storage.formats.torch_save import TorchSaveArchive
    from dcp_storage.transports import bind_transport

    state = _views_of_one_storage()
    path = tmp_path / "views.pt"
    torch.save(state, path)
    assert path.stat().st_size < 2 << 20
    transport, local = bind_transport(str(path), {}, None, None)
    archive = TorchSaveArchive.open(transport, local)
    for key in ("same", "views", "expanded"):
        data = archive.value_bytes(key)
        assert len(data) < 2 << 20, (key, len(data))  # one storage, not 64 tensors' bytes
        got = torch.load(io.BytesIO(data), weights_only=True)
        assert len(got) == 64 and all(torch.equal(a, b) for a, b in zip(got, state[key])), key
        assert len({t.untyped_storage().data_ptr() for t in got}) == 1, key
    assert transport.counters.snapshot()["bytes_read"] < 8 << 20


def test_values_repeating_one_storage_are_bounded_like_broadcast_views(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each value is saved with its own copy of the storages it names, so N values naming one storage cost
    N copies (in ``convert``, and on the coordinator of ``BroadcastingTorchSaveReader``). Together they may
    repeat the file's stored bytes by at most ``DCP_STORAGE_MAX_BROADCAST_BYTES``, as one view may."""
    import dcp_storage as ds

    monkeypatch.setenv("DCP_STORAGE_MAX_BROADCAST_BYTES", str(4 << 20))
    w = torch.ones(256 * 1024)  # 1 MiB
    path = tmp_path / "values.pt"
    torch.save({"w": w, **{f"v{i}": (w, i) for i in range(3)}}, path)
    ds.conversion.torch_save_to_dcp(str(path), str(tmp_path / "ok"))  # 3 copies of 1 MiB: within 1 MiB + 4 MiB
    torch.save({"w": w, **{f"v{i}": (w, i) for i in range(12)}}, path)
    with pytest.raises(CorruptCheckpointError, match="DCP_STORAGE_MAX_BROADCAST_BYTES") as caught:
        ds.conversion.torch_save_to_dcp(str(path), str(tmp_path / "bomb"))
    assert str(path) in str(caught.value) and "'v" in str(caught.value)
