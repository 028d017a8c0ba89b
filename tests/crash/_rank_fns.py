"""Rank bodies for the crash tests: a 2-rank DCP save that the test SIGKILLs at a random moment.

They run inside :func:`dcp_storage_testing.distributed.run_ranks` processes (module-level functions of an
importable module). Each rank announces ``pid`` and the moment its save starts in ``signal_dir`` so the
test can aim its kill, and marks the end of its save, so a kill that came too late is told apart.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

MiB = 1024 * 1024
# ~20 MiB over 9 entries; DCP spreads the (replicated) entries over both ranks and each rank writes
# thread_count=2 files, so a save makes 4 data files of ~5 MiB: kills land before, inside and between them.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "embed.weight": ((1024, 1024), torch.float32),
    "layers.0.w1": ((1024, 1024), torch.float32),
    "layers.0.w2": ((512, 1024), torch.bfloat16),
    "layers.1.w1": ((1024, 1024), torch.float32),
    "layers.1.w2": ((512, 1024), torch.bfloat16),
    "head.weight": ((1024, 768), torch.float32),
    "head.bias": ((1024,), torch.float32),
    "counts": ((64 * 1024,), torch.int64),
}


def make_state(seed: int) -> dict[str, Any]:
    """A deterministic state dict for ``seed``: random bits (NaNs included: compared bitwise), and a step."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for name, (shape, dtype) in SHAPES.items():
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        state[name] = raw.view(dtype).reshape(shape)
    state["step"] = seed  # a non-tensor entry (BYTE_IO)
    return state


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape:
                return False
            if not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
                return False
        elif x != y:
            return False
    return True


def _mark(path: str, text: str) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def save(
    rank: int,
    world: int,
    url: str,
    storage_options: dict[str, Any],
    seed: int,
    signal_dir: str,
    overwrite: bool,
    part_size: int,
) -> float:
    """Save ``make_state(seed)`` with ``FsspecWriter``; return the seconds the save took on this rank."""

    from dcp_storage import FsspecWriter
    from dcp_storage.transports import TransportConfig

    class CommitMarkingWriter(FsspecWriter):
        """Notes when ``finish`` (the commit: ``.metadata`` written) returned, so kills can be aimed before it."""

        def finish(self, *args: Any, **kwargs: Any) -> None:
            super().finish(*args, **kwargs)
            _mark(os.path.join(signal_dir, "committed"), repr(time.time()))

    state = make_state(seed)
    writer = CommitMarkingWriter(
        url, storage_options, overwrite=overwrite, thread_count=2, transport_config=TransportConfig(part_size=part_size)
    )
    return _timed_save(state, writer, rank, signal_dir)


def _timed_save(state: dict[str, Any], writer: Any, rank: int, signal_dir: str) -> float:
    """``dcp.save`` between the ``rank<N>.start`` and ``rank<N>.done`` markers the trial driver watches."""
    import torch.distributed.checkpoint as dcp

    start = time.time()
    _mark(os.path.join(signal_dir, f"rank{rank}.start"), f"{os.getpid()} {start!r}")
    dcp.save(state, storage_writer=writer)
    elapsed = time.time() - start
    _mark(os.path.join(signal_dir, f"rank{rank}.done"), repr(elapsed))
    return elapsed


def tensors_only(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def save_safetensors(
    rank: int, world: int, url: str, storage_options: dict[str, Any], seed: int, signal_dir: str, max_shard_size: str
) -> float:
    """Save ``make_state(seed)``'s tensors with ``SafetensorsWriter`` (sharded: several files plus an index)."""

    from dcp_storage import SafetensorsWriter

    state = tensors_only(make_state(seed))
    writer = SafetensorsWriter(url, storage_options, max_shard_size=max_shard_size)
    return _timed_save(state, writer, rank, signal_dir)
