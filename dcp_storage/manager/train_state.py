"""``TrainState``: a model, its optimizer, its scheduler and any other Stateful objects, as one torch
``Stateful`` for FSDP2, DDP and plain modules.

It goes through torch's ``get_state_dict`` / ``set_state_dict`` (``torch.distributed.checkpoint.state_dict``),
which give FSDP2 models and their optimizers sharded (DTensor) state dicts keyed by parameter names, so a
checkpoint restores at another world size, and strip DDP's ``module.`` prefixes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = ["TrainState"]


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class TrainState:
    """``TrainState(model, optimizer=None, scheduler=None, **extra)``: save it with
    ``CheckpointManager.save(step, TrainState(...))`` and restore it in place with ``restore``.

    ``extra`` values are Stateful objects (a ``StatefulDataLoader``, a step counter with
    ``state_dict``/``load_state_dict``) or tensors (restored in place).
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None, **extra: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TrainState: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"TrainState: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if scheduler is not None and not _is_stateful(scheduler):
            raise TypeError(f"TrainState: scheduler {type(scheduler).__name__} has no state_dict/load_state_dict")
        for name, value in extra.items():
            if not (_is_stateful(value) or isinstance(value, torch.Tensor)):
                raise TypeError(
                    f"TrainState: extra state {name!r} ({type(value).__name__}) is neither Stateful (state_dict and "
                    "load_state_dict) nor a tensor, so it could not be restored in place; wrap it in an object with "
                    "both methods"
                )
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extra = dict(extra)

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        else:
            state = {"model": get_model_state_dict(self.model)}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        for name, value in self.extra.items():
            state[name] = value if isinstance(value, torch.Tensor) else value.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.optimizer is not None:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optimizer"],
            )
        else:
            set_model_state_dict(self.model, state_dict["model"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        for name, value in self.extra.items():
            if isinstance(value, torch.Tensor):
                if state_dict[name] is not value:
                    with torch.no_grad():
                        value.copy_(state_dict[name])
            else:
                value.load_state_dict(state_dict[name])
