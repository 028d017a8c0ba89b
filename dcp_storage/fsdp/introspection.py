"""Questions about wrapped models: is it FSDP, which FSDP unit owns a submodule, what is the user's module.

Wrappers this module sees through:

* FSDP1 (``FullyShardedDataParallel``): a wrapper module whose user module is its ``_fsdp_wrapped_module``
  child (``.module``), so wrapped names gain ``_fsdp_wrapped_module.`` segments;
* FSDP2 (``fully_shard``): no wrapper; the user's module *becomes* an ``FSDPModule`` (its class is swapped);
* DDP / DataParallel (``.module``), ``torch.compile`` (``OptimizedModule._orig_mod``), and activation
  checkpointing's ``CheckpointWrapper`` (``_checkpoint_wrapped_module``, only when resolving names).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.nn.parallel import DataParallel, DistributedDataParallel

from dcp_storage.fsdp.errors import UnknownModuleError

__all__ = ["get_fsdp_parent", "is_fsdp_model", "is_fsdp_unit", "maybe_get_wrapped", "set_wrapped_model"]

#: Child names that wrappers insert into module names; resolving a name looks through them.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def is_fsdp_unit(module: nn.Module) -> bool:
    """True for an FSDP1 wrapper or an FSDP2 module (the module itself, not its children)."""
    return isinstance(module, (FSDP1, FSDPModule))


def is_fsdp_model(model: nn.Module) -> bool:
    """True if ``model`` or any submodule is FSDP1-wrapped or an FSDP2 ``FSDPModule``.

    Looks through DDP and ``torch.compile`` wrappers too, since they hold the model as a submodule.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"is_fsdp_model expects an nn.Module, got {type(model).__name__}")
    return any(is_fsdp_unit(m) for m in model.modules())


def get_fsdp_parent(layer_name: str, model: nn.Module) -> nn.Module | None:
    """The FSDP unit that manages the submodule ``layer_name`` of ``model``, or None if none does.

    That is the closest FSDP-wrapped module on the path from ``model`` down to the named submodule,
    the submodule itself included: an FSDP2 ``FSDPModule``, or for FSDP1 the ``FullyShardedDataParallel``
    wrapper (not the user module inside it). ``layer_name`` may be written with or without FSDP1's
    ``_fsdp_wrapped_module.`` segments (and ``_orig_mod.`` / ``_checkpoint_wrapped_module.``); ``""`` is
    ``model`` itself. Raises :class:`~dcp_storage.fsdp.UnknownModuleError` (a ``LookupError``) for a name
    that is not a submodule.
    """
    for module in reversed(_module_path(model, layer_name)):
        if is_fsdp_unit(module):
            return module
    return None


def maybe_get_wrapped(model: nn.Module) -> nn.Module:
    """The innermost user module: unwraps FSDP1 (``.module``), DDP / DataParallel (``.module``) and
    ``torch.compile`` (``._orig_mod``), in any nesting. FSDP2 modules are the user's module and are returned
    as they are; a model without wrappers is returned unchanged."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        if isinstance(model, (FSDP1, DistributedDataParallel, DataParallel)):
            model = model.module
        elif _is_compiled(model):
            model = model._orig_mod
        else:
            break
    return model


def set_wrapped_model(state: Any, wrapped_model: nn.Module) -> None:
    """Set ``state.model = wrapped_model`` (e.g. a trainer state after wrapping its model in FSDP).

    Raises ``TypeError`` if ``state`` has no ``model`` attribute (nothing is added to objects that do not
    already hold a model) or if ``wrapped_model`` is not an ``nn.Module``.
    """
    if not isinstance(wrapped_model, nn.Module):
        raise TypeError(f"set_wrapped_model: wrapped_model must be an nn.Module, got {type(wrapped_model).__name__}")
    if not hasattr(state, "model"):
        raise TypeError(
            f"set_wrapped_model: {type(state).__name__} object has no 'model' attribute to set; pass the object "
            "that holds the model (an object with a .model attribute)"
        )
    state.model = wrapped_model


def _is_compiled(model: nn.Module) -> bool:
    # OptimizedModule can only exist once torch._dynamo is imported: do not import it ourselves.
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(model, dynamo.OptimizedModule)


def _module_path(model: nn.Module, name: str) -> list[nn.Module]:
    """Modules from ``model`` down to the one named ``name``, wrappers passed through included."""
    path = [model]
    current = model
    walked: list[str] = []
    for segment in (s for s in name.split(".") if s):
        if segment in WRAPPER_SEGMENTS and segment not in current._modules:
            continue  # a wrapper segment of a differently wrapped model: not part of the user's name
        while segment not in current._modules:
            inner = next((current._modules[w] for w in WRAPPER_SEGMENTS if current._modules.get(w) is not None), None)
            if inner is None:
                where = ".".join(walked) or "the model"
                children = ", ".join(repr(c) for c in _user_children(current)) or "none"
                raise UnknownModuleError(
                    f"{name!r} is not a submodule of {type(model).__name__}: {where} "
                    f"({type(current).__name__}) has no child {segment!r} (its children: {children})"
                )
            current = inner
            path.append(current)
        child = current._modules[segment]
        if child is None:
            raise UnknownModuleError(f"{name!r}: submodule {segment!r} of {'.'.join(walked) or 'the model'} is None")
        current = child
        path.append(current)
        walked.append(segment)
    return path


def _user_children(module: nn.Module) -> list[str]:
    """Child names, looking through wrapper children (what a user would type)."""
    names: list[str] = []
    for child_name, child in module._modules.items():
        if child_name in WRAPPER_SEGMENTS and child is not None:
            names.extend(_user_children(child))
        else:
            names.append(child_name)
    return names
