"""The benchmark checkpoint's shape: units, the transformer-like tensor list and its sizes, checksums."""

from __future__ import annotations

import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # the scripts run from a checkout: its dcp_storage
    sys.path.insert(1, REPO)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
GB = 1e9
SPEC_VERSION = 1  # bump when the checkpoint layout/generation changes (invalidates the cache)
BUCKET = "bench"
RAW_PART = 16 * MiB
RAW_CONCURRENCY = 8
LOCAL_CHUNK = 64 * MiB


def model_spec(size_bytes: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Tensors of a transformer of about ``size_bytes``: (name, shape, dtype name)."""
    dim = 2048 if size_bytes >= 1 * GiB else 1024
    hidden = (int(2.75 * dim) + 255) // 256 * 256
    vocab = 16 * dim
    emb = [("embed.weight", (vocab, dim), "float32")]
    head = [("norm_f.weight", (dim,), "float32"), ("head.weight", (vocab, dim), "float32")]

    def layer(i: int) -> list[tuple[str, tuple[int, ...], str]]:
        p = f"layers.{i}."
        return [
            (p + "attn_norm.weight", (dim,), "float32"),
            (p + "attn_norm.bias", (dim,), "float32"),
            (p + "attn.qkv.weight", (3 * dim, dim), "bfloat16"),
            (p + "attn.qkv.bias", (3 * dim,), "float32"),
            (p + "attn.out.weight", (dim, dim), "bfloat16"),
            (p + "mlp_norm.weight", (dim,), "float32"),
            (p + "mlp.up.weight", (hidden, dim), "bfloat16"),
            (p + "mlp.up.bias", (hidden,), "float32"),
            (p + "mlp.down.weight", (dim, hidden), "bfloat16"),
            (p + "mlp.down.bias", (dim,), "float32"),
        ]

    fixed = spec_total_bytes(emb + head)
    per_layer = spec_total_bytes(layer(0))
    n_layers = max(1, round((size_bytes - fixed) / per_layer))
    spec = list(emb)
    for i in range(n_layers):
        spec += layer(i)
    return spec + head


_ITEMSIZE = {"float32": 4, "bfloat16": 2}


def tensor_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = _ITEMSIZE[dtype]
    for s in shape:
        n *= s
    return n


def spec_total_bytes(spec: list[tuple[str, tuple[int, ...], str]]) -> int:
    return sum(tensor_nbytes(shape, dt) for _, shape, dt in spec)


def torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def checksum(t: Any) -> int:
    """Sum of the elements' bit patterns (int64): cheap and catches misplaced or missing bytes."""
    import torch

    t = t.contiguous()
    ints = t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    return int(ints.sum(dtype=torch.int64).item())


def contig_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
