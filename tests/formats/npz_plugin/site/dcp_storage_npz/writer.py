"""The ``npz`` format as a ``convert`` target: one ``.npz`` written member by member, one tensor in memory.

``numpy.savez`` needs every array at once; here each tensor is fetched just before its member is written
(``numpy.lib.format.write_array`` into ``ZipFile.open(name, "w")``), and the file is committed atomically
through the transport. A destination named ``*.npz`` is that file; any other is a directory holding
``arrays.npz``. What ``.npz`` cannot hold is refused before anything is read: dtypes numpy lacks
(``bfloat16``, ``float8``), and non-tensor values unless they are dropped.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence

import numpy as np
import torch

from dcp_storage.plugin_api import (
    CheckpointExistsError,
    ConvertTarget,
    Fetch,
    NonTensorStateError,
    OutTensor,
    OutValue,
    UnsupportedDtypeError,
    UnsupportedKeyError,
    WriteDestination,
    WriteOptions,
)

__all__ = ["DIRECTORY_FILE", "TARGET"]

DIRECTORY_FILE = "arrays.npz"


def _numpy_can_hold(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True


def refuse(tensors: Sequence[OutTensor], values: Sequence[OutValue], options: WriteOptions) -> None:
    bad = {t.key: t.dtype for t in tensors if not _numpy_can_hold(t.dtype)}
    if bad:
        raise UnsupportedDtypeError(bad, format_name="npz")
    unnamed = [t.key for t in tensors if not t.key or "\x00" in t.key]
    if unnamed:
        raise UnsupportedKeyError(unnamed, format_name="npz", why="a zip member name must be non-empty text")
    if values and not options.drop_non_tensors:
        raise NonTensorStateError(
            [v.key for v in values], format_name="npz", fix="pass drop_non_tensors=True (--drop-non-tensors)"
        )


def write_npz(
    dest: WriteDestination,
    tensors: Sequence[OutTensor],
    values: Sequence[OutValue],
    fetch: Fetch,
    options: WriteOptions,
) -> tuple[str, list[str]]:
    transport = dest.transport
    if options.single_file:
        root, name = dest.parent_and_name()
        path = dest.path
    else:
        root, name = dest.path, DIRECTORY_FILE
        path = dest.join(name)
    if transport.exists(path) and not dest.overwrite:
        raise CheckpointExistsError(f"{dest.url_of(path)}: already exists; pass overwrite=True (--overwrite)")
    transport.makedirs(root)
    with transport.open_atomic(path) as raw:
        with zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:  # type: ignore[arg-type]
            for out in tensors:
                tensor = fetch.tensor(out)
                with archive.open(out.key + ".npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, tensor.numpy(), allow_pickle=False)
                del tensor
                dest.advance(out.nbytes)
        size = raw.tell()
    dest.record(name, size)
    return path, [v.key for v in values]


TARGET = ConvertTarget("npz", write_npz, refuse=refuse)
