"""The file names of a checkpoint and the bounds on the sizes it declares, defined once.

The file names of a checkpoint, defined once, and the check of the names a checkpoint records.

Names. Every module that writes, finds or lists a checkpoint's files takes their names from here:
DCP's ``.metadata`` and ``.distcp`` data files, dcp-storage's manifest and lock, Hugging Face safetensors
files and index, the extra-state file ``SafetensorsWriter`` writes, and the hidden temp names of a local
save in progress, with the patterns that recognise each kind of name in a listing.

Checking. A checkpoint names its own files: an HF index's ``weight_map``, DCP's ``.metadata`` storage map. A hostile
one could name ``../../etc/passwd``, an absolute path or a URL to another bucket and have a reader fetch
it with the caller's credentials. Every recorded name must be a plain relative path below the checkpoint.

Bounds on sizes a checkpoint declares, checked before anything is allocated or read.

Headers and pickles state shapes, offsets and lengths as integers of any size. torch indexes tensors and
files with signed 64-bit integers, so a declared size past ``2**63 - 1`` bytes cannot be real: left
unchecked it surfaces later as ``OverflowError`` or ``RuntimeError: numel: integer multiplication
overflow`` deep inside torch, with no file named. Python ints do the arithmetic here, so nothing wraps.

Files read whole before anything in them is checked have a size limit each (:class:`ByteLimit`), enforced
from the file's real size before it is read (:func:`read_limited`): a sparse 8 GiB ``.metadata`` costs a
``stat``, not 8 GiB. The defaults leave room for far larger checkpoints than exist (measured: 233 bytes of
``.metadata`` and 82 bytes of index per tensor), and each can be raised with its environment variable:

=============================  ============================================  ==========================
limit                          what                                           environment variable
=============================  ============================================  ==========================
:data:`METADATA` 1 GiB         DCP ``.metadata`` (about 4M tensor chunks)     ``DCP_STORAGE_MAX_METADATA_BYTES``
:data:`MANIFEST` 512 MiB       ``.dcp_storage.json`` (checksums, extensions)  ``DCP_STORAGE_MAX_MANIFEST_BYTES``
:data:`INDEX` 256 MiB          ``model.safetensors.index.json``               ``DCP_STORAGE_MAX_INDEX_BYTES``
safetensors header 100 MiB     the JSON header of a safetensors file          (fixed: the format's own)
:data:`BROADCAST_BYTES` 64 MiB  bytes a view repeats beyond its storage        ``DCP_STORAGE_MAX_BROADCAST_BYTES``
:data:`INFLATED` 64 MiB         what a stream extension may decode beyond      ``DCP_STORAGE_MAX_INFLATED_BYTES``
                               the item's chunk size and 100x its stored size
:data:`BYTE_ITEM` 1 GiB         one non-tensor (``BYTE_IO``) item of a DCP     ``DCP_STORAGE_MAX_BYTE_ITEM_BYTES``
                               checkpoint, read whole and decoded in memory
=============================  ============================================  ==========================

Safetensors headers use the 100 MiB limit of the reference implementation
(:data:`~dcp_storage.formats.safetensors.header.MAX_HEADER_BYTES`), checked against the file's size before
the header is fetched. :data:`BROADCAST_BYTES` bounds what a saved *view* may expand to: a ``torch.save``d
``torch.zeros(1).expand(2**28)`` stores 4 bytes and describes 1 GiB (see :func:`check_view`).
:data:`BYTE_ITEM` bounds a non-tensor item (a step counter, RNG or data-loader state, a config: kilobytes to a
few megabytes in practice) before its bytes are fetched, from the length the metadata gives it
(:func:`check_byte_item`): an 8 GiB item in a sparse file otherwise cost an 8 GiB buffer, then a decode of as
much. 1 GiB is far above any such state and below what a decode in memory can afford on a training host.
"""

from __future__ import annotations

import math
import os
import re
import unicodedata
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dcp_storage.errors import CorruptCheckpointError, FileTooLargeError
from dcp_storage.runtime import count_setting  # the one parser (also the transports' listing bounds)

__all__ = [
    "BROADCAST_BYTES",
    "BYTE_ITEM",
    "ByteLimit",
    "DATA_SUFFIX",
    "EXTRA_STATE_FILE",
    "HF_SHARD_RE",
    "INDEX",
    "INDEX_FILE",
    "INDEX_SUFFIX",
    "INFLATED",
    "LOCK_FILE",
    "LOCK_RE",
    "MANIFEST",
    "MANIFEST_FILE",
    "MANIFEST_RE",
    "MAX_BYTES",
    "MAX_DIM",
    "MAX_INFLATION_RATIO",
    "MAX_NDIM",
    "METADATA",
    "METADATA_FILE",
    "RANK_METADATA_RE",
    "SAFETENSORS_SUFFIX",
    "TEMP_RE",
    "all_plain",
    "check_byte_item",
    "check_byte_range",
    "check_prefix",
    "check_relative",
    "check_view",
    "checked_nbytes",
    "count_setting",
    "index_name",
    "inflation_limit",
    "read_limited",
    "shard_name",
    "single_name",
    "temp_name",
]


METADATA_FILE = ".metadata"  # DCP's metadata, the commit marker of a DCP checkpoint
DATA_SUFFIX = ".distcp"  # DCP's data files
MANIFEST_FILE = ".dcp_storage.json"  # dcp-storage's manifest (integrity.manifest), written just before .metadata
LOCK_FILE = ".dcp_storage.lock"  # held by a save from before its first byte until its commit (storage.claim)
SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"  # a Hugging Face index: {prefix}.safetensors.index.json
EXTRA_STATE_FILE = "extra_state.pt"  # SafetensorsWriter(allow_extra_state=True): non-tensor entries
DEFAULT_PREFIX = "model"  # what Hugging Face's save_pretrained names its files


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can start a file name in the checkpoint directory (plain, not hidden), else ``ValueError``."""
    if not prefix or "/" in prefix or os.sep in prefix or prefix.startswith("."):
        raise ValueError(f"filename_prefix must be a plain, non-hidden file name, got {prefix!r}")
    return prefix


def single_name(prefix: str = DEFAULT_PREFIX) -> str:
    """The one safetensors file of an unsharded save: ``model.safetensors``."""
    return f"{prefix}{SAFETENSORS_SUFFIX}"


def shard_name(prefix: str, k: int, n: int) -> str:
    """File ``k`` (1-based) of ``n``: ``model-00001-of-00003.safetensors``, as ``save_pretrained`` names it."""
    return f"{prefix}-{k:05d}-of-{n:05d}{SAFETENSORS_SUFFIX}"


def index_name(prefix: str = DEFAULT_PREFIX) -> str:
    """The index of a sharded save: ``model.safetensors.index.json``."""
    return f"{prefix}{INDEX_SUFFIX}"


INDEX_FILE = index_name()


def temp_name(name: str, token: str) -> str:
    """The hidden name ``.{name}.{token}.tmp`` a local save writes ``name`` under until its commit."""
    return f".{name}.{token}.tmp"


# What a listing holds. Temp files: the transport's open_atomic and SafetensorsWriter use a uuid4 hex token.
TEMP_RE = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{32}\.tmp$")
HF_SHARD_RE = re.compile(rf"^(?P<prefix>.+)-\d{{5}}-of-\d{{5}}{re.escape(SAFETENSORS_SUFFIX)}$")  # shard_name's
RANK_METADATA_RE = re.compile(rf"^__\d+{re.escape(METADATA_FILE)}$")  # a rank-local save's __{rank}.metadata
MANIFEST_RE = re.compile(rf"^(__\d+)?{re.escape(MANIFEST_FILE)}$")  # rank-local saves: __{rank}.dcp_storage.json
LOCK_RE = re.compile(rf"^(__\d+)?{re.escape(LOCK_FILE)}$")  # see storage.claim.lock_name


def check_relative(name: Any, where: str) -> str:
    """``name`` if it is a plain relative path that stays under the checkpoint root, else an error.

    The name is checked as it is and as what it may become further down (:func:`_read_as`): a URL library
    decodes ``%2e%2e`` into ``..`` and resolves it (yarl, under fsspec's HTTP filesystem, requests
    ``ckpt/%2e%2e/x`` as ``/x``), and NFKC folds fullwidth dots and solidus into ``..`` and ``/``.
    """
    if type(name) is str and _plain(name):  # what writers name their files: nothing to decode or fold
        return name
    if not isinstance(name, str) or not name:
        raise CorruptCheckpointError(f"{where}: file name must be a non-empty string, got {name!r}")
    for form in _read_as(name):
        _check_form(name, form, where)
    return name


# Names every form of which is the name itself and passes _check_form: ASCII (NFKC leaves it alone), no "%"
# (nothing to decode), no ":", "\\", "~" or NUL, and "/"-separated parts that are non-empty and do not start
# with "." (so none is "." or ".."). A name outside this pattern is checked in full; none inside it is refused.
_plain = re.compile(r"(?:[A-Za-z0-9_\-][A-Za-z0-9_.\-]*/)*[A-Za-z0-9_\-][A-Za-z0-9_.\-]*").fullmatch


def all_plain(names: Iterable[Any]) -> bool:
    """Whether :func:`check_relative` accepts every one of ``names`` without decoding or folding any (one
    C-level pass: a million data file names in a fraction of a second). ``False`` means only that some name
    must be checked in full."""
    try:
        return all(map(_plain, names))
    except TypeError:  # a name that is not a string
        return False


def _read_as(name: str) -> list[str]:
    """``name``, its percent-decodings (repeated: some stacks decode twice) and their NFKC forms."""
    forms = [name]
    while "%" in forms[-1] and len(forms) < 4:
        decoded = urllib.parse.unquote(forms[-1])
        if decoded == forms[-1]:
            break
        forms.append(decoded)
    return list(dict.fromkeys([*forms, *(unicodedata.normalize("NFKC", f) for f in forms)]))


def _check_form(name: str, form: str, where: str) -> None:
    shown = repr(name) if form == name else f"{name!r} (read as {form!r} once decoded)"
    parts = form.replace("\\", "/").split("/")
    if (
        "://" in form
        or form.startswith(("/", "\\", "~"))
        or (len(form) > 1 and form[1] == ":")  # C:\..., or a scheme without //
        or ".." in parts
        or "\x00" in form
    ):
        raise CorruptCheckpointError(
            f"{where}: file name {shown} escapes the checkpoint directory (absolute path, URL or '..'); refusing it"
        )
    if "" in parts or "." in parts:  # "x/", ".", "a//b", "a/./b": a directory, or a name no writer produces
        raise CorruptCheckpointError(
            f"{where}: file name {shown} is not a plain file name (an empty or '.' part, or a trailing '/': it names "
            "a directory, or the checkpoint itself); refusing it"
        )


MAX_BYTES = 2**63 - 1
MAX_DIM = 2**63 - 1  # one dimension of a shape: torch sizes are int64, even when another dimension is 0
# Dimensions of one shape. torch has no limit, but no model has more than a handful, and the product of many
# huge ones is quadratic to compute (80,000 factors of 2**62: 13 s) with more digits than Python prints.
MAX_NDIM = 1024
MiB = 1024 * 1024


@dataclass(frozen=True)
class ByteLimit:
    """The most bytes a kind of file read whole may have: ``default``, or the value of ``env`` if set."""

    what: str
    default: int
    env: str

    @property
    def bytes(self) -> int:
        """The limit in force (read at each use, so a process can raise it before loading)."""
        return count_setting(self.env, self.default, "bytes")


METADATA = ByteLimit("a DCP .metadata file", 1024 * MiB, "DCP_STORAGE_MAX_METADATA_BYTES")
MANIFEST = ByteLimit("a .dcp_storage.json manifest", 512 * MiB, "DCP_STORAGE_MAX_MANIFEST_BYTES")
INDEX = ByteLimit("a safetensors index", 256 * MiB, "DCP_STORAGE_MAX_INDEX_BYTES")
BROADCAST_BYTES = ByteLimit("a broadcast (overlapping) view", 64 * MiB, "DCP_STORAGE_MAX_BROADCAST_BYTES")
INFLATED = ByteLimit("an item decoded by a stream extension", 64 * MiB, "DCP_STORAGE_MAX_INFLATED_BYTES")
BYTE_ITEM = ByteLimit("a non-tensor (BYTE_IO) item", 1024 * MiB, "DCP_STORAGE_MAX_BYTE_ITEM_BYTES")


def check_byte_item(length: int, where: str, key: str) -> None:
    """Refuse a non-tensor item of ``length`` bytes above :data:`BYTE_ITEM`, before anything is fetched:
    :class:`~dcp_storage.errors.FileTooLargeError` naming the item, its size and the setting."""
    cap = BYTE_ITEM.bytes
    if length > cap:
        fix = f"if it is genuine, set {BYTE_ITEM.env} to a larger number of bytes"
        raise FileTooLargeError(f"{where} (item {key!r})", length, cap, BYTE_ITEM.what, fix)


def check_file_ends(transport: Any, ends: dict[str, int], sizes: dict[str, int]) -> None:
    """Name a missing or short data file up front instead of failing mid-read: ``ends`` maps each file to the
    byte its records need it to reach; ``sizes`` keeps the sizes asked (a ``stat`` each, or concurrent ``HEAD``s).

    Local files too: a ranged read fetches only a record's header and the slice's bytes, so a file cut inside
    the last record's zip trailer would otherwise load without a word.
    """
    unknown = [path for path in ends if path not in sizes]
    if len(unknown) > 1 and not getattr(transport, "is_local", True):
        sizes.update(zip(unknown, transport.executor().map(transport.size, unknown)))
    for path, end in ends.items():
        size = sizes.get(path)
        if size is None:
            size = sizes[path] = transport.size(path)
        if size < end:
            raise CorruptCheckpointError(
                f"{transport.url(path)}: file is {size} bytes but the metadata needs {end} (truncated?)"
            )


def read_limited(transport: Any, path: str, limit: ByteLimit) -> bytes:
    """The whole file at ``path``, if it has at most ``limit`` bytes: a larger one raises
    :class:`~dcp_storage.errors.FileTooLargeError` naming it, the limit and how to raise it, having read
    none of it where the store tells its size first (a local disk, S3) and at most ``limit + 1`` bytes
    otherwise."""
    cap = limit.bytes
    try:
        return transport.read_file(path, max_bytes=cap)
    except FileTooLargeError as exc:
        fix = f"if it is genuine, set {limit.env} to a larger number of bytes"
        raise FileTooLargeError(transport.url(path), exc.size, cap, limit.what, fix) from None


def checked_nbytes(shape: Sequence[int], itemsize: int, where: str) -> int:
    """``prod(shape) * itemsize``, or :class:`CorruptCheckpointError` if a dimension is negative or the
    byte count cannot exist (more than ``2**63 - 1``). A dimension beyond int64 is refused even when another
    is 0 (the product is then 0, but torch cannot hold the shape)."""
    if len(shape) > MAX_NDIM:
        raise CorruptCheckpointError(f"{where}: a shape of {len(shape)} dimensions (at most {MAX_NDIM})")
    if any(n < 0 for n in shape):
        raise CorruptCheckpointError(f"{where}: shape {list(shape)} has a negative dimension")
    if any(n > MAX_DIM for n in shape):
        raise CorruptCheckpointError(f"{where}: shape {list(shape)} has a dimension beyond int64")
    nbytes = math.prod(shape) * itemsize
    if nbytes > MAX_BYTES:
        raise CorruptCheckpointError(
            f"{where}: shape {list(shape)} needs more bytes than any file can hold (2**63 - 1); "
            "the checkpoint is corrupt or hostile"
        )
    return nbytes


def check_byte_range(offset: int, length: int, where: str) -> None:
    """A stored record's ``[offset, offset + length)`` must be non-negative and end before ``2**63``."""
    if offset < 0 or length < 0 or offset + length > MAX_BYTES:
        raise CorruptCheckpointError(
            f"{where}: byte range offset {offset}, length {length} is impossible (negative, or past 2**63 - 1)"
        )


def check_view(
    shape: Sequence[int], stride: Sequence[int], storage_offset: int, itemsize: int, storage_nbytes: int, where: str
) -> None:
    """A saved tensor view must lie inside its storage, and may repeat storage bytes (stride 0, overlapping
    strides) only up to :data:`BROADCAST_BYTES` beyond the storage's own size.

    A view is a window on a storage: ``shape``, ``stride`` (elements) and ``storage_offset``. Reading it
    yields ``prod(shape) * itemsize`` bytes, which for a broadcast view (``expand``) can be any number of
    times the stored bytes: conversion and deep verification would materialise all of them. Views whose
    element bytes exceed the stored bytes by more than the limit are refused with the file named.
    """
    if not all(type(v) is int for v in (*shape, *stride, storage_offset)):
        raise CorruptCheckpointError(
            f"{where}: tensor shape {list(shape)}, stride {list(stride)}, offset {storage_offset!r}: not all integers"
        )
    if len(shape) != len(stride) or any(s < 0 or s > MAX_DIM for s in stride):
        raise CorruptCheckpointError(f"{where}: invalid tensor shape {list(shape)} / stride {list(stride)}")
    if not 0 <= storage_offset <= MAX_DIM:
        raise CorruptCheckpointError(f"{where}: storage offset {storage_offset} outside int64's range")
    nbytes = checked_nbytes(shape, itemsize, f"{where}: tensor")
    if nbytes == 0:
        return
    last = storage_offset + sum((s - 1) * st for s, st in zip(shape, stride))
    if (last + 1) * itemsize > storage_nbytes:
        raise CorruptCheckpointError(
            f"{where}: tensor of shape {list(shape)} reaches element {last} beyond its storage ({storage_nbytes} bytes)"
        )
    extra = nbytes - storage_nbytes
    cap = BROADCAST_BYTES.bytes
    if extra > cap:
        raise CorruptCheckpointError(
            f"{where}: a view of shape {list(shape)}, stride {list(stride)} repeats its {storage_nbytes} stored "
            f"bytes into {nbytes} bytes, more than {cap} bytes beyond what is stored (a broadcast or overlapping "
            f"view); refusing to expand it. If it is genuine, set {BROADCAST_BYTES.env} to a larger number of bytes"
        )


# A deflated zip entry may declare at most this many times its compressed size. torch.save never
# compresses; pickles and text that other zip writers deflate shrink 3-10x; deflate's own ceiling is about
# 1032x (a run of one byte value), which is what a deflate bomb uses. Entries are also inflated into at
# most their declared size, so an entry that lies about its size costs nothing more.
MAX_INFLATION_RATIO = 100


def inflation_limit(stored: int, expected: int = 0) -> int:
    """The most bytes an item of ``stored`` bytes may decode to through a stream extension (compression).

    A zstd frame of zeros inflates more than 30,000 times, so a ratio alone either refuses genuine tensors
    of zeros or lets a few KB become gigabytes. ``expected``: what the metadata says the decoded item holds
    (a tensor chunk's bytes plus its record's overhead; 0 when unknown, as for non-tensor values). The
    limit is the larger of that and :data:`MAX_INFLATION_RATIO` times the stored bytes, plus
    :data:`INFLATED` (``DCP_STORAGE_MAX_INFLATED_BYTES``).
    """
    return max(expected, stored * MAX_INFLATION_RATIO) + INFLATED.bytes
