"""What a conversion writes: output entries, where they go, and the knobs every writer shares.

Pure data plus small helpers; no tensor bytes move here. The engine (:mod:`.engine`) turns a
:class:`~.source.TensorSource` into :class:`OutTensor`/:class:`OutValue` entries (renamed, cast), and the
target format's writer (its spec's ``convert_target``, :mod:`dcp_storage.formats.convert_target`) streams
them to a :class:`Destination`, asking a :class:`Fetch` for each tensor just before it writes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dcp_storage.conversion.memory import MemoryReleaser
from dcp_storage.formats.convert_target import Fetch, OutTensor, OutValue, WrittenFile
from dcp_storage.transports import Transport
from dcp_storage.transports.buckets import require_bucket
from dcp_storage.transports.factory import open_transport

__all__ = [
    "Destination",
    "Fetch",
    "OutTensor",
    "OutValue",
    "WrittenFile",
    "parse_dtype",
]


@dataclass
class Destination:
    """Where output goes: a transport and a path on it (a directory, or a file for single-file outputs).

    What a format's writer sees of it is :class:`~dcp_storage.formats.convert_target.WriteDestination`.
    """

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
