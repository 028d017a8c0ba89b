"""Format registration for DCP's native layout (``.metadata`` + ``.distcp`` torch.save records)."""

from __future__ import annotations

from typing import Any

from ..spec import FormatSpec, Probe
from .metadata_io import METADATA_FILE

__all__ = ["FORMAT"]


def _sniff(probe: Probe) -> int | None:
    if not probe.is_dir or METADATA_FILE not in probe.names:
        return None
    data_files = [n for n in probe.names if n.endswith(".distcp")]
    if data_files and not probe.head_of(data_files[0], 4).startswith(b"PK"):
        return None  # .distcp files that are not torch.save records: DCP's safetensors serialization
    return 100


def _reader(url: str, storage_options: dict[str, Any] | None = None, **options: Any) -> Any:
    from ...storage import FsspecReader

    return FsspecReader(url, storage_options, **options)


def _writer(url: str, storage_options: dict[str, Any] | None = None, **options: Any) -> Any:
    from ...storage import FsspecWriter

    return FsspecWriter(url, storage_options, **options)


FORMAT = FormatSpec(
    name="dcp",
    version="1",
    sniff=_sniff,
    open_reader=_reader,
    open_writer=_writer,
    description="torch.distributed.checkpoint native layout: .metadata + __R_N.distcp",
)
