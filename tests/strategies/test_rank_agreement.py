"""The pieces of :mod:`dcp_storage.strategies.rank_agreement` that need no process group.

The multi-rank behaviour (every rank raises within seconds) is ``test_rank_failures.py``; here: the
coordinator's strategy check names every rank, a guard outside a distributed DCP call is never installed,
and a guard left on a planner by a load that failed in planning lets the next call through and goes away.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan

from dcp_storage import FsspecReader, FsspecWriter, ReadStrategies
from dcp_storage.errors import RankMismatchError
from dcp_storage.strategies.rank_agreement import (
    StrategyTag,
    _FinishPlanGuard,
    check_tags,
    guard_finish_plan,
    tag_plan,
)


def test_the_coordinator_names_every_rank_and_its_strategy() -> None:
    plans = [tag_plan(LoadPlan([]), "read_once"), tag_plan(LoadPlan([]), "per_rank"), LoadPlan([])]
    with pytest.raises(RankMismatchError) as caught:
        check_tags(plans, "read_once", untagged_ok=False)
    text = str(caught.value)
    assert "rank 0: read_once" in text and "rank 1: per_rank" in text
    assert "rank 2: no dcp_storage read strategy" in text


def test_matching_tags_are_taken_off_and_untagged_plans_pass_where_allowed() -> None:
    inner = object()
    plans = [tag_plan(LoadPlan([], storage_data=inner), "per_rank"), LoadPlan([], storage_data="other")]
    out = check_tags(plans, "per_rank", untagged_ok=True)
    assert out[0].storage_data is inner and out[1].storage_data == "other"
    assert not any(isinstance(p.storage_data, StrategyTag) for p in out)
    with pytest.raises(RankMismatchError):
        check_tags(plans, "per_rank", untagged_ok=False)


def test_no_guard_outside_a_distributed_dcp_call(tmp_path: Path) -> None:
    assert guard_finish_plan(lambda central: True) is False
    state = {"w": torch.arange(8.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FsspecWriter(str(tmp_path)), no_dist=True)
        planner = DefaultLoadPlanner()
        target = {"w": torch.zeros(8)}
        dcp.load(
            target,
            storage_reader=FsspecReader(str(tmp_path), read_strategy=ReadStrategies.read_once()),
            planner=planner,
            no_dist=True,
        )
    assert torch.equal(target["w"], state["w"])
    assert "finish_plan" not in vars(planner)


class _Wrapper:  # stands in for the _DistWrapper of a DCP call that is over
    pass


def test_a_stale_guard_lets_the_next_call_through_and_goes_away() -> None:
    planner = DefaultLoadPlanner()
    calls: list[object] = []
    gone = _Wrapper()
    vars(planner)["finish_plan"] = _FinishPlanGuard(planner, gone, None, lambda c: calls.append(c) or True, None)
    plan = LoadPlan([])
    assert planner.finish_plan(plan) is plan  # DefaultLoadPlanner's own: no agreement outside that call
    assert calls == [] and "finish_plan" not in vars(planner)


def test_a_guard_replacing_a_stale_one_restores_the_planners_own_attribute() -> None:
    planner = DefaultLoadPlanner()

    def own(central: LoadPlan) -> LoadPlan:
        return LoadPlan([], storage_data="own")

    vars(planner)["finish_plan"] = own
    first = _FinishPlanGuard(planner, _Wrapper(), None, lambda c: True, None)
    vars(planner)["finish_plan"] = first
    second = _FinishPlanGuard(planner, _Wrapper(), None, lambda c: True, None)
    vars(planner)["finish_plan"] = second
    assert planner.finish_plan(LoadPlan([])).storage_data == "own"
    assert vars(planner)["finish_plan"] is own
