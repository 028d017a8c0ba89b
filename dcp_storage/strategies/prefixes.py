"""Prefix strategies: spreading a checkpoint's data files over key prefixes of an object store.

S3 scales request rates per key prefix (about 3,500 PUT/s and 5,500 GET/s each), so thousands of ranks
writing ``ckpt/__{rank}_*.distcp`` at once share one prefix's budget until the store splits it. A prefix
strategy gives each rank a directory inside the checkpoint whose name varies in its *first* character, so
the keys of different ranks start to differ right after the checkpoint path::

    ckpt/.metadata
    ckpt/0000000000/__0_0.distcp        # HexPrefixStrategy over 16 ranks: 0, 1, ..., f first
    ckpt/1000000000/__1_0.distcp

Every reader finds the files through ``.metadata`` (the storage map records ``0000000000/__0_0.distcp``),
torch's ``FileSystemReader``/``FsspecReader`` included, so nothing else changes. The built-ins follow
s3torchconnector's (``s3_prefix_strategy.py``): numeric prefixes in base 2, 10 or 16, reversed so the
fastest-changing digit comes first, padded to ``min_length``, one per rank up to ``count`` (default: the
world size) and then reused round-robin; an optional ``epoch`` adds ``/epoch_{n}``. A strategy is any
object with ``directory(rank, world_size) -> str``; plugins register one under the ``dcp_storage.strategies``
entry-point group and users pass its name (``FsspecWriter(url, prefix_strategy="my-prefixes")``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

from dcp_storage import registry
from dcp_storage.formats.paths import check_relative

__all__ = [
    "BinaryPrefixStrategy",
    "DecimalPrefixStrategy",
    "HexPrefixStrategy",
    "NumericPrefixStrategy",
    "PrefixStrategy",
    "RoundRobinPrefixStrategy",
    "resolve_prefix_strategy",
]


@runtime_checkable
class PrefixStrategy(Protocol):
    """Where a rank's data files go inside the checkpoint: a relative directory, or ``""`` for the root."""

    def directory(self, rank: int, world_size: int) -> str: ...


def _epoch_part(epoch: int | None) -> str:
    if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0):
        raise ValueError(f"epoch must be a non-negative int or None, got {epoch!r}")
    return "" if epoch is None else f"/epoch_{epoch}"


class NumericPrefixStrategy:
    """``rank % count`` written in ``base`` (2, 10 or 16), reversed, zero-padded to ``min_length`` digits."""

    _DIGITS: ClassVar[dict[int, str]] = {2: "b", 10: "d", 16: "x"}

    def __init__(self, base: int = 16, *, min_length: int = 10, count: int | None = None, epoch: int | None = None):
        if base not in self._DIGITS:
            raise ValueError(f"base must be one of {sorted(self._DIGITS)}, got {base!r}")
        if not isinstance(min_length, int) or min_length < 1:
            raise ValueError(f"min_length must be a positive int, got {min_length!r}")
        if count is not None and (not isinstance(count, int) or count < 1):
            raise ValueError(f"count must be a positive int or None (the world size), got {count!r}")
        self.base, self.min_length, self.count, self.epoch = base, min_length, count, epoch
        self._epoch = _epoch_part(epoch)

    def directory(self, rank: int, world_size: int) -> str:
        count = self.count or max(world_size, 1)
        digits, size = 1, self.base
        while size < count:  # digits needed to tell ``count`` prefixes apart
            digits, size = digits + 1, size * self.base
        width = max(digits, self.min_length)
        text = format(rank % count, f"0{width}{self._DIGITS[self.base]}")
        return text[::-1] + self._epoch

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base={self.base}, min_length={self.min_length}, count={self.count}, epoch={self.epoch})"


class BinaryPrefixStrategy(NumericPrefixStrategy):
    """Prefixes of ``0`` and ``1`` only (``0000000000``, ``1000000000``, ``0100000000``, ...)."""

    def __init__(self, *, min_length: int = 10, count: int | None = None, epoch: int | None = None):
        super().__init__(2, min_length=min_length, count=count, epoch=epoch)


class DecimalPrefixStrategy(NumericPrefixStrategy):
    """Decimal prefixes (``0000000000``, ``1000000000``, ..., ``9000000000``, ``0100000000``, ...)."""

    def __init__(self, *, min_length: int = 10, count: int | None = None, epoch: int | None = None):
        super().__init__(10, min_length=min_length, count=count, epoch=epoch)


class HexPrefixStrategy(NumericPrefixStrategy):
    """Hexadecimal prefixes (``0000000000``, ``1000000000``, ..., ``f000000000``, ``0100000000``, ...)."""

    def __init__(self, *, min_length: int = 10, count: int | None = None, epoch: int | None = None):
        super().__init__(16, min_length=min_length, count=count, epoch=epoch)


class RoundRobinPrefixStrategy:
    """The given ``prefixes`` (each a plain relative directory), assigned to ranks in turn."""

    def __init__(self, prefixes: Sequence[str], *, epoch: int | None = None):
        if isinstance(prefixes, str) or not prefixes:
            raise ValueError("prefixes must be a non-empty sequence of directory names")
        self.prefixes = [check_relative(p, "RoundRobinPrefixStrategy") for p in prefixes]
        self.epoch = epoch
        self._epoch = _epoch_part(epoch)

    def directory(self, rank: int, world_size: int) -> str:
        return self.prefixes[rank % len(self.prefixes)] + self._epoch

    def __repr__(self) -> str:
        return f"RoundRobinPrefixStrategy({self.prefixes!r}, epoch={self.epoch})"


def resolve_prefix_strategy(value: PrefixStrategy | str | None) -> PrefixStrategy | None:
    """``None``, a strategy object, or the name of one registered under ``dcp_storage.strategies`` (a class or
    factory is called with no arguments); anything else is refused with ``TypeError``."""
    if value is None:
        return None
    return registry.instance(
        "strategies",
        value,
        lambda found: isinstance(found, PrefixStrategy),
        "prefix_strategy must have a directory(rank, world_size) method",
    )


def rank_directory(strategy: PrefixStrategy | None, rank: int, world_size: int) -> str:
    """The strategy's directory for ``rank``, checked to stay inside the checkpoint (``""`` without one)."""
    if strategy is None:
        return ""
    directory = strategy.directory(rank, world_size)
    if directory == "":
        return ""
    return check_relative(directory, f"prefix strategy {strategy!r} for rank {rank}").rstrip("/")
