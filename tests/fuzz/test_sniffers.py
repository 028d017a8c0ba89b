"""Fuzzing format detection: every registered sniffer, and ``detect_format`` on real files and directories.

Property: a sniffer returns ``None`` or an int for any probe and never raises anything but our errors;
``detect_format`` returns a format or raises a :class:`~dcp_storage.errors.DcpStorageError`
(``UnknownFormatError`` naming the URL) for any file or directory, whatever bytes it holds.
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcp_storage import registry
from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.spec import FormatSpec, Probe
from dcp_storage.opening import detect_format
from dcp_storage.transports import FsspecTransport

from .profiles import FUZZ

NAMES = [
    ".metadata",
    "__0_0.distcp",
    "__1_0.distcp",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "pytorch_model.bin",
    "notes.txt",
]
FILE_NAMES = ["model.safetensors", "model.safetensors.index.json", "model.pt", "x.bin", ".metadata", "blob"]

# Heads that look like each format's magic, then anything: the sniffers' interesting inputs.
magic_heads = st.one_of(
    st.binary(max_size=80),
    st.builds(
        lambda n, rest: struct.pack("<Q", n) + rest,
        st.integers(0, 2**64 - 1) | st.integers(0, 200),
        st.binary(max_size=72),
    ),
    st.builds(lambda rest: b"PK\x03\x04" + rest, st.binary(max_size=76)),
    st.builds(lambda rest: b"\x80\x02\x8a\x0a" + rest, st.binary(max_size=76)),
    st.builds(lambda rest: b"{" + rest, st.binary(max_size=79)),
)


def _formats() -> list[FormatSpec]:
    return [s for s in registry.load_all("formats").values() if isinstance(s, FormatSpec)]


@pytest.fixture(scope="module")
def scratch() -> Any:
    with tempfile.TemporaryDirectory(prefix="dcp-fuzz-sniff-") as root:
        yield Path(root)


@FUZZ()
@given(head=magic_heads, size=st.integers(0, 2**64), name=st.sampled_from(FILE_NAMES))
def test_file_sniffers_never_raise(scratch: Path, head: bytes, size: int, name: str) -> None:
    transport = FsspecTransport.from_url(str(scratch))[0]
    probe = Probe(str(scratch / name), transport, str(scratch / name), False, (), head, size)
    for spec in _formats():
        try:
            score = spec.sniff(probe)
        except DcpStorageError:
            continue
        assert score is None or isinstance(score, int), (spec.name, score)


def _fresh(scratch: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=scratch))


@FUZZ(weight=0.5)
@given(content=magic_heads | st.binary(max_size=400), name=st.sampled_from(FILE_NAMES))
def test_detect_format_on_any_file(scratch: Path, content: bytes, name: str) -> None:
    path = _fresh(scratch) / name
    path.write_bytes(content)
    try:
        spec = detect_format(str(path))
    except DcpStorageError as exc:
        assert name in str(exc)
        return
    assert isinstance(spec, FormatSpec)


@FUZZ(weight=0.5)
@given(files=st.dictionaries(st.sampled_from(NAMES), magic_heads, min_size=1, max_size=4))
def test_detect_format_on_any_directory(scratch: Path, files: dict[str, bytes]) -> None:
    root = _fresh(scratch)
    for name, content in files.items():
        (root / name).write_bytes(content)
    try:
        spec = detect_format(str(root))
    except DcpStorageError:
        return
    assert isinstance(spec, FormatSpec)
