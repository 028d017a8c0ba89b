"""Bytes of a safetensors file: the header, the order of tensors, and tensors as raw little-endian bytes.

The layout this module produces is the one ``safetensors.serialize`` produces, so a file written here from
full tensors is byte-identical to ``safetensors.torch.save(tensors, metadata)``:

* 8 bytes: the header length ``N``, unsigned little-endian;
* ``N`` bytes: compact JSON (no spaces, UTF-8, ``__metadata__`` first, then one entry per tensor in data
  order with keys ``dtype``, ``shape``, ``data_offsets``), padded with spaces to a multiple of 8 so that
  the data section starts aligned;
* the data section: every tensor's row-major bytes, back to back, without gaps. ``data_offsets`` are
  relative to its start.

Tensors are ordered by *descending* dtype rank (safetensors' ``Dtype`` enum, which lists dtypes in
increasing alignment), then by name, so every tensor starts aligned to its element size.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from dcp_storage.errors import UnsupportedKeyError

__all__ = [
    "HeaderEntry",
    "as_memoryview",
    "data_order",
    "dtype_rank",
    "encode_header",
    "pwrite_all",
    "safetensors_order_key",
    "tensor_bytes",
]

# safetensors' Dtype enum order (increasing alignment); a file lists tensors by descending rank. Names the
# format defines but torch lacks (F4, F6_*) have no torch tensors to order, so they are left out.
_DTYPE_ORDER = (
    "BOOL",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
)
_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("dcp_storage's safetensors writer needs a little-endian host")


class HeaderEntry(NamedTuple):
    """One tensor's header record; ``begin``/``end`` are offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def dtype_rank(dtype: str) -> int:
    """Position of a safetensors dtype name in the format's alignment order."""
    try:
        return _RANK[dtype]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype {dtype!r}") from None


def unstorable_keys(names: Iterable[str]) -> UnsupportedKeyError | None:
    """The error for names a safetensors header cannot hold (not UTF-8 encodable, or ``__metadata__``)."""
    bad = [n for n in names if n == "__metadata__" or not _utf8_encodable(n)]
    if not bad:
        return None
    return UnsupportedKeyError(bad, "safetensors", "a header key must be valid Unicode text other than __metadata__")


def _utf8_encodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def safetensors_order_key(name: str, dtype: str) -> tuple[int, str]:
    """Sort key that puts tensors in safetensors' data order (descending dtype rank, then name)."""
    return (-dtype_rank(dtype), name)


def encode_header(entries: Iterable[HeaderEntry], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix plus the padded JSON header, for ``entries`` given in data order.

    Writers plan every header before writing any data, so a key no header can hold fails here, before I/O.
    """
    entries = list(entries)
    unstorable = unstorable_keys(e.name for e in entries)
    if unstorable is not None:
        raise unstorable
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    position = 0
    for e in entries:
        if e.begin != position or e.end < e.begin:
            raise ValueError(
                f"{e.name}: data_offsets [{e.begin}, {e.end}) leave a gap or overlap (expected start {position})"
            )
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
        position = e.end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The row-major bytes of ``tensor`` as a 1-d ``uint8`` tensor on the tensor's device (no copy if possible)."""
    t = tensor.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def as_memoryview(u8: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU ``uint8`` tensor."""
    if u8.numel() == 0:
        return memoryview(b"")
    return memoryview(u8.numpy()).cast("B")


def pwrite_all(fd: int, data: memoryview, offset: int) -> int:
    """``os.pwrite`` until every byte of ``data`` is at ``offset`` (a call may write less than asked)."""
    done = 0
    total = data.nbytes
    while done < total:
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at offset {offset + done}")
        done += n
    return total


def data_order(entries: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """``(name, dtype)`` pairs sorted into safetensors' data order."""
    return sorted(entries, key=lambda e: safetensors_order_key(e[0], e[1]))
