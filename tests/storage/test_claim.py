"""The lock a save holds (``dcp_storage.formats.commit_claim``): the interleavings a thread race rarely hits.

``tests/conformance/test_races.py`` races real saves; here each dangerous ordering is forced step by step:
a checkpoint committed between a save's early check and its claim, a save that failed and left its lock,
the same writer retrying, ``overwrite=True`` taking a lock over, a lock whose bytes are hostile or a FIFO,
rank-local saves, and a transport without the create-if-absent primitive.
"""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage import FsspecReader, FsspecWriter, SafetensorsWriter
from dcp_storage.errors import CheckpointExistsError, IncompleteCheckpointError
from dcp_storage.formats.commit_claim import LOCK_FILE, claim_location
from dcp_storage.transports import FsspecTransport

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g), "step": seed}


def load(path: Path | str) -> dict[str, Any]:
    dest: dict[str, Any] = {"w": torch.empty(16, 8), "b": torch.empty(8), "step": None}
    dcp.load(dest, storage_reader=FsspecReader(path), no_dist=True)
    return dest


def same(got: dict[str, Any], expected: dict[str, Any]) -> bool:
    return all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in expected.items())


def refused(exc: BaseException) -> CheckpointExistsError:
    inner = exc
    if isinstance(exc, CheckpointException):
        (inner, _trace), *_ = exc.failures.values()
    assert isinstance(inner, CheckpointExistsError), repr(inner)
    return inner


def failing_state() -> dict[str, Any]:
    """A state whose save fails in ``write_data`` (a byte item that cannot be pickled), after the claim."""
    return {**state(1), "hook": lambda: None}


def test_a_finished_save_leaves_no_lock(tmp_path: Path) -> None:
    dcp.save(state(1), storage_writer=FsspecWriter(tmp_path / "dcp"), no_dist=True)
    dcp.save({"w": torch.ones(3)}, storage_writer=SafetensorsWriter(tmp_path / "hf"), no_dist=True)
    for name in ("dcp", "hf"):
        assert not (tmp_path / name / LOCK_FILE).exists(), sorted(os.listdir(tmp_path / name))


def test_a_commit_between_the_early_check_and_the_claim(tmp_path: Path) -> None:
    """Save A passes its early check, save B commits, then A claims: A finds B's .metadata and stops."""
    ckpt = tmp_path / "ckpt"
    writer = FsspecWriter(ckpt)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state(1), writer.storage_meta(), True)
    local = writer.prepare_local_plan(planner.create_local_plan())  # nothing there yet: passes
    plans, _metadata = planner.create_global_plan([local])

    dcp.save(state(2), storage_writer=FsspecWriter(ckpt), no_dist=True)  # B commits meanwhile
    with pytest.raises(CheckpointExistsError) as info:
        writer.prepare_global_plan(plans)
    assert f"{ckpt}/.metadata: a checkpoint already exists here" in str(info.value), str(info.value)
    assert not (ckpt / LOCK_FILE).exists(), "the refused save left its lock behind"
    assert same(load(ckpt), state(2))


@pytest.mark.parametrize(
    "make, where",
    [(FsspecWriter, "local"), (FsspecWriter, "memory"), (SafetensorsWriter, "memory"), (SafetensorsWriter, "local")],
    ids=["dcp-local", "dcp-memory", "safetensors-memory", "safetensors-local"],
)
def test_a_save_whose_lock_was_taken_over_does_not_commit(tmp_path: Path, make: Any, where: str) -> None:
    """Save A (``overwrite=False``) holds the location; B (``overwrite=True``) takes the lock over and commits;
    then A reaches its commit. Before: A committed over B, so B returned success and was lost (and with B
    retiring A's files first, A's commit could name files B had removed). Now A finds another save's token
    in its lock and raises ``CheckpointExistsError`` before its commit marker; B's checkpoint stays whole."""
    ckpt = str(tmp_path / "ckpt") if where == "local" else f"memory://taken-over-{uuid.uuid4().hex}"
    writer = make(ckpt)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    planner = DefaultSavePlanner()
    planner.set_up_planner({"w": torch.arange(8.0)}, writer.storage_meta(), True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    plans = writer.prepare_global_plan(plans)  # A holds the lock

    dcp.save({"w": torch.full((8,), 2.0)}, storage_writer=make(ckpt, overwrite=True), no_dist=True)  # B

    plan = planner.finish_plan(plans[0])
    # SafetensorsWriter: on a store before its first upload; locally B's retire removed A's temp files
    with pytest.raises(CheckpointExistsError) as info:
        results = writer.write_data(plan, planner).wait()
        writer.finish(metadata, [results])
    assert "another save" in str(info.value) and "overwrite=True" in str(info.value), str(info.value)
    dest = {"w": torch.zeros(8)}
    dcp.load(dest, storage_reader=ds.open_reader(ckpt), no_dist=True)
    assert torch.equal(dest["w"], torch.full((8,), 2.0))


def test_a_failed_save_keeps_its_lock_until_its_writer_retries(tmp_path: Path) -> None:
    """A failed save leaves its lock (no hook tells the writer that the save failed): readers see an
    interrupted save, and the same writer takes its lock back."""
    ckpt = tmp_path / "ckpt"
    writer = FsspecWriter(ckpt)
    with pytest.raises(CheckpointException):
        dcp.save(failing_state(), storage_writer=writer, no_dist=True)
    failed_id = writer.save_id
    holder = json.loads((ckpt / LOCK_FILE).read_text())
    assert holder["save_id"] == failed_id and holder["pid"] == os.getpid()

    with pytest.raises(IncompleteCheckpointError) as info:  # readers: an interrupted save
        ds.open_reader(ckpt)
    assert LOCK_FILE in str(info.value) and "still running or was interrupted" in str(info.value)

    dcp.save(state(3), storage_writer=writer, no_dist=True)  # the same writer takes its own lock back
    assert same(load(ckpt), state(3)) and not (ckpt / LOCK_FILE).exists()


def test_a_failed_save_in_this_process_is_taken_over_by_the_next(tmp_path: Path) -> None:
    """Its save's call has returned: no save in this process holds the lock any more, so a new writer (a
    retry loop that builds one per attempt) takes it over at once. Before: refused as "another save holds
    this location" naming this very process, until someone removed the lock by hand."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(CheckpointException):
        dcp.save(failing_state(), storage_writer=FsspecWriter(ckpt), no_dist=True)
    assert (ckpt / LOCK_FILE).exists()
    retry = FsspecWriter(ckpt)
    dcp.save(state(2), storage_writer=retry, no_dist=True)
    assert same(load(ckpt), state(2)) and not (ckpt / LOCK_FILE).exists()
    names = sorted(os.listdir(ckpt))
    assert [n for n in names if n.endswith(".distcp")] == [f"__0_{retry.save_id[:12]}_{i}.distcp" for i in range(2)]
    assert ds.verify(ckpt).ok


def test_a_running_save_in_this_process_is_not_taken_over(tmp_path: Path) -> None:
    """A claim whose save is still running (here: driven by hand, its writer alive) refuses other saves."""
    ckpt = tmp_path / "ckpt"
    holder = FsspecWriter(ckpt)
    holder.set_up_storage_writer(True, rank=0, use_collectives=True)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state(1), holder.storage_meta(), True)
    holder.prepare_global_plan(planner.create_global_plan([holder.prepare_local_plan(planner.create_local_plan())])[0])
    with pytest.raises(CheckpointException) as other:
        dcp.save(state(2), storage_writer=FsspecWriter(ckpt), no_dist=True)
    message = str(refused(other.value))
    for part in (
        f"{ckpt}/{LOCK_FILE}",
        holder.save_id,
        "still running, or it stopped before its commit",
        "overwrite=True",
    ):
        assert part in message, message
    holder._release_claim()
    assert not (ckpt / LOCK_FILE).exists()


def test_overwrite_true_takes_over_a_stale_lock(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with pytest.raises(CheckpointException):
        dcp.save(failing_state(), storage_writer=FsspecWriter(ckpt), no_dist=True)
    assert (ckpt / LOCK_FILE).exists()
    dcp.save(state(4), storage_writer=FsspecWriter(ckpt, overwrite=True), no_dist=True)
    assert same(load(ckpt), state(4)) and not (ckpt / LOCK_FILE).exists()
    assert ds.verify(ckpt).ok


def test_safetensors_writer_honours_the_lock(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"save_id": "f" * 32, "host": "elsewhere", "pid": 7}))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(3)}, storage_writer=SafetensorsWriter(out), no_dist=True)
    assert "f" * 32 in str(refused(info.value)) and sorted(os.listdir(out)) == [LOCK_FILE]
    dcp.save({"w": torch.ones(3)}, storage_writer=SafetensorsWriter(out, overwrite=True), no_dist=True)
    assert sorted(os.listdir(out)) == ["model.safetensors"]


@pytest.mark.parametrize(
    "content",
    [
        json.dumps({"save_id": "\x1b[2J\x1b[HOK: checkpoint verified\x07", "host": "h\x1b]0;x\x07", "pid": 1}),
        "\x1b[31mnot json" + "A" * 10_000,
        "x" * (1 << 20),
        "[" * 4000,  # within the 4 KiB read: json's recursion limit (RecursionError, not a ValueError)
        '{"pid": ' + "[" * 3000 + "]" * 1000,
    ],
    ids=["escapes-in-json", "escapes-not-json", "one-mebibyte", "nested-json", "nested-json-field"],
)
def test_a_hostile_lock_is_never_quoted(tmp_path: Path, content: str) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / LOCK_FILE).write_text(content)
    with pytest.raises(CheckpointException) as info:
        dcp.save(state(1), storage_writer=FsspecWriter(ckpt), no_dist=True)
    message = str(refused(info.value))
    assert not any(ord(c) < 32 or ord(c) == 127 for c in message), repr(message)
    assert "AAAA" not in message and "xxxx" not in message and len(message) < 1000, message


def test_a_symlinked_lock_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"save_id": "SECRET-FROM-OUTSIDE", "host": "x", "pid": 1}))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / LOCK_FILE).symlink_to(outside)
    with pytest.raises(CheckpointException) as info:
        dcp.save(state(1), storage_writer=FsspecWriter(ckpt), no_dist=True)
    message = str(refused(info.value))
    assert "SECRET" not in message and "its holder is unknown" in message, message
    assert outside.read_text().startswith("{")  # untouched


def test_a_fifo_lock_does_not_hang(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / LOCK_FILE)
    began = time.monotonic()
    with pytest.raises(CheckpointException) as info:
        dcp.save(state(1), storage_writer=FsspecWriter(ckpt), no_dist=True)
    assert "its holder is unknown" in str(refused(info.value)) and time.monotonic() - began < 10


def test_rank_local_overwrite_retires_only_its_own_rank(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save(state(1), storage_writer=FsspecWriter(ckpt), use_collectives=False)  # rank 0, rank-local
    (ckpt / "__1_0.distcp").write_bytes(b"rank 1's, written meanwhile")
    old = {n for n in os.listdir(ckpt) if n.startswith("__0_") and n.endswith(".distcp")}
    writer = FsspecWriter(ckpt, overwrite=True)
    dcp.save(state(2), storage_writer=writer, use_collectives=False)
    names = set(os.listdir(ckpt))
    assert "__1_0.distcp" in names and not old & names, sorted(names)
    assert {n for n in names if n.endswith(".distcp")} - {"__1_0.distcp"} == {
        f"__0_{writer.save_id[:12]}_{i}.distcp" for i in range(2)
    }, sorted(names)
    assert "__0.dcp_storage.lock" not in names and same(load(ckpt), state(2))


def test_a_collective_save_does_not_replace_a_rank_local_checkpoint(tmp_path: Path) -> None:
    """A rank-local save commits ``__0.metadata`` over ``__0_0.distcp``; a collective ``overwrite=False`` save
    to the same place wrote the same data file name (before: it succeeded, replacing the rank-local save's
    bytes under its metadata)."""
    ckpt = tmp_path / "ckpt"
    dcp.save(state(1), storage_writer=FsspecWriter(ckpt), use_collectives=False)
    before = {n: (ckpt / n).read_bytes() for n in os.listdir(ckpt)}
    with pytest.raises(CheckpointException) as info:
        dcp.save(state(2), storage_writer=FsspecWriter(ckpt), no_dist=True)
    assert "__0.metadata" in str(refused(info.value))
    assert {n: (ckpt / n).read_bytes() for n in os.listdir(ckpt)} == before
    assert same(load(ckpt), state(1))


@pytest.mark.parametrize("first", ["rank-local", "collective"])
def test_collective_and_rank_local_saves_exclude_each_other(tmp_path: Path, first: str) -> None:
    """Each kind of save holds its own lock (``.dcp_storage.lock``, ``__0.dcp_storage.lock``), and both write
    ``__0_0.distcp``: a save of the other kind started meanwhile is refused, naming the holder's lock
    (before: both went on, and the data file of one was replaced under the other's metadata)."""
    ckpt = tmp_path / "ckpt"
    kinds = {"rank-local": {"use_collectives": False}, "collective": {"no_dist": True}}
    held = "__0.dcp_storage.lock" if first == "rank-local" else LOCK_FILE
    with pytest.raises((CheckpointException, AttributeError)):  # rank-local saves raise unwrapped
        dcp.save(failing_state(), storage_writer=FsspecWriter(ckpt), **kinds[first])  # its lock stays: "running"
    assert (ckpt / held).exists(), sorted(os.listdir(ckpt))
    second = "collective" if first == "rank-local" else "rank-local"
    before = sorted(os.listdir(ckpt))
    with pytest.raises((CheckpointException, CheckpointExistsError)) as info:
        dcp.save(state(2), storage_writer=FsspecWriter(ckpt), **kinds[second])
    message = str(refused(info.value))
    assert held in message and "another save holds" in message, message
    assert sorted(os.listdir(ckpt)) == before


def test_a_transport_without_create_new_is_warned_about(tmp_path: Path) -> None:
    """A third-party transport lacking the primitive: the lock is checked, then written, with a warning."""

    class CheckThenWrite(FsspecTransport):
        create_new = None  # type: ignore[assignment]

    transport, root = FsspecTransport.from_url(tmp_path / "ckpt")
    plain = CheckThenWrite(transport.fs, transport.config)
    lock = plain.join(root, LOCK_FILE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        claim = claim_location(plain, lock, save_id="a" * 32, overwrite=False, markers=[])
        with pytest.raises(CheckpointExistsError):
            claim_location(plain, lock, save_id="b" * 32, overwrite=False, markers=[])
    assert any("has no create_new()" in str(w.message) for w in caught), [str(w.message) for w in caught]
    claim.release()
    assert not os.path.exists(lock)
