"""A streamed (object-store) ``SafetensorsWriter`` save whose chunk fails on one rank, mid-exchange.

The writer's crash tests fail the first resolve, which with checksums on is the hash, before any chunk
moves. Here the failure comes at the resolve that sends (a sender) or uploads (the coordinator's own
chunk): with checksums on that is the second resolve, with them off the first. Every rank must raise,
promptly (no one waits for the process-group timeout), and nothing may look committed.
"""

from __future__ import annotations

from typing import Any

import fsspec

from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.s3_server import MotoS3Server

from . import _stream_failure_fns as F

CASES = {  # name: (failing rank, failing resolve, checksum algorithm)
    "sender-sums": (1, 2, "xxh3_64"),  # after the digests were exchanged: the sender announces FAILED
    "coordinator-nosums": (0, 1, None),  # the coordinator's own chunk, mid-upload: it drains the senders
}


def test_a_chunk_failing_on_one_rank_mid_exchange_fails_every_rank(moto_server: MotoS3Server) -> None:
    locations = {
        name: tuple(moto_server.new_location(name, skip_instance_cache=True, use_listings_cache=False))
        for name in CASES
    }
    cases = {name: (*locations[name], rank, nth, algo) for name, (rank, nth, algo) in CASES.items()}
    try:
        reports: list[dict[str, Any]] = run_ranks(F.fail_each, 2, cases, timeout=60.0)
        for name, (url, options) in locations.items():
            for rank, report in enumerate(reports):
                assert report[name]["raised"], f"{name}: rank {rank} did not fail"
                assert "simulated crash" in report[name]["message"], (name, rank, report[name]["message"])
            fs, root = fsspec.core.url_to_fs(url, **options)
            names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] if fs.exists(root) else []
            assert not [n for n in names if n.endswith((".safetensors", ".json"))], (name, names)
    finally:
        for url, _options in locations.values():
            try:
                moto_server.delete_bucket(url.split("/")[2])
            except Exception:  # noqa: BLE001, S110 - cleanup must not mask the result
                pass
