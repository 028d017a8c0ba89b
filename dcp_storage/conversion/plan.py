"""What a conversion writes: output entries, where they go, and the knobs every writer shares.

Pure data plus small helpers; no tensor bytes move here. The engine (:mod:`.engine`) turns a
:class:`~.source.TensorSource` into :class:`OutTensor`/:class:`OutValue` entries (renamed, cast), and a
writer (:mod:`.dcp_out`, :mod:`.safetensors_out`, :mod:`.torch_out`) streams them to a
:class:`Destination`, asking a :class:`Fetch` for each tensor just before it writes it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..transports import Transport
from ..transports.buckets import require_bucket
from ..transports.factory import open_transport
from .memory import MemoryReleaser

__all__ = [
    "Destination",
    "Fetch",
    "OutTensor",
    "OutValue",
    "WrittenFile",
    "parse_dtype",
]

Path = tuple[Any, ...]


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: its output key and nested path, the source key, and its output dtype/shape."""

    key: str
    path: Path
    src: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    order: int = 0  # position in the source's metadata (outputs that mix tensors and values keep it)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class OutValue:
    """One output non-tensor value (step counters, extra state)."""

    key: str
    path: Path
    src: str
    order: int = 0


@dataclass(frozen=True)
class WrittenFile:
    name: str  # relative to the destination directory (the file name for a single-file destination)
    size: int


class Fetch(Protocol):
    """What a writer asks for while it streams (implemented by the engine)."""

    def tensor(self, out: OutTensor) -> torch.Tensor: ...

    def value_bytes(self, out: OutValue) -> bytes: ...

    def value(self, out: OutValue) -> Any: ...


@dataclass
class Destination:
    """Where output goes: a transport and a path on it (a directory, or a file for single-file outputs)."""

    url: str
    transport: Transport
    path: str
    overwrite: bool = False
    progress: Callable[[int], None] | None = None
    written: list[WrittenFile] = field(default_factory=list)
    releaser: MemoryReleaser = field(default_factory=MemoryReleaser)

    @classmethod
    def of(
        cls,
        url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None,
        overwrite: bool,
        create_bucket: bool = False,
    ) -> Destination:
        """Open the output location; its bucket must exist (or is created with ``create_bucket``)."""
        url = os.fspath(url)
        transport, path = open_transport(url, storage_options)
        try:
            require_bucket(transport, path, create=create_bucket)
        except BaseException:
            transport.close()
            raise
        return cls(url, transport, path.rstrip("/") if path not in ("/", "") else path, overwrite)

    def join(self, name: str) -> str:
        return self.transport.join(self.path, name)

    def parent_and_name(self) -> tuple[str, str]:
        if self.transport.is_local:
            return os.path.dirname(self.path) or ".", os.path.basename(self.path)
        head, _, tail = self.path.rpartition("/")
        return head, tail

    def record(self, name: str, size: int) -> None:
        self.written.append(WrittenFile(name, size))

    def advance(self, nbytes: int) -> None:
        """A tensor of ``nbytes`` was written and dropped: report progress, give its memory back."""
        self.releaser.freed(nbytes)
        if self.progress is not None and nbytes:
            self.progress(nbytes)

    def url_of(self, path: str) -> str:
        return self.transport.url(path)


_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "f64": torch.float64,
    "double": torch.float64,
    "float64": torch.float64,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _DTYPE_NAMES[_name] = getattr(torch, _name)


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``, ``"fp16"``, ``"fp32"``, ``"torch.bfloat16"``... or a ``torch.dtype`` (floating point only)."""
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    else:
        text = str(value).strip().lower().removeprefix("torch.")
        dtype = _DTYPE_NAMES.get(text)
        if dtype is None:
            raise ValueError(f"unknown dtype {value!r}; use one of {', '.join(sorted(_DTYPE_NAMES))}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is not a floating-point dtype; only floating-point tensors are cast")
    return dtype
