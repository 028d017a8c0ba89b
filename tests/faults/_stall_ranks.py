"""Rank functions for ``test_stalls`` (module level, so ``run_ranks`` can pickle them)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage.formats.dcp_native.reader import FsspecReader
from dcp_storage.formats.safetensors.reader import SafetensorsReader
from dcp_storage.transports import TransportConfig


def load_and_time(
    rank: int,
    world: int,
    kind: str,
    url: str,
    options: list[dict[str, Any]],
    like: dict[str, Any],
    config: TransportConfig,
) -> tuple[str, float]:
    """Load with this rank's ``options``; ``(the error's text, seconds)`` (``("", s)`` if it loaded)."""
    cls = FsspecReader if kind == "dcp" else SafetensorsReader
    reader = cls(url, options[rank], transport_config=config)
    began = time.monotonic()
    try:
        dcp.load({k: torch.zeros_like(v) for k, v in like.items()}, storage_reader=reader)
    except CheckpointException as exc:
        return str(exc), time.monotonic() - began
    return "", time.monotonic() - began
