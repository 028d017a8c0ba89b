"""Fuzzing the zip layer with structured edits: central-directory and local-header fields set to hostile
values (0, 0xFFFFFFFF, offsets into other entries, zip64 extra fields of any length), entries duplicated or
moved, whole archives and DCP records alike. Property: the archive opens and reads back soundly, or a
:class:`~dcp_storage.errors.DcpStorageError` naming the file; never ``IndexError``, ``struct.error``,
``KeyError``, ``ValueError`` from outside the hierarchy, ``zlib.error`` or ``UnicodeDecodeError``.
"""

from __future__ import annotations

import io
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tests.hostile.zip_mutations as zm
from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.dcp_native.torch_record import (
    NeedMoreBytes,
    UnsupportedRecord,
    check_record_zip,
    parse_tensor_record,
)

from .profiles import FUZZ


def _torch_save(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


BASE = _torch_save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16), "step": 3})
N_ENTRIES = len(zm.central_records(BASE))
HOSTILE_INTS = st.sampled_from([0, 1, 7, 30, 0xFFFF, 0xFFFFFFFF, 0x7FFFFFFF, len(BASE), len(BASE) - 22])
CENTRAL_FIELDS = ("flags", "method", "crc", "csize", "usize", "offset")


@st.composite
def central_edit(draw: st.DrawFn) -> tuple[int, dict[str, object]]:
    which = draw(st.integers(0, N_ENTRIES - 1))
    changes: dict[str, object] = {}
    if draw(st.booleans()):  # a zip64 edit: 32-bit fields saying "see the extra field", and some extra field
        for field in draw(st.sets(st.sampled_from(["usize", "csize", "offset"]), min_size=1)):
            changes[field] = 0xFFFFFFFF
        values = draw(st.lists(st.sampled_from([0, 16, len(BASE), 2**63, 2**64 - 1]), max_size=3))
        body = b"".join(struct.pack("<Q", v) for v in values) + draw(st.binary(max_size=7))
        changes["extra"] = struct.pack("<HH", 1, draw(st.sampled_from([len(body), 8 * len(values), 24, 0xFFFF]))) + body
        return which, changes
    for field in draw(st.sets(st.sampled_from(CENTRAL_FIELDS + ("extra", "name")), min_size=1, max_size=3)):
        if field == "extra":
            length = draw(st.integers(0, 40))
            body = draw(st.binary(min_size=0, max_size=24))
            changes[field] = struct.pack("<HH", draw(st.sampled_from([1, 1, 0x5455])), length) + body
        elif field == "name":
            changes[field] = draw(
                st.sampled_from([b"", b"archive/data.pkl", b"archive/data/0", b"\xff\xfe", b"x" * 300])
            )
        else:
            changes[field] = draw(st.one_of(HOSTILE_INTS, st.integers(0, 0xFFFFFFFF)))
    return which, changes


@st.composite
def local_edit(draw: st.DrawFn) -> tuple[str, dict[str, int]]:
    name = draw(st.sampled_from(["data.pkl", "byteorder", "data/0", "data/1", "version"]))
    fields = draw(st.sets(st.sampled_from(["flags", "method", "crc", "csize", "usize"]), min_size=1, max_size=2))
    return name, {f: draw(HOSTILE_INTS) for f in fields}


@st.composite
def hostile_zip(draw: st.DrawFn) -> bytes:
    data = BASE
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["central", "local", "duplicate", "overlap"]))
        try:
            if kind == "central":
                which, changes = draw(central_edit())
                data = zm.rewrite_central(
                    data, lambda rs, w=which, c=changes: [replace(r, **c) if i == w else r for i, r in enumerate(rs)]
                )  # type: ignore[arg-type]  # noqa: E501
            elif kind == "local":
                name, fields = draw(local_edit())
                data = zm.patch_local(data, name, **fields)
            elif kind == "duplicate":
                data = zm.duplicate_entry(
                    data, draw(st.sampled_from(["data/0", "byteorder"])), draw(st.binary(max_size=64))
                )
            else:
                data = zm.overlapping_entry(data, "byteorder", "data/0", at=draw(st.integers(0, 8)))
        except (StopIteration, ValueError, struct.error, IndexError):
            continue  # the helper could not apply this edit to an already-edited archive: keep what we have
    return data


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dcp-fuzz-zip-") as root:
        yield Path(root)


@FUZZ(weight=0.5)
@given(data=hostile_zip())
def test_torch_save_archive_layouts(scratch: Path, data: bytes) -> None:
    from dcp_storage.formats.torch_save import TorchSaveArchive
    from dcp_storage.transports import FsspecTransport

    path = scratch / "model.pt"
    path.write_bytes(data)
    transport, p = FsspecTransport.from_url(str(path))
    try:
        archive = TorchSaveArchive.open(transport, p)
        archive.metadata()
        for fqn in archive.tensors:
            archive.read_tensor(archive.tensors[fqn])
    except DcpStorageError as exc:
        assert "model.pt" in str(exc), exc


@FUZZ(weight=0.5)
@given(data=hostile_zip())
def test_dcp_record_layouts(data: bytes) -> None:
    """The same archives as DCP records held in memory: the full check, then the walker."""
    where = "fuzz://b/ckpt/__0_0.distcp [0, n)"
    try:
        check_record_zip(data, where)
    except DcpStorageError as exc:
        assert "__0_0.distcp" in str(exc), exc
    try:
        parse_tensor_record(data, len(data), where)
    except (NeedMoreBytes, UnsupportedRecord):
        pass
    except DcpStorageError as exc:
        assert "__0_0.distcp" in str(exc), exc
