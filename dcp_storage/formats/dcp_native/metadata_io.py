"""Reading and writing DCP's ``.metadata`` file without trusting it.

torch writes ``.metadata`` with ``pickle.dump`` and reads it with ``pickle.load``. We write the same bytes
(so torch's reader loads our checkpoints) but read them with an allow-list: the DCP metadata classes,
``torch.Size``, dtypes, layouts, memory formats, enums (also pickled as ``getattr(enum, name)``) and plain
containers, and what the user registered with ``torch.serialization.add_safe_globals`` /
``safe_globals`` (:mod:`..safe_globals`). Anything else raises
:class:`~dcp_storage.errors.UnsafeCheckpointError` naming the file and the global.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from dcp_storage.formats.dcp_native.allow_list import metadata_allow_list
from dcp_storage.formats.dcp_native.column_checks import columns_sound
from dcp_storage.formats.dcp_native.columns import MetadataColumns, columns_from_metadata, metadata_from_columns
from dcp_storage.formats.dcp_native.lazy_metadata import lazy_metadata
from dcp_storage.formats.dcp_native.metadata_checks import check_metadata
from dcp_storage.formats.dcp_native.native_decode import (
    decode_columns,  # returns None where the C extension is not built
)
from dcp_storage.formats.limits import METADATA, count_setting, read_limited
from dcp_storage.formats.paths import METADATA_FILE
from dcp_storage.formats.safe_globals import with_registered_globals
from dcp_storage.gc_pause import gc_paused
from dcp_storage.safe_unpickle import safe_loads

__all__ = [
    "DCP_VERSION",
    "LAZY_MIN_ENTRIES",
    "METADATA_FILE",
    "dump_metadata",
    "load_metadata",
    "metadata_allow_list",
    "read_metadata_file",
]

DCP_VERSION = "1.0.0"  # the Metadata.version written: torch's FileSystemWriter's


_ALLOWED = metadata_allow_list()


# Entries from which a .metadata decoded as columns is served as views of them (lazy_metadata) rather than
# as torch's dicts of objects (about 2 KB a tensor); 0 serves every one as views (the test suite's switch).
LAZY_MIN_ENTRIES = 20_000
LAZY_MIN_ENTRIES_ENV = "DCP_STORAGE_LAZY_METADATA_ENTRIES"
# Which decoder gives columns: "native" (the C decoder, when built), "python" (the guarded unpickler, then
# columns_from_metadata: slower; for tests and machines without the native module), "off" (never columns).
DECODER_ENV = "DCP_STORAGE_METADATA_DECODER"
_DECODERS = ("native", "python", "off")


def lazy_min_entries() -> int:
    """:data:`LAZY_MIN_ENTRIES`, or the value of ``DCP_STORAGE_LAZY_METADATA_ENTRIES`` (read at each use)."""
    return count_setting(LAZY_MIN_ENTRIES_ENV, LAZY_MIN_ENTRIES, "entries")


def _decoder() -> str:
    raw = os.environ.get(DECODER_ENV, "").strip() or "native"
    if raw not in _DECODERS:
        raise ValueError(f"{DECODER_ENV}={raw!r} must be one of {', '.join(_DECODERS)}")
    return raw


def _served(cols: MetadataColumns) -> Metadata:
    return lazy_metadata(cols) if len(cols) >= lazy_min_entries() else metadata_from_columns(cols)


def load_metadata(data: bytes | bytearray | memoryview, path: str) -> Metadata:
    """Decode ``.metadata`` bytes read from ``path``; never runs code from them.

    The decoded object is checked too (:mod:`.metadata_checks`: dtypes, shapes, byte counts, chunk bounds,
    storage entries that stay inside the checkpoint), so every problem is reported here, naming ``path``.

    Fast path: the native decoder reads a canonical pickle straight into columns (:mod:`.columns`), checked
    on arrays (:mod:`.column_checks`); a sound one is served as views of its columns from
    ``DCP_STORAGE_LAZY_METADATA_ENTRIES`` entries (20,000), as a plain ``Metadata`` below. Anything else (no
    native module, a pickle outside its subset, columns the checks refuse) takes the general path, which
    names each problem.
    """
    decoder = _decoder()
    with gc_paused():  # millions of small acyclic objects at a million tensors (see gc_pause)
        if decoder == "native":
            cols = decode_columns(data)
            if cols is not None and columns_sound(cols, path):
                return _served(cols)
        metadata = safe_loads(data, path, with_registered_globals(_ALLOWED), expected=Metadata)
        if decoder == "python":
            cols = columns_from_metadata(metadata)
            if cols is not None and columns_sound(cols, path):
                return _served(cols)
        return check_metadata(metadata, path)


def read_metadata_file(transport: Any, path: str) -> Metadata:
    """Read (at most :data:`~dcp_storage.formats.limits.METADATA` bytes) and decode the ``.metadata`` at ``path``."""
    return load_metadata(read_limited(transport, path, METADATA), transport.url(path))


def dump_metadata(metadata: Metadata) -> bytes:
    """Encode ``metadata`` exactly as torch's ``FileSystemWriter`` does (``pickle.dump``)."""
    return pickle.dumps(metadata)
