"""Loading into FSDP models: ``load_full_state_dict`` and materialising meta-device models.

Materialise a meta-device model completely: ``to_empty``, then put back what no state dict holds.

``model.to_empty(device=...)`` gives every parameter and buffer fresh, uninitialised memory. Parameters
and persistent buffers are then filled by the load; *non-persistent* buffers (``register_buffer(...,
persistent=False)``: Llama's rotary ``inv_freq``, causal masks, position tables) are in no state dict, so
nothing fills them, and a model computes silently wrong outputs from whatever the memory held.
:func:`materialize_meta` restores each of them, in this order:

1. **Kept**: a non-persistent buffer that is already real (a model built with buffers on a real device, as
   accelerate's ``init_empty_weights(include_buffers=False)`` does) is copied before ``to_empty`` and
   written back after it (what accelerate's FSDP2 preparation does).
2. **Recomputed by the module's own initialiser**: for a buffer that was on the meta device, its owning
   module's ``reset_parameters()`` (torch's convention for re-initialising a module after ``to_empty``),
   then the ``_init_weights(module)`` of its nearest ancestor that has one (Hugging Face
   ``PreTrainedModel``: it recomputes rotary ``inv_freq`` with the model's own rope function). Only modules
   owning such buffers are re-initialised (parameters they reset are overwritten by the load that follows).
   Before the initialisers run, floating buffers are filled with NaN and integer/bool ones with their
   largest value; a buffer counts as restored only if an initialiser replaced all of that.
3. **Otherwise**: it is left as NaN (floating buffers: any output computed from it shows it) and a warning
   names every such buffer and the ways to fix it.

``load_full_state_dict``: a full (unsharded) state dict, held by rank 0 or stored at a URL, into an FSDP model.

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
  own slices). The planner is a strict :class:`~dcp_storage.planners.RemappingLoadPlanner` over the checkpoint's
  metadata (our torch.save reader has real metadata), so missing *and* unexpected keys are reported; pass
  ``planner=`` for another (``DynamicMetaLoadPlanner()``, or a ``KeyMap`` for prefixed checkpoints).

Values are cast to the model's dtypes (``dtype_policy``, default: within float/int/complex kinds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.planner import LoadPlanner

from dcp_storage import registry
from dcp_storage._torch import buffers, non_persistent_buffer_names
from dcp_storage.errors import DcpStorageError
from dcp_storage.fsdp.local_shards import LocalShards, model_state_dict, uses_fsdp1
from dcp_storage.fsdp.scatter import agree, scatter_full_state_dict
from dcp_storage.opening import detect_format, open_reader
from dcp_storage.planners import DtypePolicy, IncompatibleKeysError, RemappingLoadPlanner
from dcp_storage.planners.key_map import format_keys
from dcp_storage.strategies.collectives import RANK_FAILURES, GroupView, group_view, share_object
from dcp_storage.strategies.slice_delivery import DeliveryConfig, DeliveryStats

__all__ = ["load_full_state_dict", "materialize_meta", "non_persistent_buffers"]


def materialize_meta(model: nn.Module, device: torch.device | str) -> list[str]:
    """If any parameter or buffer of ``model`` is on the meta device, ``to_empty`` it onto ``device`` and
    restore its non-persistent buffers (see the module docstring); return the names of those left unrestored.

    A drop-in for ``model.to_empty(device=...)`` before ``dcp.load`` (which fills only what a state dict
    holds). ``to_empty`` runs on the root, so FSDP2 re-registers its sharded parameters. FSDP1 models must be
    materialised when wrapped (``param_init_fn``/``device_id``); meta tensors there raise.
    """
    device = torch.device(device)
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return []
    if uses_fsdp1(model):
        raise DcpStorageError(
            "load_full_state_dict: an FSDP1 (FullyShardedDataParallel) model has parameters on the meta device; "
            "FSDP1 materialises them at wrap time: pass param_init_fn (or device_id) to FullyShardedDataParallel"
        )
    kept: dict[str, torch.Tensor] = {}
    on_meta: list[str] = []
    for name, _owner, buf in non_persistent_buffers(model):
        if buf.is_meta:
            on_meta.append(name)
        else:
            kept[name] = buf.detach().clone()
    model.to_empty(device=device)
    with torch.no_grad():
        for name, _owner, buf in non_persistent_buffers(model):
            if name in kept:
                buf.copy_(kept[name])
        left = _recompute(model, set(on_meta))
    if left:
        warnings.warn(
            f"non-persistent buffers {format_keys(left)} were on the meta device and no initialiser of their "
            "modules recomputed them (they are in no state dict, so no load fills them): floating ones are NaN. "
            "Build the model with buffers on a real device (parameters only on meta, as accelerate's "
            "init_empty_weights(include_buffers=False) does), give their modules a reset_parameters() that "
            "computes them, or set them after loading",
            stacklevel=2,
        )
    return left


def non_persistent_buffers(model: nn.Module) -> Iterator[tuple[str, nn.Module, torch.Tensor]]:
    """``(qualified name, owning module, buffer)`` of every non-persistent buffer of ``model``."""
    for prefix, module in model.named_modules():
        for name in non_persistent_buffer_names(module):
            buf = buffers(module).get(name)
            if buf is not None:
                yield (f"{prefix}.{name}" if prefix else name), module, buf


def _recompute(model: nn.Module, names: set[str]) -> list[str]:
    """Run the initialisers of the modules owning buffers ``names``; return the names still unrestored."""
    owners: dict[int, tuple[str, nn.Module, list[tuple[str, torch.Tensor]]]] = {}
    for name, owner, buf in non_persistent_buffers(model):
        if name in names:
            _fill_sentinel(buf)
            prefix = name.rsplit(".", 1)[0] if "." in name else ""
            owners.setdefault(id(owner), (prefix, owner, []))[2].append((name, buf))
    left: list[str] = []
    for prefix, owner, bufs in owners.values():
        for initialise in _initialisers(model, prefix, owner):
            try:
                initialise()
            except Exception as exc:  # noqa: BLE001 - a hook that cannot run here: try the next, and say so
                warnings.warn(
                    f"materialize_meta: {initialise.__qualname__} failed on {prefix!r}: {exc!r}", stacklevel=4
                )
            if all(_restored(buf) for _name, buf in bufs):
                break
        left += [name for name, buf in bufs if not _restored(buf)]
    return left


def _initialisers(model: nn.Module, prefix: str, owner: nn.Module) -> list[Any]:
    """The owner's ``reset_parameters``, then the nearest ancestor's ``_init_weights(owner)`` (transformers)."""
    hooks: list[Any] = []
    reset = getattr(owner, "reset_parameters", None)
    if callable(reset):
        hooks.append(reset)
    parts = prefix.split(".") if prefix else []
    for depth in range(len(parts), -1, -1):  # the owner itself first, then up to the root
        ancestor = model.get_submodule(".".join(parts[:depth]))
        init_weights = getattr(ancestor, "_init_weights", None)
        if callable(init_weights) and hasattr(ancestor, "config"):

            def run(fn: Any = init_weights) -> None:
                fn(owner)

            run.__qualname__ = f"{type(ancestor).__name__}._init_weights"
            hooks.append(run)
            break
    return hooks


def _fill_sentinel(buf: torch.Tensor) -> None:
    if buf.is_floating_point() or buf.is_complex():
        buf.fill_(float("nan"))
    elif buf.dtype == torch.bool:
        buf.fill_(True)
    else:
        buf.fill_(torch.iinfo(buf.dtype).max)


def _restored(buf: torch.Tensor) -> bool:
    if buf.numel() == 0:
        return True
    if buf.is_floating_point() or buf.is_complex():
        return not bool(torch.isnan(buf).any())
    sentinel = True if buf.dtype == torch.bool else torch.iinfo(buf.dtype).max
    return not bool((buf == sentinel).all())


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
    :class:`~dcp_storage.planners.IncompatibleKeysError` for URLs), :class:`~dcp_storage.errors.ShapeMismatchError`,
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
            except RANK_FAILURES as exc:  # raised on every rank by agree()
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
