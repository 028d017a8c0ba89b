"""A test format plugin: NumPy ``.npz`` archives, registered through an entry point as a third party would.

It exists to prove that a plugin format gets every tool the built-in formats get - ``open_reader``/
``dcp.load``, ``inspect`` (its ``describe`` hook), ``verify`` and ``verify --deep`` (``check``,
``deep_check``), ``convert`` from it and to it (``convert_target``) - through the API and the CLI. Its
reader is dcp-storage's :class:`~dcp_storage.plugin_api.RawTensorReader` over the format's scan (``archive``):
every rank reads only the bytes of its slices, under any read strategy. It imports dcp-storage through
``dcp_storage.plugin_api`` only. ``tests/formats/npz_plugin/site`` holds it
with its ``.dist-info`` (entry point ``dcp_storage.formats: npz``); tests put that folder on the path.
"""

from __future__ import annotations

from dcp_storage.plugin_api import FormatSpec, Probe

from .hooks import check_npz, deep_check_npz, describe_npz
from .reader import open_npz
from .writer import TARGET

__all__ = ["FORMAT"]

_ZIP = b"PK\x03\x04"


def _sniff(probe: Probe) -> int | None:
    # torch.save files are zips too, but their first member is <archive>/data.pkl; ours end in .npy
    if probe.is_dir or not probe.head.startswith(_ZIP) or len(probe.head) < 30:
        return None
    name_len = int.from_bytes(probe.head[26:28], "little")
    first = probe.head[30 : 30 + name_len]
    return 100 if first.endswith(b".npy") or (probe.basename.endswith(".npz") and b"data.pkl" not in first) else None


FORMAT = FormatSpec(
    name="npz",
    version="1",
    sniff=_sniff,
    open_reader=open_npz,
    description="NumPy .npz archives (numpy.savez), read by byte range: no pickle, no compressed members",
    describe=describe_npz,
    check=check_npz,
    deep_check=deep_check_npz,
    convert_target=TARGET,
    suffixes=(".npz",),
)
