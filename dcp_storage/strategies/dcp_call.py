"""What the running ``dcp.load`` decided but tells no reader: whether it runs distributed, and its planner.

``dcp.load(..., no_dist=True)`` (and any load without an initialised process group) runs every step on
the calling process alone: the usual ``if rank == 0: dcp.load(..., no_dist=True)`` of export and eval
code, or every rank loading a full copy. A reader that runs a collective then (a metadata broadcast, slices
sent point to point) waits forever for ranks that are not loading, or that load on their own.

DCP does not say so in time. ``read_metadata()``, the first step and the one that shares metadata, gets
no arguments; ``set_up_storage_reader(metadata, is_coordinator)`` gets ``is_coordinator=True`` on every
rank under ``no_dist``, which on rank 0 looks exactly like a distributed load; ``prepare_global_plan``
sees one plan instead of one per rank, but runs only on the coordinator, after the metadata step. What
does say it is DCP's own ``_DistWrapper`` (``torch.distributed.checkpoint.utils``): ``_load_state_dict``
builds one per call, ``_DistWrapper(process_group, not no_dist, coordinator_rank)``, keeps it in its local
``distW`` and drives every reader step from there. :func:`current_call` finds it in the calling frames
(only frames of ``torch.distributed.checkpoint`` modules are looked at), with the call's planner, whose
``set_up_planner`` has already run when the reader is set up (see :mod:`dcp_storage.planners.key_check`).
torch has built its loads this way since DCP's first release; if a future torch stops doing so,
:func:`current_call` returns ``None`` and readers fall back to what they did before: a process group of
more than one rank means a distributed load.

:func:`working_alone` is the other signal: a strategy that calls the reader it wraps on one rank only
(:class:`~dcp_storage.strategies.Broadcasting`) runs those calls inside it, so the wrapped reader, which
sees the same distributed DCP call on the stack, does not start collectives of its own.

The call's process group matters too: a reader built without one (``process_group=None``) runs its
collectives on the group ``dcp.load`` was given (:func:`load_group`), not on the default group.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dcp_storage.strategies.group import SOLO, GroupView, group_view

__all__ = ["DcpCall", "current_call", "load_group", "load_view", "running_planner", "working_alone", "works_alone"]

_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("dcp_storage_working_alone", default=False)
_MAX_FRAMES = 64  # dcp.load -> _load_state_dict -> reduce_scatter -> local_step -> a reader: a dozen at most
_DCP_MODULES = "torch.distributed.checkpoint"


@dataclass(frozen=True)
class DcpCall:
    """The DCP call a reader is serving: ``distributed`` is ``False`` under ``no_dist``."""

    distributed: bool
    group: Any  # the call's process group; None: the default group
    planner: Any  # the call's LoadPlanner (or SavePlanner), when found
    wrapper: Any = field(default=None, compare=False, repr=False)  # the call's _DistWrapper: which call it is


def current_call() -> DcpCall | None:
    """The innermost running DCP load or save, from its ``_DistWrapper``; ``None`` outside one."""
    try:
        from torch.distributed.checkpoint.utils import _DistWrapper
    except ImportError:  # a torch without it: no signal, readers keep their process-group rule
        return None
    frame = sys._getframe(1)
    planner: Any = None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        if str(frame.f_globals.get("__name__", "")).startswith(_DCP_MODULES):
            local_vars = frame.f_locals
            if planner is None:
                planner = local_vars.get("planner")
            wrapper = local_vars.get("distW")
            if not isinstance(wrapper, _DistWrapper):
                wrapper = local_vars.get("self")
            if isinstance(wrapper, _DistWrapper):
                return DcpCall(bool(wrapper.use_dist), wrapper.group, planner, wrapper)
        frame = frame.f_back
    return None


def running_planner() -> Any:
    """The planner of the running DCP call, or ``None``."""
    call = current_call()
    return None if call is None else call.planner


def works_alone() -> bool:
    """Whether this process must not run collectives now: ``no_dist``, or inside :func:`working_alone`."""
    if _ALONE.get():
        return True
    call = current_call()
    return call is not None and not call.distributed


def load_group(group: Any = None) -> Any:
    """``group``, or when it is ``None`` the running DCP call's process group (``None``: the default group).

    A reader built without a group serves the ``dcp.load(..., process_group=...)`` it is passed to: its
    collectives must run on that group, or ranks outside it wait for them forever.
    """
    if group is not None:
        return group
    call = current_call()
    return None if call is None else call.group


def load_view(group: Any = None) -> GroupView:
    """:func:`~.group.group_view` of :func:`load_group`, or :data:`SOLO` when this process works alone."""
    return SOLO if works_alone() else group_view(load_group(group))


@contextlib.contextmanager
def working_alone() -> Iterator[None]:
    """Readers called inside run no collectives (a strategy calling its wrapped reader on one rank)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)
