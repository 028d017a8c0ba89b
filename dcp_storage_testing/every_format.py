"""One state dict written in every format the built-in readers read, for tests that go through all of them."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from dcp_storage.formats.dcp_native.reader import FsspecReader
from dcp_storage.formats.dcp_native.writer import FsspecWriter
from dcp_storage.formats.safetensors.reader import SafetensorsReader
from dcp_storage.formats.safetensors.writer import SafetensorsWriter
from dcp_storage.formats.torch_save.reader import BroadcastingTorchSaveReader
from dcp_storage.opening import open_reader
from dcp_storage.strategies import Broadcasting

__all__ = ["every_reader", "write_every_format"]


def write_every_format(root: str, state: dict[str, Any]) -> dict[str, str]:
    """Write ``state`` (two or more tensors) under ``root`` from this process; return each checkpoint's path.

    ``"dcp"``: a DCP directory (``FsspecWriter``); ``"safetensors"``: one ``model.safetensors``;
    ``"hf_index"``: a sharded Hugging Face set (shards no larger than the largest tensor), by its index
    file; ``"torch_save"``: a ``torch.save`` file.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    paths = {
        "dcp": f"{root}/dcp",
        "safetensors": f"{root}/st/model.safetensors",
        "hf_index": f"{root}/hf/model.safetensors.index.json",
        "torch_save": f"{root}/model.pt",
    }
    shard_bytes = max(t.numel() * t.element_size() for t in state.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ...: loading in a single process"
        dcp.save(state, storage_writer=FsspecWriter(paths["dcp"]), no_dist=True)
        dcp.save(state, storage_writer=SafetensorsWriter(f"{root}/st"), no_dist=True)
        dcp.save(state, storage_writer=SafetensorsWriter(f"{root}/hf", max_shard_size=shard_bytes), no_dist=True)
    torch.save(state, paths["torch_save"])
    return paths


def every_reader(paths: dict[str, str]) -> dict[str, Callable[[], Any]]:
    """A factory of a fresh reader for each case, by name, over :func:`write_every_format`'s ``paths``: every
    reader class, ``Broadcasting`` around each, and what ``open_reader`` picks for each format."""

    return {
        "FsspecReader": lambda: FsspecReader(paths["dcp"]),
        "SafetensorsReader": lambda: SafetensorsReader(paths["safetensors"]),
        "SafetensorsReader(index)": lambda: SafetensorsReader(paths["hf_index"]),
        "BroadcastingTorchSaveReader": lambda: BroadcastingTorchSaveReader(paths["torch_save"]),
        "Broadcasting(FsspecReader)": lambda: Broadcasting(FsspecReader(paths["dcp"])),
        "Broadcasting(SafetensorsReader)": lambda: Broadcasting(SafetensorsReader(paths["hf_index"])),
        "Broadcasting(BroadcastingTorchSaveReader)": lambda: Broadcasting(
            BroadcastingTorchSaveReader(paths["torch_save"])
        ),
        "open_reader(dcp)": lambda: open_reader(paths["dcp"]),
        "open_reader(hf_index)": lambda: open_reader(paths["hf_index"]),
        "open_reader(torch_save)": lambda: open_reader(paths["torch_save"]),
    }
