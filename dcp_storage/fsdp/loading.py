"""``load_full_state_dict``: a full (unsharded) state dict, held by rank 0 or stored at a URL, into an FSDP model.

What it does, per kind of model (every rank of the default process group calls it):

* **FSDP2** (``fully_shard``; also HSDP meshes, and plain modules): if any parameter or buffer is on the
  meta device, ``model.to_empty(device)`` first (``cpu_offload=True``: CPU; else the device mesh's device,
  the current CUDA device for ``"cuda"``), restoring non-persistent buffers, which no state dict holds
  (Llama's rotary ``inv_freq``): kept if they were real, else recomputed by their modules' initialisers,
  else NaN with a warning naming them (:mod:`.materialize`). The state dict's tensors (``DTensor`` local
  shards, unsharded buffers) share storage with the model, so they are filled in place.
* **FSDP1** (``FullyShardedDataParallel``): the model's state dict is taken under FSDP1's own
  ``StateDictType.SHARDED_STATE_DICT`` (``ShardedTensor`` local shards, one ``torch.chunk`` of dim 0 per
  rank), filled, and loaded back with ``model.load_state_dict`` in the same context. FSDP1 then
  writes its flat parameters itself (internally it all-gathers each parameter to do so; that is FSDP1's
  load path, not a broadcast of the checkpoint). FSDP1 models must already be materialised.

Sources:

* **a mapping** (on rank 0; other ranks pass ``None`` or ``{}``, and only rank 0's argument is used):
  rank 0 checks it against every rank's model, broadcasts the verdict (so errors raise on every rank
  before any tensor moves), then sends each rank only the blocks of each tensor that its local shards hold,
  point to point (:mod:`.scatter`);
* **a URL or path** (any fsspec URL; rank 0's argument is used): the format is detected on rank 0
  (``torch.save`` file, safetensors, DCP directory) and read with ``dcp.load`` into the sharded state dict:
  ``torch.save`` files through :class:`~dcp_storage.BroadcastingTorchSaveReader` (rank 0 reads, every
  rank receives its slices), others through :func:`~dcp_storage.open_reader`'s reader (every rank reads its
  own slices). The planner is a strict :class:`~dcp_storage.RemappingLoadPlanner` over the checkpoint's
  metadata (our torch.save reader has real metadata), so missing *and* unexpected keys are reported; pass
  ``planner=`` for another (``DynamicMetaLoadPlanner()``, or a ``KeyMap`` for prefixed checkpoints).

Values are cast to the model's dtypes (``dtype_policy``, default: within float/int/complex kinds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.planner import LoadPlanner

from dcp_storage import registry
from dcp_storage.errors import DcpStorageError
from dcp_storage.fsdp.local_shards import LocalShards, model_state_dict
from dcp_storage.fsdp.materialize import materialize_meta
from dcp_storage.fsdp.scatter import agree, scatter_full_state_dict
from dcp_storage.opening import detect_format, open_reader
from dcp_storage.planners import DtypePolicy, IncompatibleKeysError, RemappingLoadPlanner
from dcp_storage.strategies.group import GroupView, group_view
from dcp_storage.strategies.metadata_sharing import share_object
from dcp_storage.strategies.slice_delivery import DeliveryConfig, DeliveryStats

__all__ = ["load_full_state_dict"]

FullStateDict = Mapping[str, torch.Tensor] | str | os.PathLike[str] | None


def load_full_state_dict(
    model: nn.Module,
    full_sd: FullStateDict,
    cpu_offload: bool = False,
    *,
    storage_options: dict[str, Any] | None = None,
    planner: LoadPlanner | str | None = None,
    dtype_policy: DtypePolicy | None = None,
    delivery_config: DeliveryConfig | None = None,
    stats: DeliveryStats | None = None,
) -> nn.Module:
    """Load a full state dict into a (possibly meta-device, FSDP1/FSDP2-sharded) model; returns ``model``.

    Collective over the default process group (works without one, on a single process, too).

    Args:
        model: the model, FSDP2-sharded (possibly on the meta device), FSDP1-wrapped, or plain.
        full_sd: on rank 0, the full state dict (plain tensors, keys as the unwrapped model names them;
            ``_fsdp_wrapped_module.``/``_orig_mod.`` segments are ignored on both sides) or a checkpoint
            URL/path; other ranks' value is ignored (pass ``None``).
        cpu_offload: materialise meta tensors on the CPU (for FSDP2 ``CPUOffloadPolicy``) instead of the
            mesh's device. Tensors that are already materialised are filled where they are.
        storage_options: fsspec options for a URL (every rank passes its own).
        planner: URL sources only: the ``dcp.load`` planner (default ``RemappingLoadPlanner(strict=True)``), or
            the name of one registered under the ``dcp_storage.planners`` entry-point group.
        dtype_policy: which stored -> model dtype casts are accepted (default ``DtypePolicy.cast()``).
        delivery_config: in-flight byte bounds for rank 0's sends.
        stats: if given, filled with this rank's transfer counts (``bytes_received``, ``bytes_sent``,
            ``bytes_local``, ``sent_per_rank``, messages); for URLs read by one rank, the reader's.

    Raises (on every rank): :class:`~dcp_storage.fsdp.FullStateDictKeysError` (missing/unexpected keys;
    :class:`~dcp_storage.planners.IncompatibleKeysError` for URLs), :class:`~dcp_storage.ShapeMismatchError`,
    :class:`~dcp_storage.planners.DtypeMismatchError`, :class:`~dcp_storage.DcpStorageError` for a missing
    state dict on rank 0 or models that differ across ranks; a URL's read errors as its reader raises them.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_full_state_dict: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(cpu_offload, bool):
        raise TypeError(f"load_full_state_dict: cpu_offload must be a bool, got {type(cpu_offload).__name__}")
    policy = dtype_policy or DtypePolicy.cast()
    if not isinstance(policy, DtypePolicy):
        raise TypeError(f"dtype_policy must be a DtypePolicy, got {type(policy).__name__}")
    planner = _planner(planner)  # a registered name: refused here, on every rank alike, before any collective
    stats = stats if stats is not None else DeliveryStats()
    view = group_view(None)
    # One broadcast decides the source for everyone: rank 0's argument (and, for a URL, its format).
    source = share_object(lambda: _describe_source(full_sd, storage_options), group=view.group, src_rank=0)
    device = torch.device("cpu") if cpu_offload else _mesh_device(model, view)
    with contextlib.ExitStack() as stack:
        if source[0] == "memory":
            sd_box: list[tuple[dict[str, Any], bool]] = []

            def describe() -> LocalShards:
                materialize_meta(model, device)
                sd_box.append(stack.enter_context(model_state_dict(model)))
                return LocalShards.of(sd_box[0][0])

            scatter_full_state_dict(
                full_sd if view.rank == 0 else None, describe, view, stats, delivery_config or DeliveryConfig(), policy
            )
            state_dict, needs_load = sd_box[0]
        else:
            _, url, fmt = source
            failure: BaseException | None = None
            try:
                materialize_meta(model, device)
            except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
                failure = exc
            agree(failure, view)
            state_dict, needs_load = stack.enter_context(model_state_dict(model))
            _load_url(
                state_dict,
                url,
                fmt,
                storage_options,
                planner or RemappingLoadPlanner(strict=True, dtype_policy=policy),
                stats,
            )
        if needs_load:
            model.load_state_dict(state_dict)
    return model


def _planner(planner: LoadPlanner | str | None) -> LoadPlanner | None:
    """``planner``, or the registered planner it names (a class or factory is called with no arguments)."""
    if planner is None:
        return None
    accepts = lambda found: isinstance(found, LoadPlanner)  # noqa: E731
    return registry.instance("planners", planner, accepts, "planner must be a torch LoadPlanner")


def _describe_source(
    full_sd: FullStateDict, storage_options: dict[str, Any] | None
) -> tuple[str, str | None, str | None]:
    """Rank 0: ``("url", url, format name)`` or ``("memory", None, None)``."""
    if isinstance(full_sd, (str, os.PathLike)):
        url = os.fspath(full_sd)
        return ("url", url, detect_format(url, storage_options).name)
    return ("memory", None, None)


def _mesh_device(model: nn.Module, view: GroupView) -> torch.device:
    """Where meta tensors go: the device type of the first DTensor parameter's mesh, else the group's."""
    from torch.distributed.tensor import DTensor

    for tensor in (*model.parameters(), *model.buffers()):
        if isinstance(tensor, DTensor):
            kind = tensor.device_mesh.device_type
            return view.device if kind == view.device.type else torch.device(kind)
    return view.device


def _load_url(
    state_dict: dict[str, Any],
    url: str,
    fmt: str,
    storage_options: dict[str, Any] | None,
    planner: LoadPlanner,
    stats: DeliveryStats,
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = open_reader(url, format=fmt, storage_options=storage_options)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner)
    except CheckpointException as exc:
        first = _first_failure(exc)
        if first is None:
            raise
        raise first from exc
    delivered = getattr(reader, "delivery", None)
    if isinstance(delivered, DeliveryStats):
        for f in dataclasses.fields(DeliveryStats):
            setattr(stats, f.name, getattr(delivered, f.name))


def _first_failure(exc: BaseException) -> DcpStorageError | None:
    """The lowest rank's error inside a ``CheckpointException``, if it is one of ours (same on every rank)."""
    failures = getattr(exc, "failures", None) or {}
    for rank in sorted(failures):
        err = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(err, DcpStorageError):
            if hasattr(err, "add_note"):
                err.add_note(f"(raised on rank {rank} during dcp.load and reported on every rank)")
                if isinstance(err, IncompatibleKeysError):
                    err.add_note(
                        "load_full_state_dict: for a partial load pass planner=RemappingLoadPlanner(strict=False); "
                        "for renamed keys, RemappingLoadPlanner(KeyMap...)"
                    )
            return err
    return None
