"""Helpers shared by the writer tests: read a saved HF checkpoint back with safetensors itself."""

from __future__ import annotations

import json
from typing import Any

import fsspec
import torch
from safetensors.torch import load as st_load

from dcp_storage_testing.compare import same_bits


def mismatches(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Keys missing, extra, or not bit-exact."""
    bad = sorted(set(actual) ^ set(expected))
    bad += [k for k in sorted(set(actual) & set(expected)) if not same_bits(actual[k], expected[k])]
    return bad


def read_checkpoint(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every file of a saved checkpoint, parsed by ``safetensors.torch.load`` and checked for consistency.

    Returns ``{"tensors": union of all files, "files": {name: bytes}, "index": parsed index or None,
    "names": listing}``. Asserts that the index (if any) names exactly the tensors each file holds and
    that ``total_size`` is the sum of tensor bytes.
    """
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.invalidate_cache()
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    files: dict[str, bytes] = {}
    tensors: dict[str, torch.Tensor] = {}
    index = None
    if "model.safetensors.index.json" in names:
        index = json.loads(fs.cat_file(f"{root}/model.safetensors.index.json"))
        shard_names = sorted(set(index["weight_map"].values()))
    else:
        shard_names = ["model.safetensors"]
    for name in shard_names:
        files[name] = fs.cat_file(f"{root}/{name}")
        part = st_load(files[name])
        overlap = set(part) & set(tensors)
        assert not overlap, f"tensors in two files: {sorted(overlap)}"
        if index is not None:
            listed = {k for k, v in index["weight_map"].items() if v == name}
            assert listed == set(part), f"{name}: index lists {sorted(listed)} but the file holds {sorted(part)}"
        tensors.update(part)
    if index is not None:
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return {"tensors": tensors, "files": files, "index": index, "names": names}
