"""dcp-storage-zstd: seekable zstandard compression of ``torch.distributed.checkpoint`` items.

``ZstdSeekable`` is a torch ``StreamTransformExtension`` (use it with dcp-storage's ``FsspecWriter`` or
torch's ``FileSystemWriter``) whose output is the zstd seekable format, so dcp-storage's reader fetches and
decodes only the frames a rank needs. Registered under the ``dcp_storage.extensions`` entry-point group.
"""

from __future__ import annotations

from dcp_storage_zstd.extension import DESCRIPTOR_VERSION, REGISTRY_NAME, ZstdSeekable
from dcp_storage_zstd.seek_table import SeekTableError

__all__ = ["DESCRIPTOR_VERSION", "REGISTRY_NAME", "SeekTableError", "ZstdSeekable"]
__version__ = "0.1.0"
