"""When one rank fails, every rank raises: agreement before a collective that other ranks may never enter.

DCP drives every step of a load or save through its ``_DistWrapper``, which gathers each rank's result or
error, so a reader whose steps run no collectives of their own (torch's) fails on every rank at once. Ours
do run collectives in ``read_data`` (``read_once`` exchanges slices, ``Broadcasting`` sends them) and in
``write_data`` (a streamed :class:`~dcp_storage.SafetensorsWriter` save sends chunks to the coordinator).
Two things could leave the other ranks waiting there for the process group's timeout (30 minutes by
default); this module handles both:

* **A rank that never arrives.** DCP calls ``planner.finish_plan(central_plan)`` on every rank, then the
  reader's ``read_data`` (the writer's ``write_data``). When ``finish_plan`` raises, DCP skips that rank's
  ``read_data`` and goes straight to its final gather, while the others enter our collectives.
  :func:`guard_finish_plan` (called by a reader or writer in ``prepare_local_plan``, on every rank) puts a
  guard in front of the running planner's ``finish_plan`` for this one call: after the planner's own
  ``finish_plan`` (and a check of its result), every rank takes part in one :func:`agree`, a one-element
  ``all_reduce`` of a failure flag (the error messages are gathered only when a rank failed), so every
  rank raises: the failed rank its own error, the others the same class and message (see
  :mod:`.metadata_sharing`). The guard is an attribute of the planner object, removed when it runs; a
  guard left by a load that failed earlier, in planning, lets the next call through untouched.
* **Ranks that disagree.** Ranks given different read strategies would run different collectives. Each
  rank's strategy tags its local plan with its name (:func:`tag_plan`); the coordinator, which sees every
  plan in ``prepare_global_plan``, compares them (:func:`check_tags`) and raises
  :class:`~dcp_storage.errors.RankMismatchError` naming each rank and its strategy, which DCP hands to
  every rank. That costs no collective: the plans travel anyway.

The cost, on success: one small ``all_reduce`` per load (per save) where the read (write) step has
collectives, nothing where it has none (``per_rank``, local safetensors saves).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dcp_storage._torch import current_call
from dcp_storage.errors import RankMismatchError
from dcp_storage.strategies.collectives import (
    RANK_FAILURES,
    GroupView,
    decode_error,
    encode_error,
    group_view,
    load_group,
    works_alone,
)

__all__ = ["StrategyTag", "agree", "check_tags", "guard_finish_plan", "tag_plan"]

#: Checks a rank's plan after ``finish_plan``: ``(central_plan, final_plan, view)``; raises to fail every rank.
PlanCheck = Callable[[Any, Any, GroupView], None]
_ABSENT = object()


def agree(view: GroupView, failure: BaseException | None) -> None:
    """Every rank raises if any rank failed: its own error, or the first failed rank's (collective; a single
    process just raises its own)."""
    import torch.distributed as dist

    if not view.distributed or view.world == 1:
        if failure is not None:
            raise failure
        return

    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int64, device=view.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=view.group)
    if not int(flag.item()):
        return
    infos: list[Any] = [None] * view.world
    dist.all_gather_object(infos, None if failure is None else encode_error(failure, view.rank), group=view.group)
    if failure is not None:
        raise failure
    raise decode_error(next(info for info in infos if info is not None))


# ------------------------------------------------------------------------------------------ finish_plan
class _FinishPlanGuard:
    """The planner's ``finish_plan`` for one DCP call, followed by :func:`agree` (see the module docstring)."""

    def __init__(self, planner: Any, wrapper: Any, group: Any, needed: Callable[[Any], bool], check: PlanCheck | None):
        self.planner = planner
        before = planner.__dict__.get("finish_plan", _ABSENT)
        self.before = before.before if isinstance(before, _FinishPlanGuard) else before  # replace a stale guard
        try:
            self.call: Callable[[], Any] = weakref.ref(wrapper)
        except TypeError:  # a _DistWrapper without weak references: hold it until this guard runs
            self.call = lambda: wrapper
        self.group = group
        self.needed = needed
        self.check = check

    def remove(self) -> None:
        if self.planner.__dict__.get("finish_plan") is self:
            if self.before is _ABSENT:
                del self.planner.__dict__["finish_plan"]
            else:
                self.planner.__dict__["finish_plan"] = self.before

    def __call__(self, central_plan: Any) -> Any:
        self.remove()
        finish = self.planner.finish_plan  # the planner's own, now that the guard is gone
        call = current_call()
        if call is None or not call.distributed or call.wrapper is not self.call() or not self.needed(central_plan):
            return finish(central_plan)  # another call (this guard is stale), or one without our collectives
        view = group_view(load_group(self.group))
        if view.world == 1:
            return finish(central_plan)
        failure: BaseException | None = None
        final = None
        try:
            final = finish(central_plan)
            if self.check is not None:
                self.check(central_plan, final, view)
        except RANK_FAILURES as exc:  # every rank must hear of it, then it is raised
            failure = exc
        agree(view, failure)
        return final


def guard_finish_plan(needed: Callable[[Any], bool], check: PlanCheck | None = None, *, group: Any = None) -> bool:
    """Guard the running DCP call's ``finish_plan`` (call it on every rank, in ``prepare_local_plan``).

    ``needed(central_plan)`` says whether this rank's next step runs collectives (the same answer on every
    rank: the coordinator planned for all); only then do the ranks agree. ``check`` vets the plan that
    ``finish_plan`` returned (a :class:`~dcp_storage.errors.RankMismatchError` for a plan the others cannot
    serve). ``group``: the reader's or writer's process group (``None``: the DCP call's). Returns whether a
    guard is in place (not without a distributed DCP call, nor for a planner without an instance ``__dict__``).
    """
    if works_alone():
        return False
    call = current_call()
    if call is None or not call.distributed or call.planner is None or call.wrapper is None:
        return False
    attrs = getattr(call.planner, "__dict__", None)
    if not isinstance(attrs, dict):
        return False
    attrs["finish_plan"] = _FinishPlanGuard(call.planner, call.wrapper, group, needed, check)
    return True


# ------------------------------------------------------------------------------------------ strategies
@dataclass(frozen=True)
class StrategyTag:
    """A local plan's ``storage_data`` while it travels to the coordinator: the rank's read strategy (its
    ``name``) and what the strategy itself put there (``inner``)."""

    name: str
    inner: Any = None


def tag_plan(plan: Any, name: str) -> Any:
    """``plan`` with its ``storage_data`` wrapped in a :class:`StrategyTag` called ``name``."""
    return dataclasses.replace(plan, storage_data=StrategyTag(name, plan.storage_data))


def check_tags(plans: Sequence[Any], mine: str, *, untagged_ok: bool) -> list[Any]:
    """The coordinator's check: every rank's plan must carry ``mine``; returns the plans untagged.

    ``untagged_ok``: a plan without a tag (a reader of another kind, or a plugin's strategy) is accepted
    (for strategies whose read step runs no collective). Raises :class:`~dcp_storage.errors.RankMismatchError`
    naming every rank's strategy otherwise.
    """
    names = [p.storage_data.name if isinstance(p.storage_data, StrategyTag) else None for p in plans]
    if any(n != mine and (n is not None or not untagged_ok) for n in names):
        listed = ", ".join(f"rank {r}: {n or 'no dcp_storage read strategy'}" for r, n in enumerate(names))
        raise RankMismatchError(
            f"the ranks of this load read with different read strategies ({listed}); the coordinator plans for "
            f"{mine}, and ranks that read otherwise would wait in collectives the others never enter: give every "
            "rank the same reader and read_strategy"
        )
    return [
        dataclasses.replace(p, storage_data=p.storage_data.inner) if n is not None else p for p, n in zip(plans, names)
    ]
