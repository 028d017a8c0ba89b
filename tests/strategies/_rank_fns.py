"""Rank bodies for ``test_broadcast_distributed.py`` (module-level, so ranks import them by name).

Each body does its loads, checks bit-exactness in place against ``torch.load(weights_only=True)`` of the
local copy (a file the test wrote itself), and returns plain reports: mismatching keys, bytes received,
the bytes of the rank's own shards, what the coordinator read, and errors as text.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from dcp_storage_testing.compare import local_slice as _local_slice
from dcp_storage_testing.compare import same_bits as _same_bits

SEED = 2024
# ~2.7 MB of fp32 weights: big enough that zip headers and data.pkl are noise next to tensor bytes.
SHAPE = {"vocab": 1024, "dim": 128, "hidden": 512, "layers": 2}
MAX_RECEIVE_RATIO = 1.10  # bytes a rank receives / bytes of its own shards


def build_torch_save_state() -> dict[str, Any]:
    """What the test torch.saves: a module state dict, a bf16 tensor, an int and a str."""
    from dcp_storage_testing.models import build_model

    state: dict[str, Any] = dict(build_model(SEED, **SHAPE).state_dict())
    g = torch.Generator().manual_seed(SEED)
    state["extra.bf16"] = torch.randn(96, 40, generator=g).to(torch.bfloat16)
    state["step"] = 1234
    state["tag"] = "tiny-transformer"
    return state


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtensors(reference: dict[str, torch.Tensor], mesh: Any, dim: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    for key, full in reference.items():
        sentinel = torch.full_like(full, float("nan"))  # a missed write stays NaN
        out[key] = distribute_tensor(sentinel, mesh, [Shard(min(dim, full.dim() - 1))], src_data_rank=None)
    return out


def _check_dtensors(state: dict[str, Any], reference: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    bad, needed = [], 0
    for key, full in reference.items():
        local = state[key].to_local()
        needed += _nbytes(local)
        if not _same_bits(local, _local_slice(full, state[key]).contiguous()):
            bad.append(key)
    return bad, needed


# ---------------------------------------------------------------------------------------------- loads
def load_torch_save(
    rank: int, world: int, local_path: str, sources: list[tuple[str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Every source loaded into Shard(0) and Shard(1) DTensors and into plain full tensors.

    DTensor and full loads use torch's ``DynamicMetaLoadPlanner``; one more full load uses DCP's default
    planner with the int/str entries in the state dict (which torch's planner cannot load).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_storage import BroadcastingTorchSaveReader

    warnings.filterwarnings("ignore")
    saved = torch.load(local_path, weights_only=True)
    reference = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    mesh = init_device_mesh("cpu", (world,))
    reports = []
    for url, options in sources:
        for case in ("Shard(0)", "Shard(1)", "full", "full+values"):
            if case.startswith("Shard"):
                state: dict[str, Any] = _dtensors(reference, mesh, int(case[6]))
            else:
                state = {k: torch.full_like(v, float("nan")) for k, v in reference.items()}
            if case == "full+values":
                state.update(step=0, tag="")
            reader = BroadcastingTorchSaveReader(storage_options=options)
            planner = None if case == "full+values" else DynamicMetaLoadPlanner()
            dcp.load(state, storage_reader=reader, planner=planner, checkpoint_id=url)
            if case.startswith("Shard"):
                bad, needed = _check_dtensors(state, reference)
            else:
                bad = [k for k, v in reference.items() if not _same_bits(state[k], v)]
                needed = sum(_nbytes(v) for v in reference.values())
            values = (state.get("step"), state.get("tag")) if case == "full+values" else None
            reports.append(
                {"url": url, "case": case, "mismatched": bad, "needed": needed, "values": values, **reader.stats}
            )
    return reports


def save_fsdp2_dcp(rank: int, world: int, directory: str) -> None:
    """A DCP checkpoint of ``{"model": fsdp2_model.state_dict()}`` saved by ``world`` ranks."""
    import torch.distributed.checkpoint as dcp

    from dcp_storage_testing.models import build_model, fsdp2_shard

    warnings.filterwarnings("ignore")
    model = fsdp2_shard(build_model(SEED, **SHAPE))
    dcp.save({"model": model.state_dict()}, checkpoint_id=directory)


def world2(
    rank: int, world: int, local_path: str, sources: list[tuple[str, dict[str, Any]]], dcp_dir: str
) -> dict[str, Any]:
    save_fsdp2_dcp(rank, world, dcp_dir)
    return {"loads": load_torch_save(rank, world, local_path, sources)}


def load_broadcasting_fsspec(rank: int, world: int, dcp_dir: str) -> dict[str, Any]:
    """``Broadcasting(FsspecReader(dcp_dir))`` into Shard(0) DTensors at this world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_storage import Broadcasting, FsspecReader
    from dcp_storage_testing.models import reference_state_dict

    reference = reference_state_dict(SEED, **SHAPE)
    mesh = init_device_mesh("cpu", (world,))
    state = _dtensors(reference, mesh, 0)
    inner = FsspecReader(dcp_dir)
    reader = Broadcasting(inner)
    dcp.load({"model": state}, storage_reader=reader)
    bad, needed = _check_dtensors(state, reference)
    return {"mismatched": bad, "needed": needed, "inner": inner.counters, **reader.stats}


def check_share_object(rank: int, world: int) -> dict[str, Any]:
    """share_object: a value, one of our errors (same class, same attributes), a foreign error (wrapped)."""
    from dcp_storage.errors import DcpStorageError, UnsafeCheckpointError
    from dcp_storage.strategies import share_object

    out: dict[str, Any] = {}
    out["value"] = share_object(lambda: {"rank": rank, "t": torch.arange(3)}, src_rank=world - 1)
    out["value"]["t"] = out["value"]["t"].tolist()

    def unsafe() -> None:
        raise UnsafeCheckpointError("s3://b/evil.pt", "os.system")

    def foreign() -> None:
        raise ValueError(f"plain value error on rank {rank}")

    for name, fn in (("unsafe", unsafe), ("foreign", foreign)):
        try:
            share_object(fn)
        except DcpStorageError as exc:
            out[name] = {"type": type(exc).__name__, "text": str(exc), "attrs": dict(vars(exc))}
        except Exception as exc:  # noqa: BLE001 - the source rank re-raises its own exception
            out[name] = {"type": type(exc).__name__, "text": str(exc), "attrs": {}}
    return out


def load_small_budgets(rank: int, world: int, local_path: str) -> dict[str, Any]:
    """Shard(1) with tiny staging and in-flight budgets: many batches, a send wait before each."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_storage import BroadcastingTorchSaveReader
    from dcp_storage.strategies import DeliveryConfig

    saved = torch.load(local_path, weights_only=True)
    reference = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    state = _dtensors(reference, init_device_mesh("cpu", (world,)), 1)
    config = DeliveryConfig(max_inflight_bytes=1, staging_bytes=64 * 1024)
    reader = BroadcastingTorchSaveReader(local_path, delivery_config=config)
    dcp.load(state, storage_reader=reader, planner=DynamicMetaLoadPlanner())
    bad, needed = _check_dtensors(state, reference)
    return {"mismatched": bad, "needed": needed, **reader.stats}


def fail_mid_transfer(rank: int, world: int, local_path: str) -> dict[str, Any]:
    """The coordinator's third read batch fails: every rank must raise that error, promptly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_storage.formats.torch_save.reader as module
    from dcp_storage import BroadcastingTorchSaveReader
    from dcp_storage.errors import CorruptCheckpointError
    from dcp_storage.strategies import DeliveryConfig

    saved = torch.load(local_path, weights_only=True)
    reference = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    state = _dtensors(reference, init_device_mesh("cpu", (world,)), 0)
    original = module.read_slices
    calls = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise CorruptCheckpointError(f"{local_path}: injected failure mid-transfer")
        return original(*args, **kwargs)

    if rank == 0:
        module.read_slices = failing  # type: ignore[assignment]
    start = time.monotonic()
    try:
        reader = BroadcastingTorchSaveReader(local_path, delivery_config=DeliveryConfig(staging_bytes=64 * 1024))
        dcp.load(state, storage_reader=reader, planner=DynamicMetaLoadPlanner())
        return {"raised": None}
    except CheckpointException as exc:
        return {**_failure(exc, rank, start), "received": reader.stats["bytes_received"]}
    finally:
        module.read_slices = original  # type: ignore[assignment]


def _failure(exc: Any, rank: int, start: float) -> dict[str, Any]:
    """What a rank saw of a failed ``dcp.load``: its own error (``raised=None``: none of its own, the text then
    names the failing ranks') and how long after ``start``."""
    mine = exc.failures.get(rank)
    return {
        "raised": type(mine[0]).__name__ if mine else None,
        "text": str(mine[0]) if mine else str(exc),
        "seconds": time.monotonic() - start,
    }


def fail_in_commit(rank: int, world: int, local_path: str) -> dict[str, Any]:
    """A load into full tensors whose planner fails in ``commit_tensor`` on the coordinator, which commits a
    slice only once it was sent from that destination (``SliceSender.after_sent``): every rank must raise that
    error, promptly, and the slices committed before it are the file's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner

    from dcp_storage import BroadcastingTorchSaveReader
    from dcp_storage.errors import CorruptCheckpointError

    saved = torch.load(local_path, weights_only=True)
    reference = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    committed: list[str] = []

    class FailingCommit(DynamicMetaLoadPlanner):
        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            fqn = read_item.dest_index.fqn
            if rank == 0 and len(committed) == 2:
                raise CorruptCheckpointError(f"{local_path}: injected failure in commit_tensor ({fqn})")
            assert _same_bits(tensor, reference[fqn]), fqn  # committed only with all its bytes in place
            committed.append(fqn)
            super().commit_tensor(read_item, tensor)

    state = {k: torch.zeros_like(v) for k, v in reference.items()}
    start = time.monotonic()
    try:
        dcp.load(state, storage_reader=BroadcastingTorchSaveReader(local_path), planner=FailingCommit())
        return {"raised": "nothing", "text": "", "seconds": time.monotonic() - start}
    except CheckpointException as exc:
        return _failure(exc, rank, start)


def world3(
    rank: int, world: int, local_path: str, sources: list[tuple[str, dict[str, Any]]], dcp_dir: str
) -> dict[str, Any]:
    return {
        "loads": load_torch_save(rank, world, local_path, sources),
        "broadcasting": load_broadcasting_fsspec(rank, world, dcp_dir),
        "share": check_share_object(rank, world),
        "small_budgets": load_small_budgets(rank, world, local_path),
        "mid_transfer": fail_mid_transfer(rank, world, local_path),
        "in_commit": fail_in_commit(rank, world, local_path),
    }


# ---------------------------------------------------------------------------------------------- errors
def load_bad_files(rank: int, world: int, files: dict[str, str]) -> dict[str, Any]:
    """Each bad file: ``read_metadata`` directly (our error class on every rank), then through ``dcp.load``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner

    from dcp_storage import BroadcastingTorchSaveReader

    warnings.filterwarnings("ignore")
    out: dict[str, Any] = {}
    for name, path in files.items():
        report: dict[str, Any] = {}
        start = time.monotonic()
        try:
            BroadcastingTorchSaveReader(path).read_metadata()
            report["direct"] = None
        except Exception as exc:  # noqa: BLE001 - reported back for the test to assert on
            report["direct"] = {"type": type(exc).__name__, "module": type(exc).__module__, "text": str(exc)}
        state = {"w": torch.zeros(4)}
        try:
            dcp.load(
                state,
                storage_reader=BroadcastingTorchSaveReader(),
                planner=DynamicMetaLoadPlanner(),
                checkpoint_id=path,
            )
            report["dcp"] = None
        except CheckpointException as exc:
            report["dcp"] = {"type": "CheckpointException", "text": str(exc)}
        report["seconds"] = time.monotonic() - start
        out[name] = report
        dist.barrier()
    return out
