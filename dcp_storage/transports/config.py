"""The tuning knobs every transport takes: :class:`TransportConfig`.

Kept apart from any one transport so that the :class:`~dcp_storage.transports.protocol.Transport` protocol,
plugins and the core name it without importing the fsspec transport.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from dcp_storage.transports.retry import RetryPolicy

__all__ = ["TransportConfig", "resolve_config"]

MiB = 1024 * 1024


@dataclass(frozen=True)
class TransportConfig:
    """Tuning knobs; the defaults suit a local disk and an object store alike.

    ``max_workers``: concurrent storage requests. ``max_inflight_bytes``: bytes of requests running at
    once. ``coalesce_gap``: ranges of one file closer than this are fetched by one request (the gap bytes
    are read and dropped). ``max_request_bytes``: larger ranges are split into parts fetched concurrently.
    ``part_size``: multipart upload part size for object-store writes, and the size of the objects a save
    packs a rank's small items into. 16 MiB (AWS suggests 8-16 MB parts): one connection to a store carries
    tens of MB/s, so a save's speed comes from requests in flight, and at 16 MiB the writer (which counts
    each part three times: its buffer and the HTTP stack's copies) keeps ten in flight within the default
    512 MiB budget, against two at 64 MiB. S3 uploads double the size every 1,000 parts, so objects up to
    S3's 5 TiB limit still fit its 10,000 parts (:mod:`.s3_upload`). ``None`` picks per filesystem:
    a local disk gets one worker per core and a 4 KiB gap (a syscall is cheap, extra bytes are not), an
    object store 16 workers and a 256 KiB gap (a request costs a round trip).
    """

    max_workers: int | None = None
    max_inflight_bytes: int = 512 * MiB
    coalesce_gap: int | None = None
    max_request_bytes: int = 32 * MiB
    part_size: int = 16 * MiB
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if self.max_workers is not None and self.max_workers < 1:
            raise ValueError(f"TransportConfig.max_workers must be >= 1, got {self.max_workers}")
        if self.max_inflight_bytes < 1 or self.max_request_bytes < 1:
            raise ValueError("TransportConfig byte limits must be >= 1")
        if self.coalesce_gap is not None and self.coalesce_gap < 0:
            raise ValueError(f"TransportConfig.coalesce_gap must be >= 0, got {self.coalesce_gap}")
        if not 5 * MiB <= self.part_size <= 5 * 1024 * MiB:
            raise ValueError(
                f"TransportConfig.part_size must be between 5 MiB and 5 GiB (S3's smallest and largest part), "
                f"got {self.part_size}"
            )


def resolve_config(config: TransportConfig, is_local: bool) -> TransportConfig:
    """Fill the ``None`` (auto) fields of ``config`` for a local or a remote filesystem."""
    workers = config.max_workers or (max(2, os.cpu_count() or 2) if is_local else 16)
    gap = config.coalesce_gap if config.coalesce_gap is not None else (4096 if is_local else 256 * 1024)
    return dataclasses.replace(config, max_workers=workers, coalesce_gap=gap)
