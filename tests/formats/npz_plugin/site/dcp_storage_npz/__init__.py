"""A test format plugin: NumPy ``.npz`` archives, registered through an entry point as a third party would.

It exists to prove that a plugin format gets every tool the built-in formats get - ``open_reader``/
``dcp.load``, ``inspect`` (its ``describe`` hook), ``verify`` and ``verify --deep`` (``check``,
``deep_check``), ``convert`` from it and to it (``convert_target``) - through the API and the CLI. It
imports dcp-storage through ``dcp_storage.plugin_api`` only. ``tests/formats/npz_plugin/site`` holds it
with its ``.dist-info`` (entry point ``dcp_storage.formats: npz``); tests put that folder on the path.
"""

from __future__ import annotations

from typing import Any

from dcp_storage.plugin_api import FormatSpec, Probe

from .hooks import check_npz, deep_check_npz, describe_npz
from .reader import NpzReader
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


def _reader(url: str, storage_options: dict[str, Any] | None = None, **options: Any) -> Any:
    options.pop("trust", None)  # convert(trust=True): nothing in an .npz is decoded by pickle anyway
    return NpzReader(url, storage_options, **options)


FORMAT = FormatSpec(
    name="npz",
    version="1",
    sniff=_sniff,
    open_reader=_reader,
    description="NumPy .npz archives (numpy.savez), read with numpy.load(allow_pickle=False)",
    describe=describe_npz,
    check=check_npz,
    deep_check=deep_check_npz,
    convert_target=TARGET,
    suffixes=(".npz",),
)
