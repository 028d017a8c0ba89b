"""Errors that reach the user once: ``ds.load``/``ds.save`` raise the library's error (the failing ranks
named, no torch traceback printed), ``ds.errors.unwrap`` finds it inside torch's ``CheckpointException`` whichever
rank raised it, and the readers' metadata fallback reports one failure once."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_storage as ds
from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.s3_server import MotoS3Server

from . import _error_rank_fns as R

CHILD = r"""
import json, sys, torch
import torch.distributed.checkpoint as dcp
import dcp_storage as ds
url, opts, how = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
state = {"w": torch.zeros(4)}
try:
    if how == "ds":
        ds.load(state, url, storage_options=opts)
    else:
        dcp.load(state, storage_reader=ds.FsspecReader(url, opts))
except BaseException as exc:
    inner = ds.errors.unwrap(exc)
    print(json.dumps({"type": type(exc).__name__, "inner": type(inner).__name__, "text": str(exc)}))
"""


def _child(url: str, options: dict[str, Any], how: str) -> tuple[dict[str, Any], list[str]]:
    """``python -c CHILD ...`` in a process of its own (a fork of the CLI tests' zygote: torch imported once)."""
    from tests.cli._helpers import run_python

    done = run_python(["-c", CHILD, url, json.dumps(options), how], dict(os.environ), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr.splitlines()


def test_wrong_secret_is_one_error_and_at_most_3_stderr_lines(moto_server: MotoS3Server, s3_url: Any) -> None:
    url, options = s3_url
    ds.save({"w": torch.arange(4.0)}, url, storage_options=options)
    key_id, _secret = moto_server.create_access_key(f"tc-{uuid.uuid4().hex[:8]}")
    wrong = {**options, "key": key_id, "secret": "not-the-secret"}
    with moto_server.iam_auth():
        ours, ours_stderr = _child(url, wrong, "ds")
        theirs, theirs_stderr = _child(url, wrong, "dcp")
    assert ours["type"] == "StorageAccessError" and "SignatureDoesNotMatch" in ours["text"], ours
    assert len(ours_stderr) <= 3, "\n".join(ours_stderr)
    # Plain dcp.load: torch's CheckpointException, a logged traceback, and (fixed here) our message once.
    assert theirs["type"] == "CheckpointException" and theirs["inner"] == "AssertionError", theirs
    assert theirs["text"].count("SignatureDoesNotMatch") == 1, theirs["text"]
    assert "rank local metadata read failed" not in theirs["text"]
    assert len(theirs_stderr) > 10


def test_missing_checkpoint_reported_once(tmp_path: Path) -> None:
    url = str(tmp_path / "nothing-here")
    with pytest.raises(ds.CheckpointNotFoundError) as raised:
        ds.load({"w": torch.zeros(1)}, url, format="dcp")
    assert raised.value.__notes__ == ["dcp_storage.load failed on rank 0"]
    assert raised.value.__traceback__ is not None and raised.value.__cause__ is None
    try:
        dcp.load({"w": torch.zeros(1)}, storage_reader=ds.FsspecReader(url), no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException quoting torch's AssertionError
        text = str(exc)
    assert text.count("no checkpoint metadata") == 1 and "rank local metadata read failed" not in text, text


def test_save_raises_ours(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    ds.save({"w": torch.ones(3)}, url)
    with pytest.raises(ds.errors.CheckpointExistsError):
        ds.save({"w": torch.ones(3)}, url)  # overwrite=False is the writer's default
    ds.save({"w": torch.full((3,), 2.0)}, url, overwrite=True)
    state = {"w": torch.zeros(3)}
    ds.load(state, url)
    assert torch.equal(state["w"], torch.full((3,), 2.0))


def test_a_failure_on_one_rank_is_ours_on_every_rank(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    ds.save({"w": torch.arange(8.0)}, url)
    for report in run_ranks(R.ds_load_failing_on, 2, url, 1, timeout=120):
        assert report["ours"] and report["type"] == "IncompatibleKeysError", report
        assert "dcp_storage.load failed on rank 1" in report["notes"], report
    for report in run_ranks(R.dcp_load_unwrapped, 2, url, 1, timeout=120):
        assert report == {"outer": "CheckpointException", "inner": "IncompatibleKeysError", "ours": True}, report


def test_the_format_is_detected_once_for_every_rank(tmp_path: Path) -> None:
    """``ds.load`` without ``format=``: a probe failing on the coordinator fails every rank at once (each rank
    probed before, and one whose probe failed left the others in the load's collectives until the timeout);
    one failing on another rank is never made."""
    url = str(tmp_path / "ckpt")
    ds.save({"w": torch.arange(8.0)}, url)
    for report in run_ranks(R.ds_load_probe_failing_on, 2, url, 0, timeout=120):
        assert "simulated storage error probing on rank 0" in report["error"] and report["seconds"] < 10, report
    for report in run_ranks(R.ds_load_probe_failing_on, 2, url, 1, timeout=120):
        assert report["error"] is None and report["loaded"] == list(range(8)), report
    assert run_ranks(R.ds_load_format_on_one_rank, 2, url, timeout=120) == [list(map(float, range(8)))] * 2


def test_unwrap_leaves_other_exceptions_alone() -> None:
    error = ValueError("x")
    assert ds.errors.unwrap(error) is error
    from torch.distributed.checkpoint.api import CheckpointException

    mine = ds.errors.CorruptCheckpointError("bad")
    wrapped = CheckpointException("load", {0: (ValueError("not ours"), None), 3: (mine, None)})
    assert ds.errors.unwrap(wrapped) is mine, "ours, whichever rank raised it"
    assert isinstance(ds.errors.unwrap(CheckpointException("load", {2: (KeyError("k"), None)})), KeyError)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"endpoint_url": "localhost:9000"}, "Invalid endpoint: localhost:9000"),  # no scheme: botocore, as it builds
        ({"endpoint_url": "ftp://127.0.0.1:1"}, "was not a valid URI"),  # botocore, per request (endpoint rules)
        ({"endpoint_url": "http://user:hunter2@[::1"}, "Invalid IPv6 URL"),
        ({"endpoint_url": "http://127.0.0.1:1", "client_kwargs": {"region_name": "no such region!"}}, "region_name"),
    ],
)
def test_storage_options_botocore_refuses_are_ours(options: dict[str, Any], said: str) -> None:
    """Options that cannot make an S3 client: our error naming the URL, botocore's reason and the option to fix,
    before any request is sent, on loads and saves alike (was: botocore's bare ValueError)."""
    options = {**options, "key": "k", "secret": "s"}
    for run in (
        lambda: ds.load({"w": torch.zeros(1)}, "s3://bucket/ckpt", storage_options=options, format="dcp"),
        lambda: ds.load({"w": torch.zeros(1)}, "s3://bucket/m.safetensors", storage_options=options),
        lambda: ds.save({"w": torch.zeros(1)}, "s3://bucket/ckpt", storage_options=options),
    ):
        with pytest.raises(ds.errors.StorageOptionsError) as raised:
            run()
        text = str(raised.value)
        assert text.startswith("s3://bucket") and said in text and "endpoint_url" in text, text
        assert "hunter2" not in text, text
        assert isinstance(raised.value, ValueError)  # code that caught botocore's ValueError still does


@pytest.mark.parametrize("writer", ["dcp", "safetensors"])
def test_ranks_saving_to_different_locations_are_refused_before_writing(tmp_path: Path, writer: str) -> None:
    """Each rank's writer given its own path: every rank raises LocationMismatchError and nothing is written
    (was: each rank's data went to its own path, and the coordinator's .metadata named files beside another
    rank's path, a checkpoint that looked complete)."""
    for report in run_ranks(R.save_to_own_url, 2, str(tmp_path), writer, timeout=120):
        assert report["type"] == "LocationMismatchError", report
        assert "step-0" in report["text"] and "step-1" in report["text"], report
    assert not any(p.is_file() for p in tmp_path.rglob("*")), sorted(map(str, tmp_path.rglob("*")))


@pytest.mark.parametrize("fmt", ["dcp", "safetensors", "torch"])
def test_a_shape_mismatch_is_ours_naming_every_key(tmp_path: Path, fmt: str) -> None:
    """DCP's default planner raised a bare ValueError for the first tensor of another shape; ours names them all."""
    url = str(tmp_path / {"dcp": "ckpt", "safetensors": "st", "torch": "m.pt"}[fmt])
    saved = {"a": torch.arange(300.0), "b": torch.ones(2, 3), "c": torch.zeros(4)}
    if fmt == "torch":
        torch.save(saved, url)
    else:
        ds.save(saved, url, format=fmt)
    with pytest.raises(ds.errors.ShapeMismatchError) as raised:
        ds.load({"a": torch.zeros(301), "b": torch.zeros(3, 2), "c": torch.zeros(4)}, url)
    text = str(raised.value)
    assert "'a' is [301] in the state dict, [300] in the checkpoint" in text and "'b' is [3, 2]" in text, text
    assert "'c'" not in text


def test_a_truncated_torch_save_file_is_ours_through_ds_load(tmp_path: Path) -> None:
    """torch's fallback wrapped the reader's error in an AssertionError; ds.load raises the reader's own."""
    path = tmp_path / "m.pt"
    torch.save({"a": torch.arange(300.0)}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ds.errors.CorruptCheckpointError, match="truncated"):
        ds.load({"a": torch.zeros(300)}, str(path))
