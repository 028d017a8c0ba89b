"""Rank bodies for ``test_distributed.py`` (module-level, so ``run_ranks`` can unpickle them by name).

Each world size is one spawn; its body runs every check and returns plain data for the tests to assert on.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dcp_storage_testing.compare import same_bits as _same_bits

SEED = 0  # the weights loaded
OTHER_SEED = 1  # the weights targets start with (FSDP1 targets are materialised)
# vocab and hidden do not divide by 4: uneven Shard(0) blocks, and a rank with a short block.
SHAPE = {"vocab": 130, "dim": 24, "hidden": 40, "layers": 2}
HEADER_BYTES = 24  # slice delivery: an int64[3] header per block


def reference() -> dict[str, torch.Tensor]:
    """The full state dict every load must reproduce: the seeded model plus a persistent buffer."""
    from dcp_storage_testing.models import reference_state_dict

    sd = reference_state_dict(SEED, **SHAPE)
    sd["blocks.0.pos"] = torch.arange(7, dtype=torch.float32) * 0.5
    return sd


def _with_buffer(model: nn.Module) -> nn.Module:
    model.blocks[0].register_buffer("pos", torch.zeros(7))  # type: ignore[index]
    return model


def meta_fsdp2(mesh: Any = None, root: bool = True) -> nn.Module:
    """FSDP2 on blocks (and the root) of a model built on the meta device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dcp_storage_testing.models import build_model

    with torch.device("meta"):
        model = _with_buffer(build_model(OTHER_SEED, **SHAPE))
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    if root:
        fully_shard(model, mesh=mesh)
    return model


def fsdp1_model() -> nn.Module:
    """FSDP1 with an auto wrap policy (each block, then the root), on CPU: ``device_id`` must be the CPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from dcp_storage_testing.models import _Block, build_model

    model = _with_buffer(build_model(OTHER_SEED, **SHAPE))
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({_Block}), device_id=torch.device("cpu"), use_orig_params=True)


# ------------------------------------------------------------------------------------------ checks
def mismatched_fsdp2(model: nn.Module, ref: Mapping[str, torch.Tensor]) -> list[str]:
    """Keys whose full tensor (all-gathered: collective) differs in any bit from the reference."""
    from torch.distributed.tensor import DTensor

    bad = []
    sd = model.state_dict()
    if sorted(sd) != sorted(ref):
        return [f"keys differ: {sorted(set(sd) ^ set(ref))}"]
    for key in sorted(sd):
        value = sd[key]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if not _same_bits(full, ref[key]):
            bad.append(key)
    return bad


def mismatched_fsdp1(model: nn.Module, ref: Mapping[str, torch.Tensor]) -> list[str]:
    """Keys whose local shards (under SHARDED_STATE_DICT) differ from the reference's blocks."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    bad = []
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
    if sorted(sd) != sorted(ref):
        return [f"keys differ: {sorted(set(sd) ^ set(ref))}"]
    for key, value in sd.items():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                region = tuple(
                    slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
                )
                if not _same_bits(shard.tensor, ref[key][region]):
                    bad.append(key)
        elif not _same_bits(value, ref[key]):
            bad.append(key)
    return bad


def forward_matches(model: nn.Module) -> bool:
    """The loaded model computes what the reference model computes."""
    from dcp_storage_testing.models import build_model

    tokens = (torch.arange(12) * 7 % SHAPE["vocab"]).reshape(2, 6)
    with torch.no_grad():
        return torch.allclose(model(tokens), build_model(SEED, **SHAPE)(tokens), rtol=0, atol=1e-6)


def shard_bytes(ref: Mapping[str, torch.Tensor], coord: int, parts: int) -> int:
    """Bytes of the ``Shard(0)`` blocks at ``coord`` of ``parts`` (torch.chunk), buffers in full."""
    total = 0
    for key, t in ref.items():
        if key.endswith(".pos"):  # FSDP2 does not shard buffers
            total += t.numel() * t.element_size()
            continue
        chunks = torch.chunk(t, parts, dim=0)
        if coord < len(chunks):
            total += chunks[coord].numel() * t.element_size()
    return total


class WireCounter:
    """Bytes this rank received point to point (``recv``/``irecv``) and by ``broadcast``."""

    def __init__(self) -> None:
        self.p2p = 0
        self.broadcast = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[WireCounter]:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        # c10d.recv calls c10d.irecv: point-to-point calls are counted where our code makes them
        # (torch.distributed.recv/irecv), broadcasts also inside c10d (broadcast_object_list).
        originals = {name: getattr(dist, name) for name in ("recv", "irecv", "broadcast")}

        def wrap(name: str, field: str) -> Any:
            def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                setattr(self, field, getattr(self, field) + tensor.numel() * tensor.element_size())
                return originals[name](tensor, *args, **kwargs)

            return counted

        patched = {
            "recv": wrap("recv", "p2p"),
            "irecv": wrap("irecv", "p2p"),
            "broadcast": wrap("broadcast", "broadcast"),
        }
        targets = [(dist, "recv"), (dist, "irecv"), (dist, "broadcast"), (c10d, "broadcast")]
        for module, name in targets:
            setattr(module, name, patched[name])
        try:
            yield self
        finally:
            for module, name in targets:
                setattr(module, name, originals[name])


class _FailsOnSecondRead(Mapping[str, torch.Tensor]):
    """A state dict whose ``key`` can be read once: rank 0 fails mid-transfer, after the verdict."""

    def __init__(self, data: dict[str, torch.Tensor], key: str) -> None:
        self.data, self.key, self.reads = data, key, 0

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == self.key:
            self.reads += 1
            if self.reads > 1:
                raise OSError(f"simulated failure reading {key!r}")
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


# ------------------------------------------------------------------------------------------ loads
def load_in_memory(rank: int, world: int, model: nn.Module, full: Any, **kwargs: Any) -> dict[str, Any]:
    from dcp_storage.fsdp import load_full_state_dict
    from dcp_storage.strategies import DeliveryStats

    stats = DeliveryStats()
    counter = WireCounter()
    t0 = time.perf_counter()
    with counter.counting():
        returned = load_full_state_dict(model, full if rank == 0 else None, stats=stats, **kwargs)
    return {
        "seconds": time.perf_counter() - t0,
        "returned_model": returned is model,
        "stats": stats.as_dict(),
        "p2p": counter.p2p,
        "broadcast": counter.broadcast,
    }


def error_case(rank: int, model: nn.Module, full: Any, *, everyone: bool = False) -> dict[str, Any]:
    from dcp_storage.fsdp import load_full_state_dict

    t0 = time.perf_counter()
    try:
        load_full_state_dict(model, full if (rank == 0 or everyone) else None)
    except Exception as exc:  # noqa: BLE001 - the point: what each rank raised
        from dcp_storage.errors import DcpStorageError

        return {
            "type": type(exc).__name__,
            "ours": isinstance(exc, DcpStorageError),
            "mro": [c.__name__ for c in type(exc).__mro__],
            "text": str(exc),
            "attrs": {k: v for k, v in vars(exc).items() if k in ("missing_keys", "unexpected_keys")},
            "seconds": time.perf_counter() - t0,
        }
    return {"type": None, "seconds": time.perf_counter() - t0}


def introspection(rank: int, world: int) -> dict[str, Any]:
    """is_fsdp_model / get_fsdp_parent / maybe_get_wrapped on FSDP2, FSDP1 and DDP models."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dcp_storage.fsdp import UnknownModuleError, get_fsdp_parent, is_fsdp_model, maybe_get_wrapped
    from dcp_storage_testing.models import build_model

    out: dict[str, Any] = {}
    m2 = meta_fsdp2()
    blocks_only = meta_fsdp2(root=False)
    f1 = fsdp1_model()
    plain = build_model(SEED, **SHAPE)
    ddp = DDP(plain)
    out["is_fsdp"] = {
        "fsdp2": is_fsdp_model(m2),
        "fsdp2_blocks_only": is_fsdp_model(blocks_only),
        "fsdp1": is_fsdp_model(f1),
        "plain": is_fsdp_model(plain),
        "ddp": is_fsdp_model(ddp),
    }
    inner1 = f1.module
    expected = {
        ("fsdp2", "blocks.0.attn_qkv"): (m2, m2.blocks[0]),
        ("fsdp2", "blocks.1.norm"): (m2, m2.blocks[1]),
        ("fsdp2", "blocks.1"): (m2, m2.blocks[1]),
        ("fsdp2", "blocks"): (m2, m2),
        ("fsdp2", "embed"): (m2, m2),
        ("fsdp2", ""): (m2, m2),
        ("fsdp2", "blocks.0._fsdp_wrapped_module.mlp_up"): (m2, m2.blocks[0]),
        ("blocks_only", "blocks.1.mlp_up"): (blocks_only, blocks_only.blocks[1]),
        ("blocks_only", "embed"): (blocks_only, None),
        ("blocks_only", "blocks"): (blocks_only, None),
        ("fsdp1", "blocks.0.attn_qkv"): (f1, inner1.blocks[0]),
        ("fsdp1", "_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.attn_qkv"): (f1, inner1.blocks[0]),
        ("fsdp1", "blocks.1"): (f1, inner1.blocks[1]),
        ("fsdp1", "head"): (f1, f1),
        ("plain", "blocks.0.attn_qkv"): (plain, None),
    }
    out["parent"] = {}
    for (kind, name), (model, want) in expected.items():
        got = get_fsdp_parent(name, model)
        out["parent"][f"{kind}:{name}"] = got is want
    try:
        get_fsdp_parent("blocks.7.attn_qkv", f1)
        out["unknown"] = None
    except UnknownModuleError as exc:
        out["unknown"] = str(exc)
    out["unwrap"] = {
        "fsdp1": maybe_get_wrapped(f1) is inner1 and type(inner1).__name__ == "TinyTransformer",
        "ddp": maybe_get_wrapped(ddp) is plain,
        "fsdp2": maybe_get_wrapped(m2) is m2,
    }
    out["compiled"] = None
    if rank == world - 1:  # torch.compile imports dynamo (seconds of CPU): one rank checks it
        compiled_plain, compiled_m2 = torch.compile(plain), torch.compile(m2)
        out["compiled"] = {
            "plain_is_not_fsdp": not is_fsdp_model(compiled_plain),
            "fsdp2_is_fsdp": is_fsdp_model(compiled_m2),
            "unwrap_plain": maybe_get_wrapped(compiled_plain) is plain,
            "unwrap_ddp": maybe_get_wrapped(torch.compile(ddp)) is plain,
            "unwrap_fsdp1": maybe_get_wrapped(torch.compile(f1)) is inner1,
            "unwrap_fsdp2": maybe_get_wrapped(compiled_m2) is m2,
            "parent_named_with_orig_mod": get_fsdp_parent("_orig_mod.blocks.0.mlp_up", compiled_m2) is m2.blocks[0],
            "parent_named_without": get_fsdp_parent("blocks.0.mlp_up", compiled_m2) is m2.blocks[0],
            "parent_plain": get_fsdp_parent("blocks.0", compiled_plain) is None,
        }
    return out


# ------------------------------------------------------------------------------------------ worlds
def world2(rank: int, world: int, files: dict[str, str]) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    from dcp_storage.fsdp import load_full_state_dict
    from dcp_storage.strategies import DeliveryStats

    ref = reference()
    out: dict[str, Any] = {"introspection": introspection(rank, world)}

    # Errors first, into one model: afterwards the same model must load correctly (nothing left in flight).
    target = meta_fsdp2()
    missing = {k: v for k, v in ref.items() if k != "head.weight"}
    bad_shape = dict(ref, **{"embed.weight": ref["embed.weight"][:-1]})
    bad_dtype = dict(ref, **{"head.weight": torch.zeros(ref["head.weight"].shape, dtype=torch.int32)})
    out["errors"] = {
        "missing": error_case(rank, target, missing),
        "unexpected": error_case(rank, target, dict(ref, **{"extra.bias": torch.zeros(3)})),
        "shape": error_case(rank, target, bad_shape),
        "dtype": error_case(rank, target, bad_dtype),
        "none_on_rank0": error_case(rank, target, None),
        "dtensor_values": error_case(rank, target, target.state_dict()),  # every rank: DTensors are not full
        "mid_transfer": error_case(rank, target, _FailsOnSecondRead(ref, "blocks.1.mlp_up.weight")),
        "url_missing_file": error_case(rank, target, files["missing"]),
        "url_shape": error_case(rank, target, files["bad_shape"]),
        "url_missing_key": error_case(rank, target, files["missing_key"]),
    }
    out["after_errors"] = load_in_memory(rank, world, target, ref)
    out["after_errors"]["mismatched"] = mismatched_fsdp2(target, ref)

    # The main case: a fresh meta model, rank 0 holds the state dict.
    model = meta_fsdp2()
    out["memory"] = load_in_memory(rank, world, model, ref, cpu_offload=True)
    out["memory"]["mismatched"] = mismatched_fsdp2(model, ref)
    out["memory"]["forward"] = forward_matches(model)
    out["memory"]["devices"] = sorted({str(t.device) for t in model.state_dict().values()})
    out["memory"]["expected"] = shard_bytes(ref, rank, world)
    out["memory"]["expected_per_rank"] = [shard_bytes(ref, r, world) for r in range(world)]

    # A bf16 state dict into the fp32 model: cast on rank 0, fp32 bytes on the wire.
    cast_model = meta_fsdp2()
    out["cast"] = load_in_memory(rank, world, cast_model, {k: v.to(torch.bfloat16) for k, v in ref.items()})
    out["cast"]["mismatched"] = mismatched_fsdp2(cast_model, {k: v.to(torch.bfloat16).float() for k, v in ref.items()})

    # From a torch.save file; only rank 0 names it.
    url_model = meta_fsdp2()
    out["url"] = load_in_memory(rank, world, url_model, files["full"])
    out["url"]["mismatched"] = mismatched_fsdp2(url_model, ref)
    out["url"]["forward"] = forward_matches(url_model)

    # FSDP1: in memory and from the file.
    for name, source in (("fsdp1_memory", ref), ("fsdp1_url", files["full"])):
        f1 = fsdp1_model()
        stats = DeliveryStats()
        load_full_state_dict(f1, source if rank == 0 else None, stats=stats)
        out[name] = {"mismatched": mismatched_fsdp1(f1, ref), "forward": forward_matches(f1), "stats": stats.as_dict()}
    return out


def world4(rank: int, world: int, files: dict[str, str]) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_storage.fsdp import load_full_state_dict

    ref = reference()
    out: dict[str, Any] = {}
    model = meta_fsdp2()
    out["memory"] = load_in_memory(rank, world, model, ref)
    out["memory"]["mismatched"] = mismatched_fsdp2(model, ref)
    out["memory"]["forward"] = forward_matches(model)
    out["memory"]["expected"] = shard_bytes(ref, rank, world)
    out["memory"]["expected_per_rank"] = [shard_bytes(ref, r, world) for r in range(world)]

    # HSDP: (Replicate, Shard(0)) over a 2x2 mesh: ranks r and r+2 hold the same blocks.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = meta_fsdp2(mesh)
    out["hsdp"] = load_in_memory(rank, world, hsdp, ref)
    out["hsdp"]["mismatched"] = mismatched_fsdp2(hsdp, ref)
    out["hsdp"]["expected"] = shard_bytes(ref, rank % 2, 2)

    url_model = meta_fsdp2()
    out["url"] = load_in_memory(rank, world, url_model, files["full"])
    out["url"]["mismatched"] = mismatched_fsdp2(url_model, ref)
    out["url"]["expected"] = shard_bytes(ref, rank, world)

    f1 = fsdp1_model()
    load_full_state_dict(f1, ref if rank == 0 else None)
    out["fsdp1"] = {"mismatched": mismatched_fsdp1(f1, ref), "forward": forward_matches(f1)}

    out["missing"] = error_case(rank, meta_fsdp2(), {k: v for k, v in ref.items() if k != "blocks.0.pos"})
    return out
