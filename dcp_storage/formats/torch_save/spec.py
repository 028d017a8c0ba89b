"""Format registration for single ``torch.save`` files (``pytorch_model.bin``, ``model.pt``).

Read-only: loads go through :class:`~dcp_storage.BroadcastingTorchSaveReader` and need a planner that
builds metadata from the state dict (``dcp_storage.DynamicMetaLoadPlanner``), as torch's reader does.
"""

from __future__ import annotations

import struct

from dcp_storage.formats.spec import FormatSpec, Probe
from dcp_storage.formats.torch_save.convert_out import TARGET
from dcp_storage.formats.torch_save.describe import describe_torch_save
from dcp_storage.formats.torch_save.verify import check_torch_save, deep_check_torch_save

__all__ = ["FORMAT", "looks_like_legacy_torch_pickle", "looks_like_torch_zip"]

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER, the first object of a legacy file


def looks_like_torch_zip(head: bytes) -> bool:
    """A zip whose first entry is ``<archive>/data.pkl``: what ``torch.save`` writes since torch 1.6."""
    if len(head) < 30 or not head.startswith(b"PK\x03\x04"):
        return False
    (name_len,) = struct.unpack_from("<H", head, 26)
    name = head[30 : 30 + name_len]
    return name.endswith(b"data.pkl") or len(name) < name_len  # name cut off by the short head: still plausible


def looks_like_legacy_torch_pickle(head: bytes) -> bool:
    """A pre-1.6 ``torch.save`` file: a pickle whose first object is torch's magic number."""
    return head.startswith(b"\x80\x02\x8a\x0a") and int.from_bytes(head[4:14], "little") == _LEGACY_MAGIC


def _sniff(probe: Probe) -> int | None:
    if probe.is_dir:
        return None
    if looks_like_torch_zip(probe.head):
        return 100
    if looks_like_legacy_torch_pickle(probe.head):
        return 50  # recognised so the reader can refuse it with a clear message
    return None


FORMAT = FormatSpec(
    name="torch_save",
    version="1",
    sniff=_sniff,
    description="a single torch.save file (zip format); legacy pickles are recognised and refused",
    reader="dcp_storage.BroadcastingTorchSaveReader(url)",
    describe=describe_torch_save,
    check=check_torch_save,
    deep_check=deep_check_torch_save,
    convert_target=TARGET,
    suffixes=(".pt", ".pth", ".bin", ".ckpt"),
)
