"""Checksums inside a safetensors file's own header, so the file stays one self-describing object.

``SafetensorsWriter`` records, in the header's ``__metadata__`` (string values only, next to the
``"format": "pt"`` that ``transformers`` requires)::

    "dcp_storage.writer": "dcp-storage/0.1.0"          provenance (who wrote the file)
    "dcp_storage.format": "safetensors/1"
    "dcp_storage.checksum_algorithm": "xxh3_64"
    "dcp_storage.checksum:<key>": "<hex>"                 digest of the tensor's whole data bytes, or
    "dcp_storage.checksum:<key>": "[[[0,0],[32,8],\\"<hex>\\"], ...]"  one digest per written chunk
    "dcp_storage.header_checksum": "<hex>"                digest of the length prefix and header bytes

Why per chunk. Ranks write their chunks of a DTensor straight into the file (``pwrite``) or send them to a
coordinator that streams the file; no process ever holds a sharded tensor whole, and hashes of the pieces
of a byte string cannot be combined into the hash of the string. So each writer hashes exactly the
row-major bytes of the box it wrote (``offsets``/``sizes`` in elements, as in DCP's chunk metadata): a
``Shard(0)`` chunk is a contiguous byte range of the tensor, a ``Shard(1)`` chunk a set of equal runs.
The boxes tile the tensor, so every data byte is covered by exactly one digest. A tensor written whole
(one process, or a replicated tensor) gets the plain ``"<hex>"`` form.

Why a header digest. A flipped byte in the JSON usually breaks parsing or a tensor's offsets, but not
always (a space of the padding turned into a tab, a digit of a ``__metadata__`` value). The header
digest covers the 8-byte length and every header byte, computed with its own value zeroed.

Why the digests fit a header written first. Hex digests have a fixed width (``digest_width``), so the
header is planned with zero-filled placeholders of the right width and its length never changes when
the real digests are filled in: locally the coordinator rewrites the header of the temp file in place
before the rename; for object stores every rank hashes its chunks before the coordinator uploads the
header (see :mod:`dcp_storage.formats.safetensors.writer`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.reading import tiling_problem
from dcp_storage.formats.safetensors.header import LENGTH_BYTES, header_length, parse_header
from dcp_storage.integrity.checksums import checksum, digest_width, mismatch

__all__ = [
    "ALGORITHM_KEY",
    "CHECKSUM_PREFIX",
    "FORMAT_KEY",
    "HEADER_KEY",
    "MAX_CHECKSUM_PIECES",
    "RESERVED_PREFIX",
    "WRITER_KEY",
    "FileSums",
    "Piece",
    "box_bytes",
    "encode_pieces",
    "placeholder",
    "seal_header",
]

RESERVED_PREFIX = "dcp_storage."
WRITER_KEY = "dcp_storage.writer"
FORMAT_KEY = "dcp_storage.format"
ALGORITHM_KEY = "dcp_storage.checksum_algorithm"
HEADER_KEY = "dcp_storage.header_checksum"
CHECKSUM_PREFIX = "dcp_storage.checksum:"


@dataclass(frozen=True)
class Piece:
    """A box of a tensor (element ``offsets``/``sizes``) and the digest of its row-major bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    digest: str

    def covers(self, shape: Sequence[int]) -> bool:
        return all(o == 0 for o in self.offsets) and tuple(self.sizes) == tuple(shape)

    def describe(self, key: str) -> str:
        return repr(key) + (f" (chunk at {list(self.offsets)}, size {list(self.sizes)})" if any(self.offsets) else "")


def placeholder(algorithm: str) -> str:
    """The zero digest a header is planned with (same width as the real one)."""
    return "0" * digest_width(algorithm)


def encode_pieces(pieces: Sequence[Piece], shape: Sequence[int]) -> str:
    """The metadata value for one tensor: ``"<hex>"`` when one piece covers it, else the JSON list."""
    if len(pieces) == 1 and pieces[0].covers(shape):
        return pieces[0].digest
    return json.dumps([[list(p.offsets), list(p.sizes), p.digest] for p in pieces], separators=(",", ":"))


def seal_header(header: bytes, algorithm: str) -> bytes:
    """``header`` (length prefix + JSON, header digest zero-filled) with its header digest filled in."""
    zero = placeholder(algorithm)
    needle = f'"{HEADER_KEY}":"{zero}"'.encode()
    at = header.find(needle)
    if at < 0:
        raise ValueError("the header carries no zero-filled header checksum to seal")
    digest = checksum(header, algorithm).encode()
    start = at + len(needle) - len(zero) - 1
    return header[:start] + digest + header[start + len(digest) :]


def box_bytes(full: torch.Tensor, shape: Sequence[int], itemsize: int, piece: Piece) -> torch.Tensor:
    """The row-major bytes of ``piece``'s box, from ``full`` (the whole tensor as 1-d ``uint8``)."""
    if piece.covers(shape):
        return full
    if not shape:
        return full
    elems = full.view(-1, itemsize).reshape(*shape, itemsize)
    box = elems[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))]
    return box.contiguous().reshape(-1)


# One piece per chunk a writer wrote (a rank's shard of the tensor). A list is counted (two quotes per
# digest) before it is parsed: a header of 100 MiB could otherwise list millions of zero-size pieces,
# which pass the volume check and cost ~700 bytes of Python objects and one hash each.
MAX_CHECKSUM_PIECES = 1 << 16


def _pieces(value: str, algorithm: str, where: str) -> list[Piece] | str:
    """Parsed pieces of a metadata value, or a problem string."""
    width = digest_width(algorithm)
    if not value.startswith("["):
        return [Piece((), (), value)] if len(value) == width else f"digest {value!r} is not {width} hex digits"
    if value.count('"') > 2 * MAX_CHECKSUM_PIECES:
        return f"checksum list holds more than {MAX_CHECKSUM_PIECES} pieces (one per written chunk is expected)"
    try:
        doc = json.loads(value)
        pieces = [Piece(tuple(int(x) for x in o), tuple(int(x) for x in s), str(d)) for o, s, d in doc]
    except (ValueError, TypeError, RecursionError) as exc:
        return f"checksum list is malformed ({type(exc).__name__})"
    return pieces


class FileSums:
    """The checksums one safetensors file records: parsed from its header metadata, checked against data.

    ``raw_header`` is the length prefix plus the JSON header, exactly as stored (for the header digest).
    """

    def __init__(self, url: str, metadata: Mapping[str, str] | None, raw_header: bytes | None = None) -> None:
        self.url = url
        md = dict(metadata or {})
        self.writer = md.get(WRITER_KEY)
        self.format = md.get(FORMAT_KEY)
        self.algorithm = md.get(ALGORITHM_KEY)
        self.header_digest = md.get(HEADER_KEY)
        self.values = {k[len(CHECKSUM_PREFIX) :]: v for k, v in md.items() if k.startswith(CHECKSUM_PREFIX)}
        # A damaged key must not make a file look unchecked: any one of ours claims the whole set.
        fixed = {WRITER_KEY: self.writer, FORMAT_KEY: self.format, ALGORITHM_KEY: self.algorithm}
        fixed[HEADER_KEY] = self.header_digest
        self.missing = sorted(k for k, v in fixed.items() if v is None)
        self.present = len(self.missing) < len(fixed) or bool(self.values)
        # kept only to check the header's digest: a file without ours does not hold 100 MB per 1M-tensor header
        self.raw_header = raw_header if self.present else None

    def header_problem(self) -> str | None:
        """Why the stored header fails its digest (``None``: it matches, or the file records no checksums)."""
        if not self.present:
            return None
        if self.missing:
            return (
                f"{self.url}: the header records dcp-storage checksums but lacks {', '.join(self.missing)}: the "
                "header bytes changed after they were written"
            )
        if self.header_digest is None or self.raw_header is None or self.algorithm is None:
            return None
        try:
            zero = placeholder(self.algorithm)
        except Exception as exc:  # noqa: BLE001 - an unknown algorithm is the problem
            return f"{self.url}: {exc}"
        needle = f'"{HEADER_KEY}":"{self.header_digest}"'.encode()
        at = self.raw_header.find(needle)
        if at < 0 or len(self.header_digest) != len(zero):
            return f"{self.url}: header checksum field is malformed: the header bytes changed after they were written"
        start = at + len(needle) - len(zero) - 1
        zeroed = self.raw_header[:start] + zero.encode() + self.raw_header[start + len(zero) :]
        got = checksum(zeroed, self.algorithm)
        if got != self.header_digest:
            return (
                f"{self.url} bytes [0, {len(self.raw_header)}) (the header): "
                f"{mismatch(self.algorithm, self.header_digest)}: the header bytes changed after they were written"
            )
        return None

    def coverage_problems(self, tensors: Mapping[str, Any]) -> list[str]:
        """Tensors without a digest, digests of unknown tensors, and pieces that do not tile their tensor."""
        out = []
        for name in sorted(set(tensors) - set(self.values)):
            out.append(f"{self.url}: tensor {name!r} has no recorded checksum (the header was changed?)")
        for name in sorted(set(self.values) - set(tensors)):
            out.append(f"{self.url}: a checksum is recorded for {name!r}, which the header does not hold")
        for name in sorted(set(self.values) & set(tensors)):
            got = self.pieces(name, tensors[name].shape)
            if isinstance(got, str):
                out.append(f"{self.url}: tensor {name!r}: {got}")
        return out

    def pieces(self, name: str, shape: Sequence[int]) -> list[Piece] | str:
        """The pieces recorded for tensor ``name`` of ``shape`` (boxes checked to tile it), or a problem."""
        if self.algorithm is None or name not in self.values:
            return "no checksum recorded"
        try:
            got = _pieces(self.values[name], self.algorithm, self.url)
        except Exception as exc:  # noqa: BLE001 - an unknown algorithm is the problem
            return str(exc)
        if isinstance(got, str):
            return got
        shape = tuple(shape)
        got = [Piece((0,) * len(shape), shape, p.digest) if not p.sizes and not p.offsets else p for p in got]
        for p in got:
            if len(p.offsets) != len(shape) or len(p.sizes) != len(shape):
                return f"checksum piece {list(p.offsets)}/{list(p.sizes)} does not match shape {list(shape)}"
            if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(p.offsets, p.sizes, shape)):
                return f"checksum piece at {list(p.offsets)} of size {list(p.sizes)} lies outside {list(shape)}"
        if math.prod(shape) > 0:  # overlapping pieces whose volume matches would leave a region unchecked
            problem = tiling_problem(shape, [(p.offsets, p.sizes) for p in got if math.prod(p.sizes)])
            if problem is not None:
                return "checksum pieces do not tile the tensor: " + problem.replace("chunk", "piece")
        return got

    def check_tensor(self, name: str, shape: Sequence[int], itemsize: int, full: torch.Tensor, span: str) -> str | None:
        """Compare tensor ``name`` (its whole data bytes ``full``, 1-d uint8) with its digests.

        ``span`` names the tensor's byte range in the file. Returns the problem, naming URL, range and key.
        """
        pieces = self.pieces(name, shape)
        if isinstance(pieces, str):
            return f"{self.url} {span} (tensor {name!r}): {pieces}"
        for piece in pieces:
            data = box_bytes(full, shape, itemsize, piece)
            got = checksum(memoryview(data.numpy()) if data.numel() else b"", self.algorithm or "")
            if got != piece.digest:
                return (
                    f"{self.url} {span} (holding {piece.describe(name)}): "
                    f"{mismatch(self.algorithm, piece.digest)}: the stored bytes changed after they were written"
                )
        return None

    @classmethod
    def read(cls, transport: Any, path: str) -> tuple[FileSums, Any]:
        """The checksums of the safetensors file at ``path`` and its parsed header (two small ranged reads).

        Raises :class:`CorruptCheckpointError` if the header does not parse.
        """
        url = transport.url(path)
        size = transport.size(path)
        prefix = bytes(transport.read_range(path, 0, min(LENGTH_BYTES, size)))
        n = header_length(prefix, size, url)
        text = bytes(transport.read_range(path, LENGTH_BYTES, LENGTH_BYTES + n))
        # ends_the_file=False: torch's DCP-safetensors files hold further blobs after the first; whether a
        # standalone file's data section is covered to its end is checked by the scan every reader runs.
        header = parse_header(text, size - LENGTH_BYTES - n, url, ends_the_file=False)
        return cls(url, header.metadata, prefix + text), header


def require_checksummed(sums: FileSums) -> None:
    """Raise when a file that claims our checksums has a broken header digest."""
    problem = sums.header_problem()
    if problem is not None:
        raise CorruptCheckpointError(problem)
