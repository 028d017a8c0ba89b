"""DCP save/load through ``{"transport": "obstore"}``: bit-exact, interchangeable with the s3fs transport,
and across world sizes (2-rank save, 3-rank resharded load) in real gloo processes."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.models import reference_state_dict
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage_obstore import ObstoreTransport
from dcp_storage_obstore import _rank_checks as R

OBSTORE = {"transport": "obstore"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _state(seed: int) -> dict[str, Any]:
    sd: dict[str, Any] = dict(reference_state_dict(seed, vocab=300, dim=48, hidden=96, layers=2))
    sd["half"] = torch.randn(33, 7, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    sd["step"] = 1234
    return sd


def _roundtrip(url: str, save_options: dict[str, Any], load_options: dict[str, Any]) -> dict[str, int]:
    saved = _state(7)
    writer = FsspecWriter(url, save_options, overwrite=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(saved, storage_writer=writer, no_dist=True)
        out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in saved.items()}
        reader = FsspecReader(url, load_options)
        dcp.load(out, storage_reader=reader, no_dist=True)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(_bits(out[key]), _bits(value)), key
        else:
            assert out[key] == value, key
    return reader.counters


def test_roundtrip_bit_exact_through_obstore(s3_url: Any) -> None:
    url, options = s3_url
    counters = _roundtrip(url, {**options, **OBSTORE}, {**options, **OBSTORE})
    assert counters["requests"] > 0 and counters["bytes_read"] > 0 and counters["retries"] == 0


def test_checkpoints_interchange_with_the_s3fs_transport(s3_url: Any) -> None:
    url, options = s3_url
    _roundtrip(url + "/a", options, {**options, **OBSTORE})  # written by s3fs, read by obstore
    _roundtrip(url + "/b", {**options, **OBSTORE}, options)  # and the other way


def test_reader_given_an_obstore_transport(s3_url: Any) -> None:
    """``bind_transport`` finds the path through ``strip_url`` (the transport has no fsspec ``fs``)."""
    url, options = s3_url
    saved = {"w": torch.arange(12.0).reshape(3, 4)}
    transport, _ = ObstoreTransport.from_url(url, options)
    with transport, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(saved, storage_writer=FsspecWriter(url, options, overwrite=True, transport=transport), no_dist=True)
        out = {"w": torch.zeros(3, 4)}
        dcp.load(out, storage_reader=FsspecReader(url, options, transport=transport), no_dist=True)
    assert torch.equal(out["w"], saved["w"])


def test_save_two_ranks_load_three_ranks_resharded(s3_url: Any) -> None:
    url, options = s3_url
    so = {**options, **OBSTORE}
    saved = run_ranks(R.save_sharded, 2, url, so, timeout=120)
    assert all(r["transport"] == "ObstoreTransport" and r["counters"]["bytes_written"] > 0 for r in saved)
    loaded = run_ranks(R.load_resharded, 3, url, so, timeout=120)
    for rank, report in enumerate(loaded):
        assert report["transport"] == "ObstoreTransport"
        assert report["wrong"] == [], (rank, report["wrong"])
        assert report["counters"]["bytes_read"] >= report["needed"] > 0


def _race_two_saves(url: str, options: dict[str, Any], states: list[dict[str, Any]]) -> list[Any]:
    """Two ``dcp.save`` calls released together; per save ``"ok"`` or the failures' class names."""
    outcomes: list[Any] = [None, None]
    barrier = threading.Barrier(2)

    def save(who: int) -> None:
        barrier.wait()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(states[who], storage_writer=FsspecWriter(url, {**options, **OBSTORE}), no_dist=True)
            outcomes[who] = "ok"
        except CheckpointException as exc:
            outcomes[who] = [type(e).__name__ for e, _ in exc.failures.values()]

    threads = [threading.Thread(target=save, args=(who,)) for who in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return outcomes


def test_two_saves_through_obstore_one_wins(s3_url: Any) -> None:
    """The claim (``.dcp_storage.lock``) goes through obstore's ``PutMode.Create``: of two saves racing to
    one prefix, 5 rounds, exactly one succeeds and the checkpoint is the winner's, bit-exact."""
    url, options = s3_url
    for k in range(5):
        here, states = f"{url}/round{k}", [_state(10 * k + who) for who in range(2)]
        outcomes = _race_two_saves(here, options, states)
        assert sorted(map(str, outcomes)) == sorted(["ok", str(["CheckpointExistsError"])]), outcomes
        winner = states[outcomes.index("ok")]
        out = {key: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for key, v in winner.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, storage_reader=FsspecReader(here, {**options, **OBSTORE}, verify=True), no_dist=True)
        for key, value in winner.items():
            assert torch.equal(_bits(out[key]), _bits(value)) if isinstance(value, torch.Tensor) else out[key] == value
