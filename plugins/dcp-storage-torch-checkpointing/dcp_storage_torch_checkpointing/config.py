"""``DcpStorageConfig``: the ``StorageConfig`` a torch_checkpointing ``CheckpointManager`` is given.

It is a plain dataclass of a URL and options, so it pickles into torch_checkpointing's checkpoint
subprocess, which calls :meth:`DcpStorageConfig.create_storage` there (the storage opens its transport on
first use, in the process that uses it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dcp_storage.plugin_api import TargetError, TransportConfig
from torch_checkpointing.storage.base_storage import StorageConfig

from dcp_storage_torch_checkpointing.storage import DcpStorage

__all__ = ["DcpStorageConfig"]


@dataclass
class DcpStorageConfig(StorageConfig):
    """Where torch_checkpointing's checkpoints go: any URL dcp-storage opens, and the options to reach it.

    ``root_url``: a local path, ``file://``, ``s3://bucket/prefix``, ``gs://...``, ``az://...``, ``memory://...``
    or a plugin transport's URL. The paths torch_checkpointing passes (``mgr.save("step-1", ...)``) resolve
    under it; a full URL (``"s3://bucket/run/step-1"``) is used as given.
    ``storage_options``: what dcp-storage's readers take (credentials, ``endpoint_url``, ``transport``...).
    ``transport_config``: dcp-storage's tuning knobs (workers, in-flight bytes, part size, retries).
    """

    root_url: str
    storage_options: dict[str, Any] | None = None
    transport_config: TransportConfig | None = field(default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.root_url, str) or not self.root_url.strip():
            raise TargetError(
                f"DcpStorageConfig(root_url={self.root_url!r}): give the URL or path checkpoints go under, "
                "e.g. 's3://bucket/run-1' or '/checkpoints/run-1'"
            )
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise TargetError(
                f"DcpStorageConfig(storage_options={type(self.storage_options).__name__}): give a dict of "
                "options (credentials, endpoint) or None"
            )

    def create_storage(self) -> DcpStorage:
        return DcpStorage(self)
