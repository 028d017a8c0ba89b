"""Seeded toy models shaped like a transformer, and FSDP2 wrapping, for tests, demo and benchmarks.

Every rank can rebuild the exact reference weights from the seed, so loads are checked bit-exactly
without shipping tensors between processes.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TinyTransformer", "build_model", "fsdp2_shard", "reference_state_dict"]


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn_qkv = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.mlp_up = nn.Linear(dim, hidden)
        self.mlp_down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, _k, v = self.attn_qkv(h).chunk(3, dim=-1)
        x = x + self.attn_out(q * v)
        return x + self.mlp_down(torch.relu(self.mlp_up(self.norm(x))))


class TinyTransformer(nn.Module):
    """Embedding, ``layers`` blocks of linear layers with norms, and an output head."""

    def __init__(self, vocab: int = 256, dim: int = 64, hidden: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(seed: int, dtype: torch.dtype = torch.float32, **shape: int) -> TinyTransformer:
    """A model whose weights depend only on ``seed`` and ``shape`` (same on every rank)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = TinyTransformer(**shape)
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(dtype)


def reference_state_dict(seed: int, dtype: torch.dtype = torch.float32, **shape: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_model(seed, dtype, **shape).state_dict().items()}


def fsdp2_shard(model: nn.Module, mesh: object | None = None) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to every block and the root (parameters become ``Shard(0)`` DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
