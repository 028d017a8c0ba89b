"""Fuzzing the JSON documents read whole (manifest, HF index) and the view check of saved tensors.

Properties: ``Manifest.from_json`` and ``parse_index`` return a sound result (every file name a plain
relative path inside the checkpoint) or raise :class:`~dcp_storage.errors.CorruptCheckpointError` naming
the file, for any bytes, any JSON and JSON nested 100k deep; never ``RecursionError``, ``TypeError`` or
anything else. ``check_view`` accepts only views that lie inside their storage and expand it by at most
the broadcast limit, and refuses everything else with our error.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.paths import BROADCAST_BYTES, check_relative, check_view
from dcp_storage.formats.safetensors.metadata import parse_index
from dcp_storage.integrity.manifest import Manifest

from .profiles import FUZZ

URL = "/ckpt/.dcp_storage.json"
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
file_names = st.sampled_from(["__0_0.distcp", "../x", "/etc/passwd", "a/../../b", "s3://b/k", "", "sub/ok.distcp"])
manifest_docs = st.fixed_dictionaries(
    {
        "schema": st.sampled_from([1, 0, 99, "1", None]),
        "format": st.sampled_from(["dcp/1", 3]),
        "writer": st.just("dcp-storage/0"),
        "checksums": st.fixed_dictionaries(
            {
                "algorithm": st.sampled_from(["xxh3_64", 5]),
                "files": st.dictionaries(
                    file_names,
                    st.fixed_dictionaries({"size": json_values, "items": st.lists(json_values, max_size=3)}),
                    max_size=3,
                ),
            }
        ),
    }
)
deep = st.sampled_from([b"[" * 100_000, b'{"a":' * 100_000, b"[" * 100_000 + b"]" * 100_000])


def _assert_manifest_or_ours(data: bytes) -> None:
    try:
        manifest = Manifest.from_json(data, URL)
    except CorruptCheckpointError as exc:
        assert URL in str(exc)
        return
    for name, entry in manifest.files.items():
        assert check_relative(name, "test") == name and entry.size >= 0


@FUZZ()
@given(st.one_of(st.binary(max_size=200), deep, json_values.map(lambda v: json.dumps(v).encode())))
def test_manifest_from_any_bytes(data: bytes) -> None:
    _assert_manifest_or_ours(data)


@FUZZ()
@given(manifest_docs)
def test_manifest_from_plausible_documents(doc: dict[str, Any]) -> None:
    _assert_manifest_or_ours(json.dumps(doc).encode())


@FUZZ()
@given(st.one_of(st.binary(max_size=200), deep, json_values.map(lambda v: json.dumps({"weight_map": v}).encode())))
def test_index_from_any_bytes(data: bytes) -> None:
    try:
        weight_map = parse_index(data, "/ckpt/model.safetensors.index.json")
    except CorruptCheckpointError as exc:
        assert "model.safetensors.index.json" in str(exc)
        return
    assert all(check_relative(name, "test") == name for name in weight_map.values())


dims = st.integers(0, 2**20)


@FUZZ(2.0)
@given(
    st.lists(st.tuples(dims, st.integers(-2, 2**20)), max_size=4),
    st.integers(-2, 2**24),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(0, 2**28),
)
def test_check_view_accepts_only_views_inside_their_storage(
    dims_strides: list[tuple[int, int]], offset: int, itemsize: int, storage: int
) -> None:
    shape = [d for d, _ in dims_strides]
    stride = [s for _, s in dims_strides]
    try:
        check_view(shape, stride, offset, itemsize, storage, "/ckpt/x.distcp")
    except CorruptCheckpointError as exc:
        assert "/ckpt/x.distcp" in str(exc)
        return
    nbytes = math.prod(shape) * itemsize
    assert nbytes <= storage + BROADCAST_BYTES.bytes
    if nbytes:
        last = offset + sum((d - 1) * s for d, s in zip(shape, stride))
        assert 0 <= offset and (last + 1) * itemsize <= storage
