"""Fuzzing the allow-list unpicklers: DCP ``.metadata``, ``torch.save``'s ``data.pkl``, DCP tensor records.

Inputs: arbitrary bytes; valid pickles (every protocol) with bytes flipped, inserted or cut; pickles of
``Metadata`` objects whose fields hold hostile values (negative or huge shapes, strings for dtypes, paths
out of the checkpoint, 2**63 offsets). Property: the decoder returns a sound object (``load_metadata``'s
checks find no problem in it) or raises a :class:`~dcp_storage.errors.DcpStorageError` naming the file;
it never raises ``UnpicklingError``, ``TypeError``, ``OverflowError``... and never runs code (anything
outside the allow-list is refused before it is resolved, so no marker can appear: checked too).
"""

from __future__ import annotations

import io
import pickle
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage.errors import CorruptCheckpointError, DcpStorageError
from dcp_storage.formats.columns import columns_of, metadata_from_columns
from dcp_storage.formats.dcp_native.metadata_checks import metadata_problems
from dcp_storage.formats.dcp_native.native import load_metadata
from dcp_storage.formats.dcp_native.torch_record import NeedMoreBytes, UnsupportedRecord, parse_tensor_record
from dcp_storage.formats.torch_save.pickle_tree import decode_data_pkl

from .profiles import FUZZ

WHERE = "fuzz://bucket/ckpt/.metadata"


def _valid_metadata() -> Metadata:
    sizes = torch.Size([4, 3])
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])),
    ]
    return Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), sizes, chunks),
            "step": BytesStorageMetadata(),
        },
        storage_data={
            MetadataIndex("w", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 1200),
            MetadataIndex("w", torch.Size([2, 0])): _StorageInfo("__1_0.distcp", 0, 1200),
            MetadataIndex("step"): _StorageInfo("__0_0.distcp", 1200, 800),
        },
    )


VALID_PICKLES = [pickle.dumps(_valid_metadata(), protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)]


@st.composite
def mutated(draw: Any, sources: list[bytes]) -> bytes:
    """One of ``sources`` with a few bytes replaced, inserted or deleted, or cut short."""
    data = bytearray(draw(st.sampled_from(sources)))
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        op = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if op == "flip" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "cut":
            del data[pos:]
    return bytes(data)


def _check_metadata_bytes(data: bytes) -> None:
    try:
        md = load_metadata(data, WHERE)
    except DcpStorageError as exc:
        assert WHERE in str(exc)
        return
    assert isinstance(md, Metadata)
    cols = columns_of(md)
    if cols is not None:  # views of its columns (DCP_STORAGE_LAZY_METADATA_ENTRIES): checked as their dicts
        md = metadata_from_columns(cols)
    assert metadata_problems(md, WHERE) == []


@FUZZ()
@given(data=st.binary(max_size=600))
def test_metadata_any_bytes(data: bytes) -> None:
    _check_metadata_bytes(data)


@FUZZ(weight=2)
@given(data=mutated(VALID_PICKLES))
def test_metadata_mutated_pickles(data: bytes) -> None:
    _check_metadata_bytes(data)


ints = st.integers(-3, 6) | st.integers(2**31, 2**66) | st.booleans()
shapes = st.lists(ints, max_size=3) | st.none() | st.text(max_size=3)


@st.composite
def hostile_metadata(draw: Any) -> Metadata:
    """A ``Metadata`` of allow-listed classes whose fields hold whatever hypothesis picks."""
    md = _valid_metadata()
    item = md.state_dict_metadata["w"]
    field = draw(
        st.sampled_from(["dtype", "size", "chunk", "path", "offset", "length", "storage", "transforms", "drop"])
    )
    index = MetadataIndex("w", torch.Size([0, 0]))
    info = md.storage_data[index]
    if field == "dtype":
        item.properties.dtype = draw(st.sampled_from([torch.float8_e5m2, torch.int8]) | st.text(max_size=4) | st.none())
    elif field == "size":
        size = draw(shapes)
        item.size = torch.Size(size) if isinstance(size, list) and all(isinstance(v, int) for v in size) else size
    elif field == "chunk":
        item.chunks[0] = ChunkStorageMetadata(draw(shapes), draw(shapes))  # type: ignore[arg-type]
    elif field == "path":
        rel = draw(
            st.sampled_from(["../x", "/abs", "s3://b/x", "a//b", "~/x", "C:\\x", "", "ok.distcp"])
            | st.text(max_size=6)
            | ints
        )
        md.storage_data[index] = _StorageInfo(rel, info.offset, info.length)  # type: ignore[arg-type]
    elif field in ("offset", "length"):
        value = draw(ints | st.floats(allow_nan=False) | st.text(max_size=3))
        kwargs = {"offset": info.offset, "length": info.length, field: value}
        md.storage_data[index] = _StorageInfo(info.relative_path, **kwargs)  # type: ignore[arg-type]
    elif field == "storage":
        md.storage_data = draw(st.none() | st.lists(st.integers(), max_size=2) | st.just({"x": 1}))
    elif field == "transforms":
        md.storage_data[index] = _StorageInfo(
            info.relative_path, info.offset, info.length, draw(st.lists(st.text(max_size=3) | ints, max_size=2))
        )
    else:
        del md.storage_data[draw(st.sampled_from(list(md.storage_data)))]
    return md


@FUZZ()
@given(md=hostile_metadata(), protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
def test_metadata_hostile_values(md: Metadata, protocol: int) -> None:
    _check_metadata_bytes(pickle.dumps(md, protocol=protocol))


def _torch_save(obj: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


def _data_pkl(archive: bytes) -> bytes:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))


DATA_PKLS = [
    _data_pkl(_torch_save({"w": torch.ones(3, 2), "b": torch.arange(4)[1:], "step": 3, "name": "x", "t": (1, 2.5)})),
    _data_pkl(_torch_save({"a": torch.zeros(2, dtype=torch.float8_e4m3fn), "o": [torch.ones(1), {"k": b"\x00"}]})),
]


@FUZZ()
@given(data=mutated(DATA_PKLS) | st.binary(max_size=300))
def test_data_pkl(data: bytes) -> None:
    try:
        _tree, storages = decode_data_pkl(data, "fuzz://b/model.pt (data.pkl)")
    except DcpStorageError as exc:
        assert "model.pt" in str(exc)
        return
    assert all(isinstance(n, int) and n >= 0 for n in storages.values())


RECORDS = [_torch_save(torch.arange(12, dtype=torch.float32).reshape(3, 4)), _torch_save(torch.ones(5, 2).t())]


@FUZZ()
@given(data=mutated(RECORDS))
def test_tensor_record(data: bytes) -> None:
    where = "fuzz://b/ckpt/__0_0.distcp [0, n)"
    try:
        rec = parse_tensor_record(data, len(data), where)
    except (NeedMoreBytes, UnsupportedRecord):
        return  # internal signals: the caller reads more, or decodes with torch.load(weights_only=True)
    except CorruptCheckpointError as exc:
        assert "__0_0.distcp" in str(exc)
        return
    assert rec.data_start + rec.storage_nbytes <= len(data) and rec.storage_offset >= 0


TENSOR_PKLS = [_data_pkl(r) for r in RECORDS] + [
    _data_pkl(_torch_save(torch.zeros(70_000, dtype=torch.bool))),
    _data_pkl(_torch_save(torch.tensor(3.5, dtype=torch.bfloat16))),
]


@FUZZ()
@given(data=mutated(TENSOR_PKLS))
def test_strict_tensor_pickle_agrees_with_the_allow_list_unpickler(data: bytes) -> None:
    """The strict ``data.pkl`` decoder either declines or returns exactly what the full unpickler returns."""
    import io as _io

    from dcp_storage.formats.dcp_native import torch_record
    from dcp_storage.formats.dcp_native.records import decode_tensor_pickle

    strict = decode_tensor_pickle(data, torch_record._ALLOWED, torch_record._persistent_load)
    if strict is None:
        return
    full = torch_record._DataPklUnpickler(
        _io.BytesIO(data), "fuzz", torch_record._ALLOWED, torch_record._persistent_load
    ).load()
    assert strict == full


@pytest.fixture(scope="module")
def scratch() -> Any:
    with tempfile.TemporaryDirectory(prefix="dcp-fuzz-pt-") as root:
        yield Path(root)


ARCHIVES = [_torch_save({"w": torch.ones(3, 2), "b": torch.arange(4), "step": 3})]


@FUZZ(weight=0.5)
@given(data=mutated(ARCHIVES), tail=st.booleans())
def test_torch_save_archive(scratch: Path, data: bytes, tail: bool) -> None:
    """Whole ``torch.save`` files (mutated near the end, where the zip index lives, half the time)."""
    from dcp_storage.formats.torch_save import TorchSaveArchive
    from dcp_storage.transports import FsspecTransport

    if tail:  # splice the mutation into the last 200 bytes of an intact file
        base = ARCHIVES[0]
        data = base[:-200] + data[-200:] if len(data) >= 200 else base[:-200] + data
    path = scratch / "model.pt"
    path.write_bytes(data)
    transport, p = FsspecTransport.from_url(str(path))
    try:
        archive = TorchSaveArchive.open(transport, p)
        archive.metadata()
        archive._data_starts()
    except DcpStorageError as exc:
        assert "model.pt" in str(exc)


def _attack_pickles() -> list[bytes]:
    from tests.hostile import payloads as P

    valid = pickle.dumps(_valid_metadata(), protocol=2)
    out = [P.splice(prefix, valid) for prefix in P.STATE_ATTACKS.values()]
    out += [P.splice(P.as_prefix(whole), valid) for whole in P.FRESH_ATTACKS.values()]
    return out + [P.size_bomb(op) for op in P.BOMBS]


ATTACK_PICKLES = _attack_pickles()


@FUZZ(weight=2)
@given(data=mutated(ATTACK_PICKLES + VALID_PICKLES))
def test_mutated_attacks_change_nothing(data: bytes) -> None:
    """Hostile ``.metadata`` pickles (BUILD on allow-listed globals and enum members, dunder and slot state,
    size bombs), mutated: whatever the decoder does, no allow-listed global or enum member changes."""
    from tests.hostile.process_state import changed, snapshot

    before = snapshot()
    _check_metadata_bytes(data)
    assert not changed(before, snapshot())
