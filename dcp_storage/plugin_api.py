"""What a plugin may import from dcp-storage: this module, and nothing else.

Plugins (``plugins/*``, the ``dcp-storage plugin new`` template, third-party packages) import from here
only, so that the core can move its modules without breaking them; ``tests/registry/test_plugin_imports.py``
checks the in-tree ones. Everything here is kept stable:

* transports: :class:`BaseTransport`, the base a transport for a new store subclasses: it implements six
  store primitives (``read_into``, ``object_size``, ``list_names``, ``put``, ``put_if_absent``, ``delete``) and
  gets the rest; the :class:`Transport` protocol it keeps (and the optional :class:`LocalFileAccess` and
  :class:`LocalRunReads` of a local-disk transport), :func:`open_transport` to build on another transport,
  and the building blocks the built-in transports are made of, so a transport for another store does not
  rewrite them:

  - :func:`plan_fetches` (-> :class:`FetchGroup` s): coalesce :class:`RangeRequest` s closer than
    ``config.coalesce_gap``, split ones over ``config.max_request_bytes``: one store request per group;
  - :class:`RangeRun`: run the groups on an executor within ``config.max_inflight_bytes``, fill each
    request's buffer, call ``on_piece`` and ``on_complete``, raise the first failure once no fetch runs
    (``read_ranges`` returns its ``execute()``);
  - :func:`call_with_retry`, :class:`RetryPolicy`, :func:`is_transient`: retry one request under
    ``config.retry`` (backoff, jitter, deadline), and what counts as transient;
  - :class:`TruncatedReadError`, :class:`RangeMismatchError`, :func:`range_mismatch`: a short body
    (retried, resumed from the first missing byte) and an answer that is not the range asked for
    (check status and ``Content-Range``);
  - :class:`WorkerPool`: the transport's threads (``executor()``), made on first use, dropped when pickled;
  - :class:`ScatterSink`: copy a streamed body into a group's destination views as it arrives (no
    whole-range buffer), resumable after a cut-off body;
  - :class:`TransportCounters`, :class:`TransportConfig`, :func:`resolve_config`: the counters every
    transport keeps, and the knobs with their ``None`` fields filled for a local or a remote store;
  - :func:`holds`: ``create_new``'s check that an "exists" answer is its own write whose response was lost;
  - :class:`LocalRuns`, :class:`RunsRead`: the local strided-copy fast path over ``local_files()``.

* formats and extensions: :class:`FormatSpec`, :class:`Probe`, torch's :class:`StreamTransformExtension`
  (the base class of a stream extension: a private torch name, so a plugin takes it from here), and the
  seekable-transform pieces a compressing extension needs, and :class:`DcpLoaderConfig` (the reader's ranged-read threshold its tests tune);
* a format's reader, for free: a format whose tensors are raw elements at known byte offsets writes a
  :data:`Scan` (its headers -> one :class:`RawTensor` per tensor: key, file, offset, dtype, shape, byte
  order) and returns :class:`RawTensorReader` ``(url, scan, storage_options)`` from its ``open_reader``: ranged,
  coalesced reads of exactly the slices each rank needs, every read strategy, metadata read once per load;
  for zip-based formats, :func:`read_zip_index` (-> :class:`ZipIndex`, raising :class:`NotAZipError`) and
  :func:`data_starts` read a zip's directory and its members' data offsets with a few ranged reads, refusing
  overlapping or inconsistent entries;
* a format's tool hooks: the reports ``describe``/``check`` fill in (:class:`CheckpointInfo` and its rows,
  :class:`VerifyReport`, :func:`tensor_table`) and what a ``convert`` target writes (:class:`ConvertTarget`,
  :class:`WriteOptions`, :class:`WriteDestination`, :class:`OutTensor`, :class:`OutValue`, :class:`Fetch`);
* readers: :func:`share_object` (run a function on the coordinator, give its result or its error to every
  rank: how a reader shares what it read in ``read_metadata``); :func:`as_torch_future` (``read_data`` returns
  a ``torch.futures.Future``: this turns an executor's ``concurrent.futures.Future`` into one);
* errors: the whole hierarchy (:class:`DcpStorageError` and its subclasses);
* the registry: :mod:`registry` and its ``register``/``registered``/``get`` helpers.

Names that import torch (the format and extension ones) are loaded on first use (PEP 562), so a transport
plugin importing this module stays cheap to load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcp_storage import registry
from dcp_storage.errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DcpStorageError,
    FileTooLargeError,
    IncompleteCheckpointError,
    NonTensorStateError,
    ObjectChangedError,
    ShapeMismatchError,
    StorageAccessError,
    TargetError,
    TransportError,
    UnknownExtensionError,
    UnknownFormatError,
    UnsafeCheckpointError,
    UnsupportedDtypeError,
    UnsupportedKeyError,
    WrongFormatError,
    WrongPathTypeError,
)
from dcp_storage.registry import (
    PluginError,
    PluginImportError,
    PluginNotFoundError,
    get,
    register,
    registered,
)
from dcp_storage.registry import lazy_exports as _lazy_exports
from dcp_storage.runtime import FutureTypeError, as_torch_future
from dcp_storage.transports import (
    AtomicWriter,
    LocalFileAccess,
    LocalRunReads,
    RangeRequest,
    RetryPolicy,
    RunsRead,
    Transport,
    TransportConfig,
    TransportCounters,
    is_transient,
    open_transport,
)
from dcp_storage.transports.base import BaseTransport, holds
from dcp_storage.transports.guards import RangeMismatchError, VersionPins, range_mismatch
from dcp_storage.transports.protocol import WorkerPool, resolve_config
from dcp_storage.transports.ranges import FetchGroup, LocalRuns, RangeRun, plan_fetches
from dcp_storage.transports.retry import TruncatedReadError, call_with_retry
from dcp_storage.transports.s3_stream import ScatterSink

_LAZY = {
    "FormatSpec": "dcp_storage.formats.spec",
    "Probe": "dcp_storage.formats.spec",
    "Frame": "dcp_storage.formats.dcp_native.records",
    "FrameIndex": "dcp_storage.formats.dcp_native.records",
    "NeedMoreTail": "dcp_storage.formats.dcp_native.records",
    "SeekableTransform": "dcp_storage.formats.dcp_native.records",
    "StreamTransformExtension": "dcp_storage._torch",
    "DcpLoaderConfig": "dcp_storage.formats.dcp_native.item_loader",
    "share_object": "dcp_storage.strategies.collectives",
    **dict.fromkeys(("RawTensor", "RawTensorReader", "Scan"), "dcp_storage.formats.raw_reader"),
    "detect_format": "dcp_storage.opening",  # which registered format a URL holds (a format plugin's tests)
    **dict.fromkeys(
        ("NotAZipError", "ZipIndex", "data_starts", "read_zip_index"),
        "dcp_storage.formats.torch_save.zip_index",
    ),
    **dict.fromkeys(
        ("CheckpointInfo", "ChunkInfo", "FileInfo", "TensorInfo", "ValueInfo", "VerifyReport", "tensor_table"),
        "dcp_storage.formats.reports",
    ),
    **dict.fromkeys(
        ("ConvertTarget", "Fetch", "OutTensor", "OutValue", "WriteDestination", "WriteOptions"),
        "dcp_storage.formats.spec",
    ),
}


__getattr__, __dir__ = _lazy_exports(__name__, _LAZY)


if TYPE_CHECKING:
    from dcp_storage._torch import StreamTransformExtension
    from dcp_storage.formats.dcp_native.item_loader import DcpLoaderConfig
    from dcp_storage.formats.dcp_native.records import Frame, FrameIndex, NeedMoreTail, SeekableTransform
    from dcp_storage.formats.raw_reader import RawTensor, RawTensorReader, Scan
    from dcp_storage.formats.reports import (
        CheckpointInfo,
        ChunkInfo,
        FileInfo,
        TensorInfo,
        ValueInfo,
        VerifyReport,
        tensor_table,
    )
    from dcp_storage.formats.spec import (
        ConvertTarget,
        Fetch,
        FormatSpec,
        OutTensor,
        OutValue,
        Probe,
        WriteDestination,
        WriteOptions,
    )
    from dcp_storage.formats.torch_save.zip_index import NotAZipError, ZipIndex, data_starts, read_zip_index
    from dcp_storage.opening import detect_format
    from dcp_storage.strategies.collectives import share_object

__all__ = [
    "detect_format",
    "AtomicWriter",
    "BaseTransport",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "ChunkInfo",
    "ConvertTarget",
    "CorruptCheckpointError",
    "DcpLoaderConfig",
    "DcpStorageError",
    "Fetch",
    "FetchGroup",
    "FileInfo",
    "FileTooLargeError",
    "FormatSpec",
    "Frame",
    "FrameIndex",
    "FutureTypeError",
    "IncompleteCheckpointError",
    "LocalFileAccess",
    "LocalRunReads",
    "LocalRuns",
    "NeedMoreTail",
    "NotAZipError",
    "NonTensorStateError",
    "OutTensor",
    "OutValue",
    "PluginError",
    "PluginImportError",
    "PluginNotFoundError",
    "Probe",
    "RangeMismatchError",
    "RangeRequest",
    "RangeRun",
    "RawTensor",
    "RawTensorReader",
    "RetryPolicy",
    "RunsRead",
    "Scan",
    "ObjectChangedError",
    "ScatterSink",
    "SeekableTransform",
    "ShapeMismatchError",
    "StorageAccessError",
    "StreamTransformExtension",
    "TargetError",
    "TensorInfo",
    "Transport",
    "TransportConfig",
    "TransportCounters",
    "TransportError",
    "TruncatedReadError",
    "UnknownExtensionError",
    "UnknownFormatError",
    "UnsafeCheckpointError",
    "UnsupportedDtypeError",
    "UnsupportedKeyError",
    "ValueInfo",
    "VerifyReport",
    "VersionPins",
    "WorkerPool",
    "WriteDestination",
    "WriteOptions",
    "WrongFormatError",
    "WrongPathTypeError",
    "ZipIndex",
    "as_torch_future",
    "call_with_retry",
    "data_starts",
    "get",
    "holds",
    "is_transient",
    "open_transport",
    "plan_fetches",
    "range_mismatch",
    "read_zip_index",
    "register",
    "registered",
    "registry",
    "resolve_config",
    "share_object",
    "tensor_table",
]
