"""A torch_checkpointing ``Storage`` on dcp-storage's transports: ``CheckpointManager`` on any bucket.

::

    from torch_checkpointing import CheckpointManager
    from dcp_storage_torch_checkpointing import DcpStorageConfig

    mgr = CheckpointManager(CheckpointManager.Config(
        storage_config=DcpStorageConfig("s3://bucket/run-1", {"key": ..., "secret": ...}),
    ))
    mgr.save("step-100", {"model": model.state_dict()})   # -> s3://bucket/run-1/step-100

See ``README.md`` for what each ``Storage`` method does on an object store.
"""

from __future__ import annotations

from dcp_storage_torch_checkpointing.config import DcpStorageConfig
from dcp_storage_torch_checkpointing.storage import DcpStorage

__all__ = ["DcpStorage", "DcpStorageConfig"]
__version__ = "0.1.0"
