"""Each stored byte read once per job: ranks that need the same bytes split the reading and exchange.

At 4 gloo ranks, from ``s3://`` (moto) and ``gs://`` (fake-gcs-server), each behind a counting
:class:`FaultProxy`: DDP-replicated plain tensors, HSDP-like DTensors on a 2x2 mesh (``Replicate, Shard(0)``)
and a mixed state dict (HSDP weights, replicated norms and biases, a non-tensor value), every rank
bit-exact, and the bytes the *server* sent at most 1.05x the checkpoint. The same DDP load with
``per_rank`` reads it about 4x (what ``read_once`` is for); ``per_host`` with two fake hosts of two ranks
reads it about twice. A storage failure on one reading rank reaches every rank as an error, with no hang.

Limits are small (2 MiB rounds, 1 MiB row blocks) so this 7 MiB checkpoint takes several rounds, splits
its big tensor among all replicas and packs its small ones. All the loads of one store run in one
``run_ranks`` call; each case reads its own copy of the checkpoint, so the proxy's per-object counts say
which case fetched what.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from dcp_storage_testing.distributed import run_ranks

from . import _read_once_fns as F
from .conftest import Counted

WORLD = 4
DEADLINE_S = 300.0
LIMIT = 1.05  # bytes served / checkpoint bytes, for read_once

S3_CASES = {  # name -> (kind, layout, strategy, hosts)
    "ddp": ("dcp", "ddp", "read_once", None),
    "hsdp": ("dcp", "hsdp", "read_once", None),
    "mixed": ("dcp", "mixed", "read_once", None),
    "safetensors-ddp": ("safetensors", "ddp", "read_once", None),
    "default-ddp": ("dcp", "ddp", "default", None),
    "per-rank-ddp": ("dcp", "ddp", "per_rank", None),
    "per-host-ddp": ("dcp", "ddp", "per_host", ["a", "a", "b", "b"]),
    "broadcasting-ddp": ("broadcasting", "ddp", None, None),
}
GS_CASES = {name: S3_CASES[name] for name in ("ddp", "hsdp", "mixed")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecWriter, SafetensorsWriter

    root: Path = tmp_path_factory.mktemp("read_once")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(F.reference(), storage_writer=FsspecWriter(str(root / "dcp")), no_dist=True)
        dcp.save(F.reference(with_value=False), storage_writer=SafetensorsWriter(str(root / "st")), no_dist=True)
    return {"dcp": str(root / "dcp"), "safetensors": str(root / "st")}


def _size(local: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _dirs, files in os.walk(local) for f in files)


def _under(path: str, url: str) -> bool:
    """Whether a request path (URL-decoded) names an object under ``url``: ``/bucket/key/...`` on S3,
    ``.../b/bucket/o/key/...`` in the GCS JSON API."""
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return path.startswith(f"/{bucket}/{key}/") or f"/b/{bucket}/o/{key}/" in path


def _source(kind: str) -> str:
    return "safetensors" if kind == "safetensors" else "dcp"


def _run(store: Counted, sources: dict[str, str], cases: dict[str, tuple[Any, ...]]) -> dict[str, dict[str, Any]]:
    base, options = store.location("ckpts")
    specs, urls = [], {}
    store.upload_many([(sources[_source(kind)], f"{base}/{name}") for name, (kind, *_rest) in cases.items()])
    for name, (kind, layout, strategy, hosts) in cases.items():
        url = f"{base}/{name}"
        case_options = dict(options)
        # One client instance per rank for its cases (a fresh one per reader re-reads botocore's models, ~0.3 s
        # each); listings stay uncached, so every request still reaches the proxy.
        case_options.pop("skip_instance_cache", None)
        if strategy == "default":  # the reader's own choice for an object store, no argument given
            strategy = None
        specs.append(
            {"kind": kind, "layout": layout, "url": url, "options": case_options, "strategy": strategy, "hosts": hosts}
        )
        urls[name] = url
    store.proxy.reset_counters()
    per_rank = run_ranks(F.load_cases, WORLD, specs, timeout=DEADLINE_S)
    log_bytes = store.proxy.counters().by_path
    out = {}
    for index, (name, (kind, *_rest)) in enumerate(cases.items()):
        mine = {key: value for key, value in log_bytes.items() if _under(key[1], urls[name])}
        served = sum(b for (method, _path), (_n, b) in mine.items() if method == "GET")
        out[name] = {
            "served": served,
            "requests": {m: sum(n for (method, _p), (n, _b) in mine.items() if method == m) for m in ("GET", "HEAD")},
            "ratio": served / _size(sources[_source(kind)]),
            "bad": {rank: per_rank[rank][index]["bad"] for rank in range(WORLD) if per_rank[rank][index]["bad"]},
            "read": [per_rank[rank][index]["counters"]["bytes_read"] for rank in range(WORLD)],
        }
    return out


@pytest.fixture(scope="module")
def s3_results(counted_s3: Counted, sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    return _run(counted_s3, sources, S3_CASES)


@pytest.fixture(scope="module")
def gs_results(counted_gcs: Counted, sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    return _run(counted_gcs, sources, GS_CASES)


def _check_once(result: dict[str, Any], where: str) -> None:
    assert result["bad"] == {}, f"{where}: tensors differ from the reference: {result['bad']}"
    assert 0.99 <= result["ratio"] <= LIMIT, f"{where}: the server sent {result['ratio']:.3f}x the checkpoint"
    reads = result["read"]
    assert max(reads) <= 1.5 * sum(reads) / len(reads), f"{where}: reading is not balanced: {reads}"


@pytest.mark.parametrize("case", ["ddp", "hsdp", "mixed", "safetensors-ddp", "default-ddp"])
def test_s3_each_byte_is_served_once(s3_results: dict[str, dict[str, Any]], case: str) -> None:
    _check_once(s3_results[case], f"s3 {case}")


@pytest.mark.parametrize("case", sorted(GS_CASES))
def test_gs_each_byte_is_served_once(gs_results: dict[str, dict[str, Any]], case: str) -> None:
    _check_once(gs_results[case], f"gs {case}")


def test_per_rank_reads_serve_every_replica(s3_results: dict[str, dict[str, Any]]) -> None:
    """What ``read_once`` saves: four DDP ranks reading for themselves fetch the checkpoint four times."""
    result = s3_results["per-rank-ddp"]
    assert result["bad"] == {}
    assert 3.9 <= result["ratio"] <= 4.2, result["ratio"]


def test_broadcasting_reads_replicated_slices_once(s3_results: dict[str, dict[str, Any]]) -> None:
    """``Broadcasting``'s coordinator reads a slice that several ranks need once and sends it to each."""
    result = s3_results["broadcasting-ddp"]
    assert result["bad"] == {}
    assert result["ratio"] <= LIMIT, result["ratio"]
    assert result["read"][1:] == [0] * (WORLD - 1), result["read"]


def test_per_host_reads_once_per_host(s3_results: dict[str, dict[str, Any]]) -> None:
    result = s3_results["per-host-ddp"]
    assert result["bad"] == {}
    assert 1.9 <= result["ratio"] <= 2.1, result["ratio"]


@pytest.mark.parametrize(
    ("case", "strategy", "shard"),
    [
        ("per-rank-ddp", "per_rank", 1),
        ("ddp", "read_once", 1),
        ("hsdp", "read_once", 2),
        ("per-host-ddp", "per_host", 1),
        ("broadcasting-ddp", "broadcasting", 1),
    ],
)
def test_the_request_model_agrees_with_the_server(
    s3_results: dict[str, dict[str, Any]], sources: dict[str, str], case: str, strategy: str, shard: int
) -> None:
    """``benchmarks/scale_model.py``'s counts, from the library's own planning without processes, against what
    the server saw at 4 ranks: GET requests and bytes served within 5%, HEAD requests too."""
    from dcp_storage.formats.dcp_native.native import read_metadata_file
    from dcp_storage.inspection.request_model import JobLayout, ModelConfig, model_load
    from dcp_storage.strategies.read_once_plan import ReadOnceConfig
    from dcp_storage.transports import FsspecTransport

    transport, root = FsspecTransport.from_url(sources["dcp"])
    metadata = read_metadata_file(transport, transport.join(root, ".metadata"))
    settings = F._strategy(strategy).config if strategy in ("read_once", "per_host") else ReadOnceConfig()
    model = model_load(
        metadata, JobLayout(WORLD, gpus_per_host=2, shard=shard), [strategy], ModelConfig(read_once=settings)
    )[strategy]
    seen = s3_results[case]
    assert model.gets == pytest.approx(seen["requests"]["GET"], rel=0.05), (model.gets, seen["requests"])
    assert model.heads == pytest.approx(seen["requests"]["HEAD"], rel=0.05), (model.heads, seen["requests"])
    assert model.bytes == pytest.approx(seen["served"], rel=0.05), (model.bytes, seen["served"])


def test_a_reading_rank_s_failure_reaches_every_rank(counted_s3: Counted, sources: dict[str, str]) -> None:
    url, options = counted_s3.location("failing")
    counted_s3.upload(sources["dcp"], url)
    outcomes = run_ranks(F.fail_on_one_rank, WORLD, url, options, timeout=DEADLINE_S)
    for rank, outcome in enumerate(outcomes):
        assert "injected failure on rank 1" in outcome, f"rank {rank}: {outcome}"
