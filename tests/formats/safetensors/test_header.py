"""Safetensors header parsing: every validation, explicitly, then fuzzed with hypothesis.

Whatever the bytes, parsing either succeeds with a header whose tensors fit the data section, or raises
one of our :class:`DcpStorageError` subclasses naming the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_storage import SafetensorsReader
from dcp_storage.errors import CorruptCheckpointError, DcpStorageError
from dcp_storage.formats.safetensors.header import (
    MAX_HEADER_BYTES,
    header_length,
    parse_header,
    saved_offsets,
)
from dcp_storage.formats.safetensors.metadata import check_relative, looks_like_safetensors, parse_index
from dcp_storage.inspection.checks import verify
from dcp_storage_testing.compare import raw_bytes

from ._build import blob, entry, every_dtype_tensors

WHERE = "s3://bucket/ckpt/model.safetensors"


def parse_blob(data: bytes, where: str = WHERE):
    """What the reader does with a whole file: length, then the header against the data section."""
    n = header_length(data[:8], len(data), where)
    return parse_header(data[8 : 8 + n], len(data) - 8 - n, where)


# ------------------------------------------------------------------------------------------ valid input
def test_parses_what_safetensors_writes_for_every_dtype() -> None:
    tensors = every_dtype_tensors()
    data = safetensors.torch.save(tensors, metadata={"format": "pt"})
    header = parse_blob(data)
    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == set(tensors)
    for name, t in tensors.items():
        e = header.tensors[name]
        assert e.dtype == t.dtype and e.shape == tuple(t.shape), name
        assert e.nbytes == t.numel() * t.element_size(), name
        start = 8 + header.header_len + e.begin
        assert data[start : start + e.nbytes] == raw_bytes(t).numpy().tobytes(), name


def test_saved_offsets_default_to_origin_and_follow_dcp_sharding_info() -> None:
    info = json.dumps({"w": {"saved_offsets": [4, 0]}})
    data = blob(
        {"__metadata__": {"DCP_SHARDING_INFO": info}, "w": entry("F32", [2, 3], 0, 24), "b": entry("F32", [3], 24, 36)},
        bytes(36),
    )
    assert saved_offsets(parse_blob(data), WHERE) == {"w": (4, 0), "b": (0,)}


def test_looks_like_safetensors() -> None:
    good = safetensors.torch.save({"x": torch.zeros(2)})
    assert looks_like_safetensors(good[:16], len(good))
    assert not looks_like_safetensors(b"PK\x03\x04" + bytes(12), 1000)  # a zip (torch.save)
    assert not looks_like_safetensors(struct.pack("<Q", 10) + b"[", 100)  # JSON but not an object
    assert not looks_like_safetensors(struct.pack("<Q", 500) + b"{", 100)  # longer than the file
    assert not looks_like_safetensors(b"\x00" * 4, 4)


# ---------------------------------------------------------------------------------- each validation
def _bad(data: bytes, *words: str) -> None:
    with pytest.raises(CorruptCheckpointError) as info:
        parse_blob(data)
    message = str(info.value)
    assert WHERE in message, message
    for word in words:
        assert word in message, message


REJECTS: list[tuple[bytes, list[str]]] = [
    (b"\x01\x02\x03", ["too short"]),
    (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", ["absurd"]),
    (struct.pack("<Q", 2**64 - 1) + b"{}", ["absurd"]),
    (struct.pack("<Q", 1000) + b"{}", ["runs past the end"]),
    (blob(b"{not json"), ["not valid JSON"]),
    (blob(b"\xff\xfe{}"), ["not valid JSON"]),
    (blob(b"[" * 100_000 + b"]" * 100_000), ["not valid JSON"]),
    (blob(b'{"a": 1, "a": 2}'), ["'a' twice"]),
    (blob([1, 2]), ["expected an object"]),
    (blob({"w": [1]}), ["'w'", "expected an object"]),
    (blob({"w": entry("F99", [1], 0, 4)}, bytes(4)), ["'w'", "unknown dtype 'F99'"]),
    (blob({"w": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), ["'w'", "'dtype'"]),
    (blob({"w": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}}, bytes(16)), ["'w'", "'shape'"]),
    (blob({"w": entry("F32", [-1, 4], 0, 16)}, bytes(16)), ["'w'", "'shape'"]),
    (blob({"w": entry("F32", [1.5], 0, 4)}, bytes(4)), ["'w'", "'shape'"]),
    (blob({"w": entry("F32", [True], 0, 4)}, bytes(4)), ["'w'", "'shape'"]),
    (blob({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4)), ["'w'", "data_offsets"]),
    (blob({"w": entry("F32", [1], -4, 0)}, bytes(4)), ["'w'", "data_offsets"]),
    (blob({"w": entry("F32", [1], 4, 0)}, bytes(4)), ["'w'", "end before they begin"]),
    (blob({"w": entry("F32", [2, 3], 0, 20)}, bytes(20)), ["'w'", "needs 24 bytes", "hold 20"]),
    # 2**62 * 2**62 elements would wrap a 64-bit byte count to 0: Python ints do not.
    (blob({"w": entry("F32", [2**62, 2**62], 0, 0)}), ["'w'", "needs"]),
    (blob({"w": entry("F32", [4], 0, 16)}, bytes(8)), ["'w'", "run past the end", "truncated"]),
    (
        blob({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12)),
        ["'a'", "'b'", "overlap"],
    ),
    # The safetensors library refuses data bytes that belong to no tensor; so do we (gaps hide bytes no check reads).
    (
        blob({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 12, 20)}, bytes(20)),
        ["'a'", "'b'", "[8, 12)", "belong to no tensor"],
    ),
    (blob({"a": entry("F32", [1], 4, 8)}, bytes(8)), ["'a'", "[0, 4)", "belong to no tensor"]),
    (blob({"a": entry("F32", [1], 0, 4)}, bytes(8)), ["'a'", "[4, 8)", "belong to no tensor"]),
    (blob({"__metadata__": {"format": "pt"}}, bytes(4)), ["[0, 4)", "belong to no tensor"]),
    (blob({"__metadata__": {"k": 1}}), ["__metadata__"]),
    (blob({"__metadata__": [1]}), ["__metadata__"]),
]


@pytest.mark.parametrize("data, words", REJECTS, ids=[f"{i}-{w[-1]}" for i, (_, w) in enumerate(REJECTS)])
def test_rejects(data: bytes, words: list[str]) -> None:
    _bad(data, *words)


def test_zero_size_tensors_may_share_offsets() -> None:
    header = parse_blob(blob({"a": entry("F32", [0, 3], 4, 4), "b": entry("F32", [1], 0, 4)}, bytes(4)))
    assert header.tensors["a"].shape == (0, 3)


@pytest.mark.parametrize(
    "info, words",
    [
        ("{oops", ["DCP_SHARDING_INFO", "not valid JSON"]),
        ("[1]", ["DCP_SHARDING_INFO", "JSON object"]),
        (json.dumps({"w": {"saved_offsets": [1]}}), ["'w'", "saved_offsets"]),
        (json.dumps({"w": {"saved_offsets": [0, -1]}}), ["'w'", "saved_offsets"]),
        (json.dumps({"w": 3}), ["'w'", "saved_offsets"]),
    ],
)
def test_rejects_bad_sharding_info(info: str, words: list[str]) -> None:
    header = parse_blob(blob({"__metadata__": {"DCP_SHARDING_INFO": info}, "w": entry("F32", [1, 1], 0, 4)}, bytes(4)))
    with pytest.raises(CorruptCheckpointError) as exc:
        saved_offsets(header, WHERE)
    for word in [WHERE, *words]:
        assert word in str(exc.value)


@pytest.mark.parametrize(
    "name", ["../x.safetensors", "a/../../x", "/etc/passwd", "s3://other/x", "C:\\x", "", 5, "a//b"]
)
def test_index_entries_that_escape_are_refused(name: object) -> None:
    index = json.dumps({"weight_map": {"w": name}}).encode()
    with pytest.raises(CorruptCheckpointError) as exc:
        parse_index(index, "memory://ckpt/model.safetensors.index.json")
    assert "model.safetensors.index.json" in str(exc.value) and "'w'" in str(exc.value)


def test_index_entries_in_subdirectories_are_fine() -> None:
    assert check_relative("shards/a.safetensors", "x") == "shards/a.safetensors"


# ------------------------------------------------------------------------------------------ fuzzing
_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["F32", "BF16", "U8", "F8_E8M0", "C64", "Q4", "", "__metadata__", "DCP_SHARDING_INFO"]),
    st.text(max_size=8),
)
_json = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
_shape = st.lists(
    st.one_of(st.integers(min_value=-2, max_value=6), st.integers(min_value=2**31, max_value=2**66), _json_leaf),
    max_size=4,
)
_offsets = st.lists(st.one_of(st.integers(min_value=-4, max_value=300), _json_leaf), max_size=3)
_tensor_entry = (
    st.fixed_dictionaries(
        {
            "dtype": st.one_of(st.sampled_from(["F32", "F16", "U8", "BOOL", "I64", "F8_E4M3", "XX"]), _json_leaf),
            "shape": _shape,
            "data_offsets": _offsets,
        }
    )
    | _json
)
_header_obj = (
    st.dictionaries(
        st.one_of(st.text(max_size=6), st.just("__metadata__")),
        _tensor_entry,
        max_size=5,
    )
    | _json
)


def _check(data: bytes) -> None:
    try:
        header = parse_blob(data)
    except DcpStorageError as exc:
        assert WHERE in str(exc)
        return
    data_size = len(data) - 8 - header.header_len
    for e in header.tensors.values():
        assert 0 <= e.begin <= e.end <= data_size
    try:
        saved_offsets(header, WHERE)
    except DcpStorageError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    header=_header_obj,
    data_size=st.integers(min_value=0, max_value=400),
    fudge=st.integers(min_value=-12, max_value=12),
)
def test_fuzzed_headers_raise_only_our_errors(header: object, data_size: int, fudge: int) -> None:
    raw = json.dumps(header, allow_nan=True).encode()
    _check(blob(raw, bytes(data_size), length=max(0, len(raw) + fudge) if fudge % 3 == 0 else None))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200))
def test_garbage_bytes_raise_only_our_errors(data: bytes) -> None:
    _check(data)


@settings(max_examples=200, deadline=None)
@given(position=st.integers(min_value=0, max_value=10_000), value=st.integers(min_value=0, max_value=255))
def test_flipped_bytes_in_a_real_file_raise_only_our_errors(position: int, value: int) -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    data = bytearray(
        safetensors.torch.save(tensors, metadata={"DCP_SHARDING_INFO": json.dumps({"a": {"saved_offsets": [0, 0]}})})
    )
    data[position % len(data)] = value
    _check(bytes(data))
    _check(bytes(data[: position % len(data)]))  # truncated anywhere


# ------------------------------------------------------------------------------------------ many dimensions
@pytest.mark.parametrize("tail", [[], [0]])
def test_a_shape_of_many_huge_dimensions_is_refused_at_once(tail: list[int]) -> None:
    """80,000 dimensions of 2**62: the product is quadratic to compute (13 s here for a 1.6 MB header, hours
    for 100 MB) and its decimal form is beyond Python's 4,300-digit limit (a ValueError in the message)."""
    import time

    shape = [2**62] * 80_000 + tail
    header = {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4]}}
    start = time.monotonic()
    with pytest.raises(CorruptCheckpointError) as info:
        parse_header(json.dumps(header).encode(), 4, WHERE)
    assert time.monotonic() - start < 1.0
    assert WHERE in str(info.value) and "'a'" in str(info.value) and "dimensions" in str(info.value)
    assert len(str(info.value)) < 1000


@pytest.mark.parametrize("data", [bytes(8) + b"hidden", b"hidden" + bytes(8)], ids=["trailing", "leading"])
def test_a_file_with_bytes_outside_every_tensor_is_refused_by_the_reader_and_verify(
    tmp_path: Path, data: bytes
) -> None:
    begin = 6 if data.startswith(b"hidden") else 0
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob({"w": entry("F32", [2], begin, begin + 8)}, data))
    with pytest.raises(CorruptCheckpointError) as info:
        SafetensorsReader(str(path)).read_metadata()
    assert "model.safetensors" in str(info.value) and "belong to no tensor" in str(info.value)
    report = verify(str(path), deep=True)
    assert not report.ok and any("belong to no tensor" in p for p in report.problems), report.problems
