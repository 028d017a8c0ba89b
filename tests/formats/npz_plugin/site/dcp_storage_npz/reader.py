"""A DCP ``StorageReader`` for ``.npz`` files: ``dcp.load(sd, storage_reader=open_reader("x.npz"))``.

The format's whole reader is its scan (:func:`.archive.scan_npz`: where each array's elements lie);
:class:`~dcp_storage.plugin_api.RawTensorReader` does the rest: the metadata read once per load and shared,
the read strategies, and ranged, coalesced reads of exactly the bytes of each rank's slices (a ``Shard(0)``
slice of an array is one byte range of the file, not the whole member).
"""

from __future__ import annotations

import os
from typing import Any

from dcp_storage.plugin_api import RawTensorReader

from .archive import scan_npz

__all__ = ["open_npz"]


def open_npz(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, **options: Any
) -> RawTensorReader:
    """The format's ``open_reader``: options are :class:`~dcp_storage.plugin_api.RawTensorReader`'s."""
    options.pop("trust", None)  # convert(trust=True): nothing in an .npz is decoded by pickle anyway
    return RawTensorReader(url, scan_npz, storage_options, format_name="npz", **options)
