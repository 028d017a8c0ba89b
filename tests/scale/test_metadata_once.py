"""Metadata once per load: with a process group, each per-load file is fetched by one rank and shared.

Counted at the server (a counting :class:`FaultProxy` in front of moto), at 1, 2 and 4 gloo ranks, for
every reader: ``FsspecReader`` (and with ``verify=True``, which also needs the manifest), ``SafetensorsReader``
on a single file, an HF index and torch's DCP-safetensors layout, ``BroadcastingTorchSaveReader`` and
``Broadcasting`` around a reader. Each case loads its own copy of a checkpoint twice: a full load (every
rank's tensors bit-exact; ``.metadata``, the manifest and the index fetched once, each safetensors header
once) and a load of an empty state dict, every request of which is for a per-load file: those requests
must not grow with the world size. torch's per-rank fallback (``__{rank}.metadata`` of a save without
collectives) still loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dcp_storage_testing.distributed import run_ranks

from . import _metadata_fns as F
from .conftest import Counted

WORLDS = (1, 2, 4)
DEADLINE_S = 240.0

# Objects fetched once per load, whoever reads them (suffix -> which cases have one).
PER_LOAD_FILES = {
    "/.metadata": {"fsspec", "fsspec-verify", "safetensors-dcp", "broadcasting-fsspec"},
    "/.dcp_storage.json": {"fsspec", "fsspec-verify", "broadcasting-fsspec"},  # verified loads by default
    "/model.safetensors.index.json": {"safetensors-index", "broadcasting-safetensors"},
}


@pytest.fixture(scope="module")
def served(counted_s3: Counted, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """For each world size: the ranks' outcomes and the proxy's request log of that run.

    Every world's copies are uploaded first, in one batch (``upload_many``), then each world's ranks run with
    the proxy's counters reset."""
    sources = F.write_sources(str(tmp_path_factory.mktemp("sources")))
    runs: dict[int, tuple[dict[str, tuple[str, str]], dict[str, Any]]] = {}
    copies: list[tuple[str, str]] = []
    for world in WORLDS:
        base, options = counted_s3.location(f"w{world}")
        urls: dict[str, tuple[str, str]] = {}
        for name, (source, _make) in F.cases().items():
            full, meta = f"{base}/{name}/full", f"{base}/{name}/meta"
            copies += [(sources[source], full), (sources[source], meta)]
            urls[name] = (full, meta)
        # One s3fs instance per rank process for all its readers (a fresh one per reader re-reads botocore's
        # models, ~0.3 s each); listings stay uncached, so every request still reaches the proxy.
        options.pop("skip_instance_cache", None)
        runs[world] = (urls, options)
    counted_s3.upload_many(copies)
    out: dict[int, dict[str, Any]] = {}
    for world, (urls, options) in runs.items():
        counted_s3.proxy.reset_counters()
        outcomes = run_ranks(F.load_every_case, world, urls, options, timeout=DEADLINE_S)
        out[world] = {"outcomes": outcomes, "log": counted_s3.proxy.counters().log, "urls": urls}
    return out


def _requests(log: Any, url: str, method: str | None = "GET") -> list[tuple[str, str, int | None]]:
    prefix = "/" + url.split("://", 1)[1] + "/"
    return [entry for entry in log if entry[1].startswith(prefix) and (method is None or entry[0] == method)]


@pytest.mark.parametrize("world", WORLDS)
def test_every_reader_loads_bit_exactly(served: dict[int, dict[str, Any]], world: int) -> None:
    for rank, outcome in enumerate(served[world]["outcomes"]):
        failed = {name: result for name, result in outcome.items() if result != "ok"}
        assert not failed, f"rank {rank}/{world}: {failed}"


@pytest.mark.parametrize("world", WORLDS)
def test_per_load_files_are_fetched_once(served: dict[int, dict[str, Any]], world: int) -> None:
    run = served[world]
    for name in F.cases():
        full, _meta = run["urls"][name]
        gets = _requests(run["log"], full)
        for suffix, holders in PER_LOAD_FILES.items():
            fetched = sum(1 for _m, path, _first in gets if path.endswith(suffix))
            assert fetched == (1 if name in holders else 0), f"{name} at {world} ranks: {suffix} fetched {fetched}x"
        headers = [path for _m, path, first in gets if path.endswith(".safetensors") and first == 0]
        assert len(headers) == len(set(headers)), f"{name} at {world} ranks: a header fetched twice: {headers}"


@pytest.mark.parametrize("world", WORLDS[1:])
def test_metadata_requests_do_not_grow_with_ranks(served: dict[int, dict[str, Any]], world: int) -> None:
    """The empty-state-dict load: every request is metadata; as many at ``world`` ranks as at one."""
    for name in F.cases():
        alone = _requests(served[1]["log"], served[1]["urls"][name][1], method=None)
        many = _requests(served[world]["log"], served[world]["urls"][name][1], method=None)
        assert alone, f"{name}: the metadata-only load made no request at all"
        shape = sorted((m, p.split("/meta/", 1)[1], first) for m, p, first in many)
        assert shape == sorted((m, p.split("/meta/", 1)[1], first) for m, p, first in alone), (
            f"{name}: {len(many)} requests at {world} ranks, {len(alone)} at one"
        )


def test_torch_save_archive_is_read_once_per_load(served: dict[int, dict[str, Any]]) -> None:
    """The coordinator reads the archive directory once and each tensor once, whatever the world size."""
    counts = {world: len(_requests(served[world]["log"], served[world]["urls"]["torch-save"][0])) for world in WORLDS}
    assert len(set(counts.values())) == 1, counts


def test_rank_local_metadata_fallback_still_loads(counted_s3: Counted, tmp_path: Path) -> None:
    url, options = counted_s3.location("rank-local")
    options.pop("skip_instance_cache", None)  # one s3fs instance per rank (see ``served``)
    assert run_ranks(F.rank_local_round_trip, 2, url, options, timeout=DEADLINE_S) == ["ok", "ok"]
