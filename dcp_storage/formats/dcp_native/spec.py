"""Format registration for DCP's native layout (``.metadata`` + ``.distcp`` torch.save records)."""

from __future__ import annotations

from dcp_storage.formats.dcp_native.convert_out import TARGET
from dcp_storage.formats.dcp_native.describe import describe_dcp
from dcp_storage.formats.dcp_native.sniff import NATIVE, dcp_data_kind
from dcp_storage.formats.dcp_native.verify import check_dcp, deep_check_dcp
from dcp_storage.formats.spec import FormatSpec, Probe

__all__ = ["FORMAT"]


def _sniff(probe: Probe) -> int | None:
    # .distcp files that are not torch.save records: DCP's safetensors serialization (see .sniff)
    return 100 if dcp_data_kind(probe) == NATIVE else None


FORMAT = FormatSpec(
    name="dcp",
    version="1",
    sniff=_sniff,
    description="torch.distributed.checkpoint native layout: .metadata + __R_N.distcp",
    reader="dcp_storage.FsspecReader(url)",
    describe=describe_dcp,
    check=check_dcp,
    deep_check=deep_check_dcp,
    convert_target=TARGET,
)
