"""The strict ``data.pkl`` decoder and the record cache agree with the allow-list unpickler, byte for byte.

:func:`decode_tensor_pickle` is a fast path: for the pickles ``torch.save`` writes for a plain tensor it
must give exactly what :class:`~dcp_storage.safe_unpickle.AllowListUnpickler` gives, and for anything
else it must decline (``None``) without running, allocating or caching anything, so that the full
unpickler decides. :func:`parse_tensor_record` caches records by the bytes before their data; a cache hit
must still check the record against the caller's length.
"""

from __future__ import annotations

import gc
import io
import pickle
import zipfile

import pytest
import torch

from dcp_storage.errors import CorruptCheckpointError, UnsafeCheckpointError
from dcp_storage.formats.dcp_native import records as record_pickle
from dcp_storage.formats.dcp_native import torch_record
from dcp_storage.formats.dcp_native.records import decode_tensor_pickle
from dcp_storage.formats.dcp_native.torch_record import UnsupportedRecord, parse_tensor_record
from dcp_storage.safe_unpickle import safe_loads


def _record(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def _data_pkl(record: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(record)) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))


def _full(data: bytes) -> object:
    return torch_record._DataPklUnpickler(
        io.BytesIO(data), "test", torch_record._ALLOWED, torch_record._persistent_load
    ).load()


def _strict(data: bytes) -> object:
    return decode_tensor_pickle(data, torch_record._ALLOWED, torch_record._persistent_load)


TENSORS = {
    "fp32 2d": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "bf16 3d": torch.ones(2, 3, 5, dtype=torch.bfloat16),
    "scalar": torch.tensor(7, dtype=torch.int64),
    "empty": torch.empty(0, 4),
    "transposed": torch.arange(6.0).reshape(2, 3).t(),
    "offset view": torch.arange(20, dtype=torch.int32)[5:15],
    "requires grad": torch.ones(3, requires_grad=True),
    "bool, 4-byte dim": torch.zeros(70_000, dtype=torch.bool),
    "float8": torch.zeros(4, 2, dtype=torch.float8_e4m3fn),
    "complex": torch.ones(3, dtype=torch.complex64),
}


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_same_result_as_the_allow_list_unpickler(name: str) -> None:
    data = _data_pkl(_record(TENSORS[name]))
    assert _strict(data) == _full(data)


def test_protocol_4_pickle_of_the_same_objects() -> None:
    """MEMOIZE and FRAME (protocol 4+) decode too: what another writer might emit for the same call."""
    spec = _full(_data_pkl(_record(TENSORS["fp32 2d"])))
    stream = pickle.dumps(
        (spec.storage.key, spec.size, spec.stride, spec.storage_offset, True, None, (), {}), protocol=4
    )
    assert _strict(stream) == pickle.loads(stream)


def _with(data: bytes, old: bytes, new: bytes) -> bytes:
    assert data.count(old) == 1
    return data.replace(old, new)


BASE = _data_pkl(_record(TENSORS["fp32 2d"]))


@pytest.mark.parametrize(
    "bad",
    [
        _with(BASE, b"collections\nOrderedDict\n", b"os\nsystem\n"),  # global outside the allow-list
        BASE[:-1],  # no STOP
        BASE[:40],  # cut inside the stream
        BASE + b"N.",  # trailing opcodes after STOP
        b"\x80\x02cbuiltins\neval\nq\x00X\x01\x00\x00\x001\x85R.",  # a forbidden call
        b"\x80\x02]q\x00(K\x01K\x02e.",  # a list: APPENDS is not part of a tensor pickle
        b"\x80\x02ccollections\nOrderedDict\n)Rq\x00}b.",  # BUILD
        b"\x80\x02K\x01K\x02.",  # two objects left at STOP
        b"",
    ],
)
def test_declines_what_it_does_not_know(bad: bytes) -> None:
    before = len(record_pickle._cache)
    assert _strict(bad) is None
    assert len(record_pickle._cache) == before  # nothing cached for a declined stream


def test_memo_indices() -> None:
    """``LONG_BINPUT``/``LONG_BINGET`` work; an index past the stream's length is declined, as the full
    path refuses it (there it would make the C unpickler allocate gigabytes)."""
    assert _strict(b"\x80\x02K\x05r\x03\x00\x00\x00j\x03\x00\x00\x00\x86.") == (5, 5)
    huge = b"\x80\x02K\x05r\xfe\xff\xff\xff."
    assert _strict(huge) is None
    with pytest.raises(CorruptCheckpointError, match="memo index"):
        _full(huge)


def test_exceptions_from_allow_listed_callables_defer_to_the_full_unpickler() -> None:
    grad = _with(BASE, b"\x89", b"\x88")  # requires_grad=True: still a plain tensor
    assert _strict(grad) == _full(grad)
    untyped = _with(BASE, b"torch\nFloatStorage\n", b"torch\nUntypedStorage\n")
    assert _strict(untyped) is None
    with pytest.raises(UnsupportedRecord):
        _full(untyped)


def test_cache_is_per_allow_list() -> None:
    data = _data_pkl(_record(TENSORS["bf16 3d"]))
    first = _strict(data)
    assert _strict(data) is first  # the second decode is a cache hit
    assert decode_tensor_pickle(data, {}, torch_record._persistent_load) is None  # another allow-list decides anew


def test_record_cache_hit_still_checks_the_record_length() -> None:
    tensor = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    data = _record(tensor)
    rec = parse_tensor_record(data, len(data), "a.distcp")
    other = _record(tensor + 1)  # same shape and dtype: same bytes before the data
    assert parse_tensor_record(other, len(other), "b.distcp") is rec
    with pytest.raises(CorruptCheckpointError, match=r"c\.distcp.*truncated"):
        parse_tensor_record(other, rec.data_start + rec.storage_nbytes - 1, "c.distcp")


def test_record_cache_distinguishes_shapes_and_dtypes() -> None:
    records = [_record(torch.zeros(s, dtype=d)) for s in ((4, 8), (8, 4), (32,)) for d in (torch.float32, torch.int32)]
    parsed = [parse_tensor_record(r, len(r), "x.distcp") for r in records]
    assert len({(p.shape, p.stride, p.dtype) for p in parsed}) == len(records)
    for r, p in zip(records, parsed):
        assert bytes(r[p.data_start : p.data_start + p.storage_nbytes]) == bytes(p.storage_nbytes)


def test_unpickling_pauses_and_restores_garbage_collection() -> None:
    bad = b"\x80\x02cos\nsystem\nq\x00."
    assert gc.isenabled()
    safe_loads(pickle.dumps({"a": [1, 2]}), "m", {})
    assert gc.isenabled()
    with pytest.raises(UnsafeCheckpointError):
        safe_loads(bad, "m", {})
    assert gc.isenabled()  # re-enabled on the error path too
    gc.disable()
    try:
        safe_loads(pickle.dumps([1]), "m", {})
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()
