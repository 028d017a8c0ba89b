"""Rank bodies for ``test_metadata_once.py``: every reader, a full load and a metadata-only load, per case.

Module-level so that ranks import them by name. Each case reads its own copy of a checkpoint (its own
prefix), so the test can tell from the server's per-object counts which requests each case made.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

SEED = 1414

# case -> (source checkpoint, how to make the reader from (url, storage_options))
Factory = Callable[[str, dict[str, Any]], Any]


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return {
        "embed.weight": torch.randn(64, 16, generator=g),
        "layer.weight": torch.randn(16, 16, generator=g),
        "layer.bias": torch.randn(16, generator=g),
        "head.weight": torch.randn(16, 64, generator=g).to(torch.bfloat16),
    }


def cases() -> dict[str, tuple[str, Factory]]:
    from dcp_storage import BroadcastingTorchSaveReader, FsspecReader, SafetensorsReader
    from dcp_storage.strategies import Broadcasting

    return {
        "fsspec": ("dcp", lambda u, o: FsspecReader(u, o)),
        "fsspec-verify": ("dcp", lambda u, o: FsspecReader(u, o, verify=True)),
        "safetensors": ("st", lambda u, o: SafetensorsReader(f"{u}/model.safetensors", o)),
        "safetensors-verify": ("st", lambda u, o: SafetensorsReader(f"{u}/model.safetensors", o, verify=True)),
        "safetensors-index": ("hf", lambda u, o: SafetensorsReader(f"{u}/model.safetensors.index.json", o)),
        "safetensors-dcp": ("dcp_st", lambda u, o: SafetensorsReader(u, o)),
        "torch-save": ("pt", lambda u, o: BroadcastingTorchSaveReader(f"{u}/model.pt", storage_options=o)),
        "broadcasting-fsspec": ("dcp", lambda u, o: Broadcasting(FsspecReader(u, o))),
        "broadcasting-safetensors": (
            "hf",
            lambda u, o: Broadcasting(SafetensorsReader(f"{u}/model.safetensors.index.json", o)),
        ),
    }


def write_sources(root: str) -> dict[str, str]:
    """Every source checkpoint of :func:`cases`, written locally under ``root``: source -> directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    from dcp_storage_testing.every_format import write_every_format

    state = reference()
    paths = write_every_format(root, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = FileSystemWriter(f"{root}/dcp_st", serialization_format=SerializationFormat.SAFETENSORS)
        dcp.save(state, storage_writer=writer, no_dist=True)
    pt_dir = f"{root}/pt"
    import os

    os.makedirs(pt_dir)
    os.replace(paths["torch_save"], f"{pt_dir}/model.pt")
    return {"dcp": paths["dcp"], "st": f"{root}/st", "hf": f"{root}/hf", "dcp_st": f"{root}/dcp_st", "pt": pt_dir}


def load_every_case(rank: int, world: int, urls: dict[str, tuple[str, str]], options: dict[str, Any]) -> dict[str, str]:
    """``urls``: case -> (URL of its copy for the full load, URL of its copy for the metadata-only load).

    Returns case -> ``"ok"`` or what went wrong. The metadata-only load has an empty state dict: every
    request it makes is a request for a per-load file.
    """
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    ref = reference()
    out: dict[str, str] = {}
    for name, (_source, make) in cases().items():
        full, meta = urls[name]
        dest = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
        try:
            dcp.load(dest, storage_reader=make(full, options))
            dcp.load({}, storage_reader=make(meta, options))
        except Exception as exc:  # noqa: BLE001 - reported by case name
            out[name] = f"{type(exc).__name__}: {exc}"
            continue
        bad = [k for k, v in ref.items() if not torch.equal(dest[k].view(torch.uint8), v.view(torch.uint8))]
        out[name] = f"wrong bits in {bad}" if bad else "ok"
    return out


def rank_local_round_trip(rank: int, world: int, url: str, options: dict[str, Any]) -> str:
    """Save with ``use_collectives=False`` (one ``__{rank}.metadata`` per rank, no ``.metadata``), load back:
    torch's fallback to ``read_metadata(rank=r)`` must still give each rank its own state."""
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecReader, FsspecWriter

    warnings.filterwarnings("ignore")
    mine = {"w": torch.full((8, 4), float(rank + 1)), "b": torch.arange(4, dtype=torch.float32) + 10 * rank}
    dcp.save(mine, storage_writer=FsspecWriter(url, options), use_collectives=False)
    dest = {k: torch.zeros_like(v) for k, v in mine.items()}
    dcp.load(dest, storage_reader=FsspecReader(url, options))
    bad = [k for k, v in mine.items() if not torch.equal(dest[k], v)]
    return f"wrong values in {bad}" if bad else "ok"
