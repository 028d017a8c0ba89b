"""Format registration for safetensors: single files, directories, HF indexes, torch's DCP layouts."""

from __future__ import annotations

from dcp_storage.formats.dcp_native.sniff import SAFETENSORS, dcp_data_kind
from dcp_storage.formats.paths import INDEX_SUFFIX, METADATA_FILE, SAFETENSORS_SUFFIX
from dcp_storage.formats.safetensors.convert_out import TARGET
from dcp_storage.formats.safetensors.describe import describe_safetensors
from dcp_storage.formats.safetensors.layout import looks_like_safetensors
from dcp_storage.formats.safetensors.verify import check_safetensors, deep_check_safetensors
from dcp_storage.formats.spec import HEAD_BYTES, FormatSpec, Probe

__all__ = ["FORMAT"]

_UNKNOWN_SIZE = 1 << 62  # a directory probe reads heads only; the reader checks real sizes


def _sniff(probe: Probe) -> int | None:
    if not probe.is_dir:
        if probe.basename.endswith(INDEX_SUFFIX) and probe.head.lstrip().startswith(b"{"):
            return 100
        return 100 if looks_like_safetensors(probe.head, probe.size) else None
    names = set(probe.names)
    if any(n.endswith(INDEX_SUFFIX) for n in names):
        return 90
    tensors = sorted(n for n in names if n.endswith(SAFETENSORS_SUFFIX))
    if tensors:
        return 80 if looks_like_safetensors(probe.head_of(tensors[0], HEAD_BYTES), _UNKNOWN_SIZE) else None
    if METADATA_FILE in names:  # FileSystemWriter(serialization_format=SAFETENSORS): .distcp files are safetensors
        return 100 if dcp_data_kind(probe) == SAFETENSORS else None
    return None


FORMAT = FormatSpec(
    name="safetensors",
    version="1",
    sniff=_sniff,
    description="safetensors: a file, a directory, an HF model.safetensors.index.json, torch's DCP layouts",
    reader="dcp_storage.SafetensorsReader(url)",
    describe=describe_safetensors,
    check=check_safetensors,
    deep_check=deep_check_safetensors,
    convert_target=TARGET,
    suffixes=(SAFETENSORS_SUFFIX, INDEX_SUFFIX),
)
