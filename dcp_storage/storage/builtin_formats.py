"""The built-in formats as the ``dcp_storage.formats`` entry points register them.

Each format's own half (name, version, sniffer, description) lives in ``formats/<name>/spec.py``; its
reader and writer are storage classes, a layer above the formats, so they are bound here and the formats
never import the storage layer. Third-party formats pass their factories to ``FormatSpec`` directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dcp_storage.formats.dcp_native.item_loader import DcpLoaderConfig
from dcp_storage.formats.dcp_native.spec import FORMAT as DCP_FORMAT
from dcp_storage.formats.safetensors.loader import SafetensorsLoaderConfig
from dcp_storage.formats.safetensors.spec import FORMAT as SAFETENSORS_FORMAT
from dcp_storage.formats.spec import trust_byte_items
from dcp_storage.formats.torch_save.spec import FORMAT as TORCH_SAVE_FORMAT
from dcp_storage.storage.fsspec_reader import FsspecReader
from dcp_storage.storage.fsspec_writer import FsspecWriter
from dcp_storage.storage.safetensors_reader import SafetensorsReader
from dcp_storage.storage.safetensors_writer import SafetensorsWriter
from dcp_storage.storage.torch_save_reader import BroadcastingTorchSaveReader

__all__ = ["DCP", "SAFETENSORS", "TORCH_SAVE"]


def _dcp_reader(path: str, storage_options: dict[str, Any] | None = None, **options: Any) -> FsspecReader:
    trust_byte_items(options, DcpLoaderConfig)
    return FsspecReader(path, storage_options, **options)


def _dcp_writer(path: str, storage_options: dict[str, Any] | None = None, **options: Any) -> FsspecWriter:
    return FsspecWriter(path, storage_options, **options)


def _safetensors_reader(path: str, storage_options: dict[str, Any] | None = None, **options: Any) -> SafetensorsReader:
    trust_byte_items(options, SafetensorsLoaderConfig)
    return SafetensorsReader(path, storage_options, **options)


def _safetensors_writer(path: str, storage_options: dict[str, Any] | None = None, **options: Any) -> SafetensorsWriter:
    return SafetensorsWriter(path, storage_options, **options)


def _torch_save_reader(
    path: str, storage_options: dict[str, Any] | None = None, **options: Any
) -> BroadcastingTorchSaveReader:
    return BroadcastingTorchSaveReader(path, storage_options=storage_options, **options)


DCP = dataclasses.replace(DCP_FORMAT, open_reader=_dcp_reader, open_writer=_dcp_writer)
SAFETENSORS = dataclasses.replace(SAFETENSORS_FORMAT, open_reader=_safetensors_reader, open_writer=_safetensors_writer)
TORCH_SAVE = dataclasses.replace(TORCH_SAVE_FORMAT, open_reader=_torch_save_reader)
