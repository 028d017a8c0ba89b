"""Format registration for DCP's native layout (``.metadata`` + ``.distcp`` torch.save records)."""

from __future__ import annotations

from typing import Any

from ..spec import FormatSpec, Probe, trust_byte_items
from .convert_out import TARGET
from .describe import describe_dcp
from .sniff import NATIVE, dcp_data_kind
from .verify import check_dcp, deep_check_dcp

__all__ = ["FORMAT"]


def _sniff(probe: Probe) -> int | None:
    # .distcp files that are not torch.save records: DCP's safetensors serialization (see .sniff)
    return 100 if dcp_data_kind(probe) == NATIVE else None


def _reader(url: str, storage_options: dict[str, Any] | None = None, **options: Any) -> Any:
    from ...storage import FsspecReader
    from .item_loader import ItemLoaderConfig

    trust_byte_items(options, ItemLoaderConfig)
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
    reader="dcp_storage.FsspecReader(url)",
    describe=describe_dcp,
    check=check_dcp,
    deep_check=deep_check_dcp,
    convert_target=TARGET,
)
