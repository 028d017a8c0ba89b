"""A representative subset of the hostile corpus on 2 gloo ranks: every rank raises our error, none hangs.

A reader that fails on one rank only (or on the coordinator only, without telling its peers) leaves the
others waiting in a collective until the process group's timeout. Each rank here loads every case through
``open_reader`` and the format's reader class, one after the other in the same process group, so a case
that desynchronises the ranks also breaks the cases after it. ``run_ranks``' timeout is the collective
timeout too; each case must finish well within it (:data:`~.harness.MAX_SECONDS`).
"""

from __future__ import annotations

import os
import time

from dcp_storage_testing.distributed import run_ranks

from . import _rank_fns as R
from .corpus import Case
from .harness import MAX_SECONDS, Outcome, judge

WORLD = 2
COLLECTIVE_TIMEOUT_S = 90.0  # the whole call; each case must take < MAX_SECONDS on every rank
SUBSET = (
    "dcp/metadata-payload-p2",
    "dcp/metadata-path-url",
    "dcp/metadata-offset-negative",
    "dcp/metadata-shape-overflow",
    "dcp/metadata-overlapping-records",
    "dcp/record-payload-big",
    "dcp/record-shape-overflow",
    "dcp/byte-item-payload-raw-pickle-p0",
    "dcp_st/byte-item-payload",
    "dcp_st/blob-length-2^63",
    "dcp_st/metadata-path-parent",
    "st/header-length-2^63",
    "st/header-offsets-overlap",
    "st/header-dtype-unknown",
    "hf/index-path-url",
    "hf/index-names-missing-file",
    "hf/shard-length-past-end",
    "zip/payload",
    "zip/central-method-bzip2",
    "zip/shape-overflow",
    "legacy/payload",
    "legacy/plain",
    "dcp/byte-item-payload-text-int",
    "dcp/byte-item-payload-torchscript",
    "dcp_st/byte-item-payload-text-int",
    "dcp/metadata-state-enum-member-value",
    "dcp/metadata-bomb-BYTEARRAY8",
    "zip/data-pkl-state-rebuild-function-defaults",
)
# Byte items through Broadcasting(reader): the coordinator vets them before any rank's planner sees them.
BROADCAST_SUBSET = (
    "dcp/byte-item-payload",
    "dcp/byte-item-payload-raw-pickle-p0",
    "dcp/byte-item-payload-text-int",
    "dcp/byte-item-payload-torchscript",
    "dcp/byte-item-deep-nesting",
    "dcp/byte-item-deflated",
    "dcp_st/byte-item-payload-torchscript",
    "dcp_st/byte-item-payload-text-int",
    "dcp/metadata-state-class-bases",
)
PREFIXES = (
    "dcp/metadata-truncated-",
    "dcp/__0_0-distcp-truncated-",
    "st/model-safetensors-truncated-",
    "zip/model-pt-truncated-",
    "dcp_st/__0_0-distcp-random-",
)


def _subset(corpus: list[Case]) -> list[Case]:
    by_name = {c.name: c for c in corpus}
    chosen = [by_name[n] for n in SUBSET]
    for prefix in PREFIXES:  # the first of each seeded family of cases
        chosen.append(next(c for c in corpus if c.name.startswith(prefix)))
    return chosen


def test_every_rank_raises_our_error_without_hanging(corpus: list[Case]) -> None:
    cases = _subset(corpus)
    entries = ["open_reader", "reader_class"]
    start = time.monotonic()
    results = run_ranks(R.load_cases, WORLD, cases, entries, timeout=COLLECTIVE_TIMEOUT_S)
    elapsed = time.monotonic() - start
    failures = []
    for rank, outcomes in enumerate(results):
        assert len(outcomes) == len(cases) * len(entries)
        for case, raw in zip([c for c in cases for _ in entries], outcomes):
            why = judge(case, Outcome(**raw))
            if why is not None:
                failures.append(f"rank {rank} {case.name} [{raw['entry']}]: {why}")
    assert not failures, "\n".join(failures)
    markers = [c.marker for c in cases if c.marker and os.path.exists(c.marker)]
    assert not markers, f"payloads ran: {markers}"
    slowest = max(o["seconds"] for outcomes in results for o in outcomes)
    assert slowest < MAX_SECONDS, slowest
    assert elapsed < COLLECTIVE_TIMEOUT_S / 2, f"{len(cases)} cases took {elapsed:.1f}s on {WORLD} ranks"


def test_byte_items_through_broadcasting_on_every_rank(corpus: list[Case]) -> None:
    by_name = {c.name: c for c in corpus}
    cases = [by_name[n] for n in BROADCAST_SUBSET]
    results = run_ranks(R.load_cases, WORLD, cases, ["broadcasting"], timeout=COLLECTIVE_TIMEOUT_S)
    failures = [
        f"rank {rank} {case.name}: {why}"
        for rank, outcomes in enumerate(results)
        for case, raw in zip(cases, outcomes)
        if (why := judge(case, Outcome(**raw))) is not None
    ]
    assert not failures, "\n".join(failures)
    assert not [c.marker for c in cases if c.marker and os.path.exists(c.marker)], "payloads ran"
