"""Checksum algorithms, by the name a checkpoint records, and a stream wrapper that hashes while writing.

A checkpoint names its algorithm (``"xxh3_64"``, ``"xxh64"``, ``"crc32c"``, ``"crc32"``), so readers handle
any of them whatever the writer's default. :data:`DEFAULT_ALGORITHM` is the fastest one measured here on the
bytes a load has just read (256 KiB pieces, in cache): zip's CRC-32 by ISA-L (PCLMULQDQ/VPCLMULQDQ folding)
at 60-80 GB/s on one core, xxh3_64 at 38-55, crc32c 15, zlib's crc32 5. Loads check every byte by default,
so this is what a warm local load pays: +9-15% with CRC-32 read and hashed in one native loop per 16 MiB
run (:mod:`dcp_storage.transports.local_io`'s ``pread_crc32``), +29-33% with CRC-32 pieces hashed from
Python, +37-42% with xxh3_64 (2 threads, 256 MiB; ``benchmarks/bench_default_verify.py``). Checkpoints written with xxh3_64 (the default before) keep it.
Digests are fixed-width lowercase hex, so a record's size is known before its value (the safetensors
writer reserves header space for them).

A mismatch is reported with the digest the checkpoint recorded, never the one computed from the stored
bytes (:func:`mismatch`): a digest of content is a fingerprint of it, and an error or ``verify`` report
that prints it lets whoever wrote the manifest test guesses about the bytes. Reads stay inside the
checkpoint (:mod:`dcp_storage.transports.local_io`), so this is defence in depth: nothing a computed
digest could describe lies outside the checkpoint, and the computed value tells a user nothing the
words "mismatch" do not.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, Protocol

from dcp_storage.errors import DcpStorageError

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "ChecksumAlgorithmError",
    "Hasher",
    "HashingWriter",
    "BLOCK_SIZE",
    "block_size_for",
    "check_algorithm",
    "checksum",
    "crc32",
    "digest_width",
    "mismatch",
    "new_hasher",
    "one_shot",
]

DEFAULT_ALGORITHM = "crc32"

# Records also get a checksum per block, so a rank reading a slice is checked by the blocks that cover it,
# reading at most a block more on each side. A block is 1/64 of the tensor, a power of two from 16 KiB to
# BLOCK_SIZE (1 MiB from 64 MiB tensors on): a Shard(0) split then reads at most 1/64 of the record more
# per side. Records of at most WHOLE_BELOW bytes are read whole by the loaders, and get none.
BLOCK_SIZE = 1 << 20
MIN_BLOCK = 16 * 1024
BLOCKS_PER_RECORD = 64
WHOLE_BELOW = 256 * 1024


def block_size_for(nbytes: int) -> int | None:
    """The block size for a record holding ``nbytes`` of data (``None``: no blocks, it is read whole)."""
    if nbytes <= WHOLE_BELOW:
        return None
    size = MIN_BLOCK
    while size * BLOCKS_PER_RECORD < nbytes and size < BLOCK_SIZE:
        size *= 2
    return size


DATA_WRITE = 64 * 1024  # a write at least this long inside an item's first block starts its elements

try:  # ISA-L's CRC-32 (zip's polynomial): 11.7 GB/s against zlib's 3.5 here (under load); zlib if missing
    from isal.isal_zlib import crc32 as _fast_crc32
except ImportError:  # pragma: no cover - isal is a dependency; a platform without a wheel still works
    _fast_crc32 = zlib.crc32


def crc32(data: Any, value: int = 0) -> int:
    """zip's CRC-32 of a bytes-like object (continuing from ``value``): ISA-L's when installed, else zlib's."""
    return _fast_crc32(data, value)  # type: ignore[no-any-return]


class ChecksumAlgorithmError(DcpStorageError, ValueError):
    """A checkpoint names a checksum algorithm this installation cannot compute (names what to install)."""


class Hasher(Protocol):
    def update(self, data: Any) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc:
    """``zlib.crc32``-style incremental function (``fn(data, value) -> value``) as a hasher."""

    __slots__ = ("_fn", "_value")

    def __init__(self, fn: Callable[[Any, int], int]) -> None:
        self._fn = fn
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = self._fn(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _xxhash(name: str) -> Callable[[], Hasher]:
    def make() -> Hasher:
        try:
            import xxhash
        except ImportError as exc:
            raise ChecksumAlgorithmError(
                f"checksum algorithm {name!r} needs the 'xxhash' package: pip install xxhash"
            ) from exc
        return getattr(xxhash, name)()  # type: ignore[no-any-return]

    return make


def _crc32c() -> Hasher:
    try:
        import crc32c as impl

        return _Crc(lambda data, value: impl.crc32c(data, value))
    except ImportError:
        pass
    try:
        import google_crc32c
    except ImportError as exc:
        raise ChecksumAlgorithmError("checksum algorithm 'crc32c' needs a CRC32C package: pip install crc32c") from exc
    return _Crc(lambda data, value: google_crc32c.extend(value, bytes(data)))


def _crc32() -> Hasher:
    return _Crc(_fast_crc32)  # the C function itself: a hasher's update is one call per piece


ALGORITHMS: dict[str, tuple[Callable[[], Hasher], int]] = {
    # name: (factory, hex digits)
    "xxh3_64": (_xxhash("xxh3_64"), 16),
    "xxh64": (_xxhash("xxh64"), 16),
    "crc32c": (_crc32c, 8),
    "crc32": (_crc32, 8),
}


def _lookup(algorithm: str) -> tuple[Callable[[], Hasher], int]:
    try:
        return ALGORITHMS[algorithm]
    except KeyError:
        raise ChecksumAlgorithmError(
            f"unknown checksum algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)} (a newer dcp-storage may "
            "know it: pip install -U dcp-storage)"
        ) from None


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> Hasher:
    """A fresh incremental hasher for ``algorithm``; :class:`ChecksumAlgorithmError` if unknown or not installed."""
    return _lookup(algorithm)[0]()


def one_shot(algorithm: str) -> Callable[[Any], str]:
    """``data -> hex digest`` of ``algorithm`` in one call, for blocks (at most a few MiB) checked many times.

    For crc32 and the xxhash algorithms it is one C call, no hasher object (xxhash's one-shot function holds the
    GIL while it hashes: a 1 MiB block in cache takes ~25 us), so the worker thread that read the block
    keeps its core and its cache instead of handing the GIL over twice per block. Use :func:`new_hasher` for
    large buffers, which releases the GIL while it hashes. :class:`ChecksumAlgorithmError` as
    :func:`new_hasher`.
    """
    factory = _lookup(algorithm)[0]
    if algorithm == "crc32":
        return _crc32_hex
    fast = _ONE_SHOT.get(algorithm)
    if fast is not None:
        try:
            import xxhash  # noqa: PLC0415 - optional until a checkpoint names an xxhash algorithm

            return getattr(xxhash, fast)  # type: ignore[no-any-return]
        except (ImportError, AttributeError):  # an xxhash without one-shot functions: the hasher below
            pass

    def digest(data: Any) -> str:
        h = factory()
        h.update(data)
        return h.hexdigest()

    factory()  # not installed: refused now, not at the first block
    return digest


_ONE_SHOT = {"xxh3_64": "xxh3_64_hexdigest", "xxh64": "xxh64_hexdigest"}


def _crc32_hex(data: Any) -> str:
    return f"{_fast_crc32(data):08x}"


def digest_width(algorithm: str) -> int:
    """Hex digits of ``algorithm``'s digest."""
    return _lookup(algorithm)[1]


def check_algorithm(algorithm: str | None) -> str | None:
    """``algorithm`` if a writer can use it: ``None`` (checksums off) or a known, installed algorithm.

    Every writer calls this in its constructor, so a typo or a missing package is refused before any
    planning, and ``None`` means the same everywhere: no checksum is computed or recorded.
    """
    if algorithm is not None:
        new_hasher(algorithm)  # unknown, or its package is missing: ChecksumAlgorithmError naming the fix
    return algorithm


def checksum(data: Any, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Hex digest of a bytes-like object."""
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


class HashingWriter:
    """Wraps a binary stream; hashes every byte written into the current item's hasher.

    The writer calls :meth:`begin` before each item and :meth:`end` after it; ``end`` returns the item's
    ``(offset, length, hex)`` (``hex`` is ``None`` when ``algorithm`` is ``None``: checksums off, the
    bytes are only counted). Bytes written outside an item are a bug (they would not be covered), so
    :meth:`write` refuses them. ``tell`` passes through, so ``torch.save`` sees a seekable-looking stream
    exactly as before.

    With ``block_size`` each item is also hashed in blocks of that many bytes; after :meth:`end`,
    :attr:`blocks` holds their digests (empty for an item of one block, whose digest is the item's). The
    first write of :data:`DATA_WRITE` bytes or more inside the first block (``torch.save`` writes a
    tensor's elements in one call, after ~1 KiB of zip headers and pickle) ends that block early, and
    :attr:`first_block` says where (0: it did not), so the blocks after it are aligned to the elements:
    a ``Shard(0)`` slice of whole MiBs is then covered by its own blocks exactly.
    """

    def __init__(self, raw: Any, algorithm: str | None = DEFAULT_ALGORITHM, block_size: int | None = None) -> None:
        self._raw = raw
        self.algorithm = algorithm
        self.block_size = block_size
        self._item_block: int | None = block_size
        self._hasher: Hasher | None = None
        self._block: Hasher | None = None
        self._block_left = 0
        self.blocks: tuple[str, ...] = ()
        self.first_block = 0
        self.blocks_size = 0
        self._blocks: list[str] = []
        self._item_bytes = 0
        self._open = False
        self._start = 0

    def begin(self, block_size: int | None | bool = True) -> None:
        """Start an item; ``block_size``: its block size (``None``: no blocks; ``True``: the writer's)."""
        if self._open:
            raise RuntimeError("HashingWriter.begin called inside an item")
        self._open = True
        self._item_block = self.block_size if block_size is True else block_size
        self._hasher = new_hasher(self.algorithm) if self.algorithm is not None else None
        self._blocks, self._block, self._block_left = [], None, 0
        self.first_block, self._item_bytes = 0, 0
        self._start = self._raw.tell()

    def end(self) -> tuple[int, int, str | None]:
        if not self._open:
            raise RuntimeError("HashingWriter.end called outside an item")
        hasher, self._hasher, self._open = self._hasher, None, False
        if self._block is not None:
            self._blocks.append(self._block.hexdigest())
            self._block = None
        self.blocks = tuple(self._blocks) if len(self._blocks) > 1 else ()
        self.blocks_size = self._item_block if self.blocks else 0
        if not self.blocks:
            self.first_block = 0
        return (self._start, self._raw.tell() - self._start, hasher.hexdigest() if hasher is not None else None)

    PIECE = 4 * 1024 * 1024  # hashed, then written, while still in the CPU cache (one pass from memory saved)

    def write(self, data: Any) -> int:
        if not self._open:
            raise RuntimeError("HashingWriter.write called outside an item: those bytes would not be covered")
        if self._hasher is None:
            return self._raw.write(data)  # type: ignore[no-any-return]
        view = memoryview(data).cast("B")
        if view.nbytes <= self.PIECE:
            self._hash(view, view.nbytes)
            return self._raw.write(data)  # type: ignore[no-any-return]
        for pos in range(0, view.nbytes, self.PIECE):
            piece = view[pos : pos + self.PIECE]
            self._hash(piece, view.nbytes if pos == 0 else 0)
            self._raw.write(piece)
        return view.nbytes

    def _hash(self, view: memoryview, whole: int = 0) -> None:
        self._hasher.update(view)  # type: ignore[union-attr]
        if self._item_block is None:
            return
        if (
            whole >= DATA_WRITE
            and not self._blocks
            and not self.first_block
            and 0 < self._item_bytes < self._item_block
            and self._block is not None
        ):  # the elements start here: the header is a block of its own
            self._blocks.append(self._block.hexdigest())
            self._block = None
            self.first_block = self._item_bytes
        self._item_bytes += view.nbytes
        pos = 0
        while pos < view.nbytes:
            if self._block is None:
                self._block, self._block_left = new_hasher(self.algorithm), self._item_block  # type: ignore[arg-type]
            n = min(self._block_left, view.nbytes - pos)
            self._block.update(view[pos : pos + n])
            pos += n
            self._block_left -= n
            if self._block_left == 0:
                self._blocks.append(self._block.hexdigest())
                self._block = None

    def tell(self) -> int:
        return self._raw.tell()  # type: ignore[no-any-return]

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def mismatch(algorithm: str | None, recorded: str) -> str:
    """The words for a checksum that does not match: the recorded digest only (see the module docstring)."""
    return f"{algorithm} checksum mismatch (recorded {recorded}; the digest of the stored bytes is not shown)"
