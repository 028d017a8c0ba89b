"""When one rank fails, or the ranks of one load disagree, every rank raises within seconds.

torch's own readers run no collective in ``read_data``, so a rank whose planner fails in ``finish_plan``
(DCP then skips its ``read_data`` and goes straight to gathering the results) costs the others nothing:
every rank raises in about 0.2 s. Ours do run collectives there (``read_once`` exchanges slices,
``Broadcasting`` sends them), so before this test the other ranks waited in them for the process group's
timeout (30 minutes by default). Likewise for a planner that drops items only on one rank, and for ranks
given different read strategies. The process group's timeout here is long (:data:`TIMEOUT_S`); every rank
must raise our error or the original one within :data:`MAX_SECONDS`, and the group must still work after.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from dcp_storage_testing.distributed import run_ranks

from . import _rank_failure_fns as F

WORLD = 2
TIMEOUT_S = 120.0  # the process group's collective timeout: a hang would show as this
MAX_SECONDS = 10.0

FAILS = F.FAIL_TEXT
DELIVERS = F.DELIVERY_TEXT
MISMATCH = "different read strategies"
MISREAD = "different readers"
CASES: dict[str, tuple[dict[str, Any], str]] = {  # name: (case, text every rank's error must hold)
    "read_once-fails-on-1": ({"readers": ["read_once"] * 2, "planner": "fails", "rank": 1}, FAILS),
    "read_once-fails-on-0": ({"readers": ["read_once"] * 2, "planner": "fails", "rank": 0}, FAILS),
    "per_host-fails-on-1": ({"readers": ["per_host"] * 2, "planner": "fails", "rank": 1}, FAILS),
    "safetensors-read_once-fails-on-1": (
        {"readers": ["safetensors:read_once"] * 2, "planner": "fails", "rank": 1},
        FAILS,
    ),
    "broadcasting-fails-on-1": ({"readers": ["broadcasting"] * 2, "planner": "fails", "rank": 1}, FAILS),
    "broadcasting-fails-on-0": ({"readers": ["broadcasting"] * 2, "planner": "fails", "rank": 0}, FAILS),
    "broadcasting-drops-on-1": ({"readers": ["broadcasting"] * 2, "planner": "drops", "rank": 1}, "finish_plan"),
    "read_once-drops-on-1": ({"readers": ["read_once"] * 2, "planner": "drops", "rank": 1}, "finish_plan"),
    # A rank failing inside read_data, while the bytes are delivered (the others may be sending to it).
    "read_once-resolve-fails-on-0": ({"readers": ["read_once"] * 2, "planner": "resolve-fails", "rank": 0}, DELIVERS),
    "per_host-resolve-fails-on-1": ({"readers": ["per_host"] * 2, "planner": "resolve-fails", "rank": 1}, DELIVERS),
    "broadcasting-commit-fails-on-1": (
        {"readers": ["broadcasting"] * 2, "planner": "commit-fails", "rank": 1},
        DELIVERS,
    ),
    "broadcasting-resolve-fails-on-0": (
        {"readers": ["broadcasting"] * 2, "planner": "resolve-fails", "rank": 0},
        DELIVERS,
    ),
    "safetensors-read_once-commit-fails-on-0": (
        {"readers": ["safetensors:read_once"] * 2, "planner": "commit-fails", "rank": 0},
        DELIVERS,
    ),
    # Memory running out on the rank that receives the packed slices as it makes a round ready: no rank posts it.
    "read_once-alloc-fails-on-0": (
        {"readers": ["read_once"] * 2, "planner": "alloc-fails", "rank": 0},
        "out of memory",
    ),
    # Broadcasting into destinations of another dtype, the cast's staging cannot be allocated on rank 1.
    "broadcasting-staging-fails-on-1": (
        {"readers": ["broadcasting"] * 2, "planner": "staging-fails", "rank": 1, "cast": True},
        "out of memory",
    ),
    # The coordinator's wrapped reader raises torch's CheckpointException (a BaseException) reading the metadata
    # it shares: the others waited in the broadcast before.
    "broadcasting-nested-base-exception": ({"readers": ["broadcasting-nested-fails"] * 2}, F.NESTED_TEXT),
    "read_once-vs-default": ({"readers": ["read_once", "default"]}, MISMATCH),
    "default-vs-read_once": ({"readers": ["default", "read_once"]}, MISMATCH),
    "per_host-vs-read_once": ({"readers": ["per_host", "read_once"]}, MISMATCH),
    "broadcasting-vs-read_once": ({"readers": ["broadcasting", "read_once"]}, MISREAD),
    "read_once-vs-broadcasting": ({"readers": ["read_once", "broadcasting"]}, MISREAD),
    "broadcasting-vs-default": ({"readers": ["broadcasting", "default"]}, MISREAD),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecWriter, SafetensorsWriter

    root: Path = tmp_path_factory.mktemp("rank_failures")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(F.reference(), storage_writer=FsspecWriter(str(root / "dcp")), no_dist=True)
        dcp.save(F.reference(), storage_writer=SafetensorsWriter(str(root / "st")), no_dist=True)
    return {"dcp": str(root / "dcp"), "st": str(root / "st")}


def test_every_rank_raises_within_seconds(paths: dict[str, str]) -> None:
    cases = {name: case for name, (case, _text) in CASES.items()}
    reports = run_ranks(F.run_cases, WORLD, paths, cases, timeout=TIMEOUT_S)
    problems = []
    for name, (case, text) in CASES.items():
        for rank, report in enumerate(reports):
            got = report[name]
            where = f"{name} rank {rank} ({got['seconds']:.2f} s)"
            if not got["raised"]:
                problems.append(f"{where}: did not raise (wrong tensors: {got['bad']})")
            elif text not in got["text"]:
                problems.append(f"{where}: raised without {text!r}: {got['text'][:600]}")
            if got["seconds"] >= MAX_SECONDS:
                problems.append(f"{where}: took {got['seconds']:.1f} s")
    print({name: [round(r[name]["seconds"], 2) for r in reports] for name in CASES})
    for rank, report in enumerate(reports):
        assert report["_after"]["bad"] == [], f"rank {rank}: the load after the cases went wrong"
        assert report["_after_broadcasting"]["bad"] == [], f"rank {rank}: the broadcast load after the cases"
    assert not problems, "\n".join(problems)


def test_the_mismatch_names_the_ranks_and_their_strategies(paths: dict[str, str]) -> None:
    cases = {"mixed": {"readers": ["read_once", "default", "per_host"]}}
    reports = run_ranks(F.run_cases, 3, paths, cases, timeout=TIMEOUT_S)
    for rank, report in enumerate(reports):
        text = report["mixed"]["text"]
        assert report["mixed"]["raised"], f"rank {rank} loaded"
        for named in ("rank 0: read_once", "rank 1: per_rank", "rank 2: per_host"):
            assert named in text, f"rank {rank}: {named!r} not in {text[:800]}"
