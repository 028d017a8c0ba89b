"""Whether a decoded DCP record is the chunk the metadata says it is.

torch's ``FileSystemWriter`` saves each chunk as one record holding exactly that chunk, so the record's
shape is the chunk's ``sizes`` and its dtype the tensor's. A record that disagrees (a ``.metadata`` edited
or mixed with another save's records) would otherwise be narrowed to the slice asked for and loaded as
if nothing were wrong: torch's reader does so. The safetensors layouts check the same agreement when they
build the metadata (``formats/safetensors/metadata.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.dcp_native.lazy_metadata import StateDictView

__all__ = ["check_record_matches", "saved_chunk", "stored_dtype"]


def stored_dtype(metadata: Metadata | None, fqn: str) -> torch.dtype | None:
    """The dtype the metadata gives tensor ``fqn``; ``None`` when it has no such tensor (or no metadata)."""
    if metadata is None:
        return None
    state = metadata.state_dict_metadata
    if isinstance(state, StateDictView):  # without building the entry
        return state.tensor_dtype(fqn)
    md = state.get(fqn)
    dtype = getattr(getattr(md, "properties", None), "dtype", None) if isinstance(md, TensorStorageMetadata) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def saved_chunk(metadata: Metadata | None, index: Any) -> ChunkStorageMetadata | None:
    """The chunk of the metadata that ``index`` (a ``MetadataIndex``) names; ``None`` when it names none."""
    if metadata is None:
        return None
    if isinstance(metadata.state_dict_metadata, StateDictView):  # one chunk built, not the whole entry
        return metadata.state_dict_metadata.chunk(index.fqn, index.offset)
    md = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return None
    offsets, hint, chunks = tuple(index.offset or ()), index.index, md.chunks
    if hint is not None and 0 <= hint < len(chunks) and tuple(chunks[hint].offsets) == offsets:
        return chunks[hint]
    return next((c for c in chunks if tuple(c.offsets) == offsets), None)


def check_record_matches(
    metadata: Metadata | None, index: Any, shape: tuple[int, ...], dtype: torch.dtype, where: str
) -> None:
    """Raise :class:`CorruptCheckpointError` unless the record at ``where`` holds the chunk ``index`` names."""
    chunk = saved_chunk(metadata, index)
    if chunk is None:
        return  # no metadata to compare with (the planner already refused unknown keys)
    want_dtype = stored_dtype(metadata, index.fqn)
    if tuple(shape) != tuple(chunk.sizes) or dtype != want_dtype:
        raise CorruptCheckpointError(
            f"{where}: the record holds {dtype} {list(shape)} but .metadata says chunk "
            f"{list(chunk.offsets)} of {index.fqn!r} is {want_dtype} {list(chunk.sizes)}; the metadata and the "
            "data files do not belong together (re-save the checkpoint, or restore its original .metadata)"
        )
