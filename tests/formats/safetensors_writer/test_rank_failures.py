"""A streamed ``SafetensorsWriter`` save (``s3://``, moto) in which one rank fails, and subgroup saves.

A streamed save runs collectives in ``write_data`` (the digests are all-gathered, chunks go to the
coordinator). A rank whose planner fails in ``finish_plan`` skips its ``write_data`` (DCP goes straight to
gathering results), so before this test the others waited in those collectives for the process group's
timeout (30 minutes by default). Every rank must now raise, the original error, within
:data:`MAX_SECONDS` (the group's timeout is :data:`TIMEOUT_S`), nothing may look committed, and the group
must still save after.

The writer also ignored the save's ``process_group``: ranks 1 and 2 of 3, saving as a subgroup, ran the
chunk exchange on the default group and blocked on rank 0, which is not in the save. Here they save to
``s3://`` and to a local directory, and the files load back bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec

from dcp_storage_testing.compare import same_bits
from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.s3_server import MotoS3Server

from . import _rank_failure_fns as F
from ._helpers import read_checkpoint

TIMEOUT_S = 120.0  # the process group's collective timeout: a hang would show as this
MAX_SECONDS = 10.0
CASES = {  # name: (failing rank, step, checksum algorithm)
    "finish_plan-sender": (1, "finish_plan", "xxh3_64"),
    "finish_plan-coordinator": (0, "finish_plan", "xxh3_64"),
    "finish_plan-sender-nosums": (1, "finish_plan", None),
    "local_plan-sender": (1, "create_local_plan", "xxh3_64"),
    "write-sender-nosums": (1, "resolve_data", None),
    "write-coordinator": (0, "resolve_data", "xxh3_64"),
}


def _names(url: str, options: dict[str, Any]) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()
    return [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] if fs.exists(root) else []


def _bucket_of(url: str) -> str:
    return url.split("/")[2]


def _drop(moto_server: MotoS3Server, urls: list[str]) -> None:
    for url in urls:
        try:
            moto_server.delete_bucket(_bucket_of(url))
        except Exception:  # noqa: BLE001, S110 - cleanup must not mask the result
            pass


def _loads_back(url: str, options: dict[str, Any]) -> list[str]:
    tensors = read_checkpoint(url, options)["tensors"]
    ref = F.reference()
    bad = sorted(set(tensors) ^ set(ref))
    return bad + [k for k in sorted(set(tensors) & set(ref)) if not same_bits(tensors[k], ref[k])]


def test_a_rank_failing_in_a_streamed_save_fails_every_rank_within_seconds(moto_server: MotoS3Server) -> None:
    where = {
        name: moto_server.new_location(name[:20], skip_instance_cache=True, use_listings_cache=False) for name in CASES
    }
    after = moto_server.new_location("after", skip_instance_cache=True, use_listings_cache=False)
    warm = moto_server.new_location("warm", skip_instance_cache=True, use_listings_cache=False)
    cases: dict[str, dict[str, Any]] = {
        name: {
            "url": where[name].url,
            "options": where[name].storage_options,
            "rank": r,
            "step": s,
            "checksum_algorithm": a,
        }
        for name, (r, s, a) in CASES.items()
    }
    cases["after"] = {"url": after.url, "options": after.storage_options}
    cases["warm"] = {"url": warm.url, "options": warm.storage_options}
    try:
        reports = run_ranks(F.fail_each, 2, cases, timeout=TIMEOUT_S)
        problems = []
        for name in CASES:
            for rank, report in enumerate(reports):
                got = report[name]
                if not got["raised"]:
                    problems.append(f"{name} rank {rank}: saved")
                elif F.FAIL_TEXT not in got["text"]:
                    problems.append(f"{name} rank {rank}: raised without the original error: {got['text'][:600]}")
                if got["seconds"] >= MAX_SECONDS:
                    problems.append(f"{name} rank {rank}: took {got['seconds']:.1f} s")
            left = [
                n for n in _names(where[name].url, where[name].storage_options) if n.endswith((".safetensors", ".json"))
            ]
            if left:
                problems.append(f"{name}: looks committed: {left}")
        print({name: [round(r[name]["seconds"], 2) for r in reports] for name in CASES})
        assert not problems, "\n".join(problems)
        assert _loads_back(after.url, after.storage_options) == []
    finally:
        _drop(moto_server, [*(w.url for w in where.values()), after.url, warm.url])


def test_ranks_1_and_2_of_3_save_as_a_subgroup(moto_server: MotoS3Server, tmp_path: Path) -> None:
    s3 = moto_server.new_location("subgroup", skip_instance_cache=True, use_listings_cache=False)
    local = str(tmp_path / "subgroup")
    try:
        seconds = run_ranks(
            F.save_in_subgroup, 3, [1, 2], [(s3.url, s3.storage_options), (local, {})], timeout=TIMEOUT_S
        )
        assert seconds[0] is None  # rank 0 took no part, and ranks 1 and 2 did not wait for it
        assert _loads_back(s3.url, s3.storage_options) == []
        assert _loads_back(local, {}) == []
    finally:
        _drop(moto_server, [s3.url])
