"""Fuzzing the safetensors header parser: any bytes, any JSON, plausible headers with perturbed offsets.

Property: :func:`header_length`, :func:`parse_header` and :func:`saved_offsets` either return a header
whose invariants hold (every tensor inside the data section, sizes matching shapes and dtypes, no
overlaps) or raise :class:`~dcp_storage.errors.CorruptCheckpointError` naming the file. Anything else
(``ValueError``, ``OverflowError``, ``RecursionError``, ``KeyError``...) is a bug. The end-to-end test
feeds whole files to ``SafetensorsReader.read_metadata``.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcp_storage.errors import CorruptCheckpointError, DcpStorageError
from dcp_storage.formats.safetensors.header import (
    LENGTH_BYTES,
    METADATA_KEY,
    SAFETENSORS_TO_TORCH,
    SHARDING_INFO_KEY,
    _entries,
    _entry,
    header_length,
    parse_header,
    saved_offsets,
)

from .profiles import FUZZ

WHERE = "fuzz://bucket/model.safetensors"
DTYPES = sorted(SAFETENSORS_TO_TORCH)

json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
dims = st.one_of(
    st.integers(0, 8),
    st.integers(-3, -1),
    st.integers(2**31, 2**70),
    st.booleans(),
    st.floats(-4, 4),
    st.text(max_size=2),
)
dtype_names = st.sampled_from(DTYPES) | st.sampled_from(["F128", "", "f32", "F32 ", "Q4"]) | st.integers() | st.none()
offsets = st.lists(st.integers(-5, 2**65) | st.integers(0, 64), max_size=3) | json_scalars
entries = st.one_of(
    st.fixed_dictionaries(
        {"dtype": dtype_names, "shape": st.lists(dims, max_size=4) | json_scalars, "data_offsets": offsets}
    ),
    json_values,
)
metadata_values = st.dictionaries(st.text(max_size=6), st.text(max_size=12) | json_scalars, max_size=3) | json_scalars
sharding = st.dictionaries(
    st.sampled_from(["a", "b", "c"]),
    st.fixed_dictionaries({"saved_offsets": st.lists(st.integers(-2, 2**64) | st.integers(0, 4), max_size=3)})
    | json_values,
    max_size=3,
)


@st.composite
def plausible_headers(draw: Any) -> tuple[dict[str, Any], int]:
    """Mostly valid headers (consecutive offsets from real dtypes and shapes), then one perturbation."""
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), unique=True, max_size=4))
    doc: dict[str, Any] = {}
    pos = 0
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        nbytes = math.prod(shape) * SAFETENSORS_TO_TORCH[dtype].itemsize
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    if names and draw(st.booleans()):
        victim = doc[draw(st.sampled_from(names))]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        victim[field] = draw(
            {"dtype": dtype_names, "shape": st.lists(dims, max_size=4), "data_offsets": offsets}[field]
        )
    if draw(st.booleans()):
        info = draw(sharding)
        doc[METADATA_KEY] = {SHARDING_INFO_KEY: json.dumps(info) if draw(st.booleans()) else "{not json"}
    data_size = pos + draw(st.integers(-8, 8))
    return doc, data_size


def _check(raw: bytes, data_size: int) -> None:
    try:
        header = parse_header(raw, data_size, WHERE)
    except CorruptCheckpointError as exc:
        assert WHERE in str(exc)
        return
    spans = []
    for entry in header.tensors.values():
        assert 0 <= entry.begin <= entry.end <= data_size
        assert entry.nbytes == math.prod(entry.shape) * entry.dtype.itemsize
        if entry.nbytes:
            spans.append((entry.begin, entry.end))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    try:
        placed = saved_offsets(header, WHERE)
    except CorruptCheckpointError as exc:
        assert WHERE in str(exc)
        return
    for name, at in placed.items():
        assert len(at) == len(header.tensors[name].shape) and all(isinstance(o, int) and o >= 0 for o in at)


@FUZZ()
@given(raw=st.binary(max_size=300), data_size=st.integers(-2, 2**20))
def test_parse_header_any_bytes(raw: bytes, data_size: int) -> None:
    _check(raw, data_size)


@FUZZ()
@given(
    doc=st.dictionaries(st.text(max_size=5), entries, max_size=4), meta=metadata_values, data_size=st.integers(-1, 4096)
)
def test_parse_header_any_json(doc: dict[str, Any], meta: Any, data_size: int) -> None:
    if meta is not None:
        doc = {**doc, METADATA_KEY: meta}
    _check(json.dumps(doc).encode(), data_size)


def _outcome(build: Any) -> Any:
    try:
        return build()
    except CorruptCheckpointError as exc:
        return str(exc)


@FUZZ()
@given(
    doc=st.dictionaries(st.text(max_size=5), entries, max_size=4) | plausible_headers().map(lambda c: c[0]),
    data_size=st.integers(-1, 4096),
)
def test_inline_entry_pass_agrees_with_entry(doc: dict[str, Any], data_size: int) -> None:
    """The one-pass validation of a header's entries (what a million-tensor header takes) accepts what
    ``_entry`` accepts, as the same entries, and refuses what it refuses, with the same first error."""
    doc = {k: v for k, v in doc.items() if k != METADATA_KEY}
    expected = _outcome(lambda: {name: _entry(name, info, data_size, WHERE) for name, info in doc.items()})
    assert _outcome(lambda: _entries(dict(doc), data_size, WHERE)) == expected


@FUZZ()
@given(case=plausible_headers())
def test_parse_header_plausible(case: tuple[dict[str, Any], int]) -> None:
    doc, data_size = case
    _check(json.dumps(doc).encode(), data_size)


@FUZZ()
@given(prefix=st.binary(max_size=16), blob_size=st.integers(-1, 2**64))
def test_header_length(prefix: bytes, blob_size: int) -> None:
    try:
        n = header_length(prefix, blob_size, WHERE)
    except CorruptCheckpointError as exc:
        assert WHERE in str(exc)
        return
    assert 0 <= n <= blob_size - LENGTH_BYTES


@pytest.fixture(scope="module")
def scratch() -> Any:
    with tempfile.TemporaryDirectory(prefix="dcp-fuzz-st-") as root:
        yield Path(root)


@FUZZ(weight=0.5)
@given(case=plausible_headers(), length_delta=st.integers(-4, 4) | st.just(0), tail=st.binary(max_size=32))
def test_reader_metadata_from_any_file(
    scratch: Path, case: tuple[dict[str, Any], int], length_delta: int, tail: bytes
) -> None:
    """Whole files through ``SafetensorsReader.read_metadata``: metadata, or our error naming the file."""
    from dcp_storage import SafetensorsReader

    doc, data_size = case
    text = json.dumps(doc).encode()
    blob = struct.pack("<Q", max(0, len(text) + length_delta)) + text + bytes(max(0, data_size)) + tail
    path = scratch / "model.safetensors"
    path.write_bytes(blob)
    try:
        md = SafetensorsReader(str(path), broadcast_metadata=False).read_metadata()
    except DcpStorageError as exc:
        assert "model.safetensors" in str(exc)
        return
    assert set(md.state_dict_metadata) <= set(doc)
