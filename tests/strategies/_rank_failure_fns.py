"""Rank bodies for ``test_rank_failures.py``: loads in which one rank fails, or the ranks disagree.

Module-level, so ``run_ranks`` can unpickle them by name. Each case is one ``dcp.load`` on every rank; each
rank reports whether it raised, the text of what it raised, and how long it took. All the cases of a run
share one process group (whose collective timeout is long): a case that leaves the ranks out of step also
breaks the cases after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

SEED = 7
FAIL_TEXT = "simulated finish_plan failure"
DELIVERY_TEXT = "simulated delivery failure"
MEMORY_TEXT = "simulated out of memory"
NESTED_TEXT = "simulated nested DCP failure"


def reference() -> dict[str, torch.Tensor]:
    """Plain tensors every rank loads whole: every item is shared, so ``read_once`` exchanges them all."""
    g = torch.Generator().manual_seed(SEED)
    return {
        "embed": torch.randn(512, 256, generator=g),  # 512 KiB
        "layer.weight": torch.randn(256, 256, generator=g),
        "layer.bias": torch.randn(256, generator=g),
        "norm": torch.randn(64, generator=g),
    }


class FinishPlanFails(DefaultLoadPlanner):
    """Raises in ``finish_plan`` on ``fail_rank``: DCP then skips that rank's ``read_data``."""

    def __init__(self, fail_rank: int) -> None:
        super().__init__()
        self.fail_rank = fail_rank

    def finish_plan(self, central_plan: Any) -> Any:
        if dist.get_rank() == self.fail_rank:
            raise RuntimeError(f"{FAIL_TEXT} on rank {self.fail_rank}")
        return super().finish_plan(central_plan)


class DropsItems(DefaultLoadPlanner):
    """On ``drop_rank``, ``finish_plan`` drops the plan's last item (the other ranks planned with it)."""

    def __init__(self, drop_rank: int) -> None:
        super().__init__()
        self.drop_rank = drop_rank

    def finish_plan(self, central_plan: Any) -> Any:
        plan = super().finish_plan(central_plan)
        if dist.get_rank() == self.drop_rank:
            return dataclasses.replace(plan, items=plan.items[:-1])
        return plan


class ResolveFails(DefaultLoadPlanner):
    """Raises in ``resolve_tensor`` (inside ``read_data``, as the bytes are delivered) on ``fail_rank``."""

    def __init__(self, fail_rank: int) -> None:
        super().__init__()
        self.fail_rank = fail_rank

    def resolve_tensor(self, read_item: Any) -> Any:
        if dist.get_rank() == self.fail_rank:
            raise RuntimeError(f"{DELIVERY_TEXT} on rank {self.fail_rank}")
        return super().resolve_tensor(read_item)


class CommitFails(DefaultLoadPlanner):
    """Raises in ``commit_tensor`` (inside ``read_data``, after a tensor's bytes landed) on ``fail_rank``."""

    def __init__(self, fail_rank: int) -> None:
        super().__init__()
        self.fail_rank = fail_rank

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        if dist.get_rank() == self.fail_rank:
            raise RuntimeError(f"{DELIVERY_TEXT} on rank {self.fail_rank}")
        super().commit_tensor(read_item, tensor)


class _NoMemory:
    """``torch`` as a delivery module sees it on a rank whose memory ran out: every allocation of at least
    ``refused`` bytes fails, as a CUDA allocation does under NCCL (everything else is torch's)."""

    def __init__(self, refused: int) -> None:
        self.refused = refused

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *size: Any, **kwargs: Any) -> torch.Tensor:
        flat = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        itemsize = (kwargs.get("dtype") or torch.get_default_dtype()).itemsize
        if math.prod(int(n) for n in flat) * itemsize >= self.refused:
            raise torch.OutOfMemoryError(f"{MEMORY_TEXT} on rank {dist.get_rank()}")
        return torch.empty(*size, **kwargs)


@contextlib.contextmanager
def _memory_runs_out(planner: str | None) -> Iterator[None]:
    """``alloc-fails``: read_once's receive buffers (any); ``staging-fails``: slice delivery's buffers of 64 KiB
    and more (a cast's staging of the 512 KiB tensor, and a buffer to drain its payload into)."""
    from dcp_storage.strategies import read_once_exchange, slice_delivery

    module, refused = {
        "alloc-fails": (read_once_exchange, 1),
        "staging-fails": (slice_delivery, 64 << 10),
    }.get(planner or "", (None, 0))
    if module is not None:
        module.torch = _NoMemory(refused)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if module is not None:
            module.torch = torch  # type: ignore[attr-defined]


def _strategy(name: str) -> Any:
    from dcp_storage import ReadStrategies

    if name == "per_host":
        return ReadStrategies.per_host("one-host")
    if name == "default":
        return None  # what the reader picks for a local path: per_rank
    return ReadStrategies.named(name)


def _reader(spec: str, paths: dict[str, str]) -> Any:
    """``"broadcasting"``, ``"broadcasting-nested-fails"`` (the wrapped reader's ``read_metadata`` raises torch's
    ``CheckpointException``, a ``BaseException``), ``"safetensors:<strategy>"`` or ``"<strategy>"`` (an
    FsspecReader)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_storage import FsspecReader, SafetensorsReader
    from dcp_storage.strategies import Broadcasting

    class NestedFails(FsspecReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            raise CheckpointException(NESTED_TEXT, {0: (RuntimeError(NESTED_TEXT), [])})  # (error, traceback)

    if spec == "broadcasting":
        return Broadcasting(FsspecReader(paths["dcp"]))
    if spec == "broadcasting-nested-fails":
        return Broadcasting(NestedFails(paths["dcp"]))
    if spec.startswith("safetensors:"):
        return SafetensorsReader(paths["st"], read_strategy=_strategy(spec.split(":", 1)[1]))
    return FsspecReader(paths["dcp"], read_strategy=_strategy(spec))


def _planner(kind: str | None, rank_arg: int) -> Any:
    if kind == "fails":
        return FinishPlanFails(rank_arg)
    if kind == "drops":
        return DropsItems(rank_arg)
    if kind == "resolve-fails":
        return ResolveFails(rank_arg)
    if kind == "commit-fails":
        return CommitFails(rank_arg)
    return None


def run_cases(rank: int, world: int, paths: dict[str, str], cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case: ``readers`` (one spec per rank), ``planner`` (``fails``/``drops``/``resolve-fails``/
    ``commit-fails``/``alloc-fails``/``staging-fails``: see :func:`_memory_runs_out`/None), its ``rank``, and
    ``cast``: destinations of another dtype.

    Returns ``{case: {"raised", "text", "seconds", "bad"}}``: ``bad`` lists tensors loaded wrong when it
    did not raise.
    """
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    ref = reference()
    out: dict[str, Any] = {}
    for name, case in cases.items():
        dtype = torch.float64 if case.get("cast") else None  # destinations the bytes are cast into
        target = {k: torch.zeros_like(v, dtype=dtype) for k, v in ref.items()}
        reader = _reader(case["readers"][rank], paths)
        planner = _planner(case.get("planner"), case.get("rank", 1))
        began = time.monotonic()
        try:
            with _memory_runs_out(case.get("planner") if rank == case.get("rank", 1) else None):
                dcp.load(target, storage_reader=reader, planner=planner)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            out[name] = {"raised": True, "text": f"{type(exc).__name__}: {exc}"[:4000]}
        else:
            bad = [k for k, v in ref.items() if not torch.equal(target[k], v.to(target[k].dtype))]
            out[name] = {"raised": False, "text": "", "bad": bad}
        out[name]["seconds"] = time.monotonic() - began
    # Last good loads: the group is still in step after every case above (no message of a failed load, and no
    # receive posted for one, is left to be matched by a later load's).
    for name, spec in (("_after", "read_once"), ("_after_broadcasting", "broadcasting")):
        target = {k: torch.zeros_like(v) for k, v in ref.items()}
        began = time.monotonic()
        dcp.load(target, storage_reader=_reader(spec, paths))
        out[name] = {
            "bad": [k for k, v in ref.items() if not torch.equal(target[k], v)],
            "seconds": time.monotonic() - began,
        }
    return out
