"""Materialise a meta-device model completely: ``to_empty``, then put back what no state dict holds.

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
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dcp_storage.errors import DcpStorageError
from dcp_storage.fsdp.local_shards import uses_fsdp1
from dcp_storage.planners.errors import format_keys

__all__ = ["materialize_meta", "non_persistent_buffers"]


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
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
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
