"""Every reader pointed at another format's checkpoint names that format and the reader to use.

The matrix: ``FsspecReader``, ``SafetensorsReader``, ``BroadcastingTorchSaveReader`` x a DCP directory, a
safetensors file, a Hugging Face directory (sharded, with its index and ``config.json``) and a ``torch.save``
file. The right pairings load bit for bit (so the inputs are sound); each of the 9 wrong ones raises
:class:`~dcp_storage.errors.WrongFormatError` naming the URL, the format found, ``open_reader`` and the
reader class that reads it, where it used to raise ``[Errno 20] Not a directory: .../model.safetensors/.metadata``,
"the checkpoint does not exist" or ``[Errno 21] Is a directory`` without a path. One pairing through
``dcp.load`` and two on S3 (moto); and on S3 a healthy load still makes exactly one request for its
metadata (the probe runs on the error path only).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage.errors import WrongFormatError
from dcp_storage_testing.s3_server import S3Location

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STATE = {"layer.weight": torch.arange(12.0).reshape(4, 3), "layer.bias": torch.arange(3.0)}

# input kind -> (format name open_reader detects, the reader class that reads it)
KINDS = {
    "dcp_dir": ("dcp", "FsspecReader"),
    "safetensors_file": ("safetensors", "SafetensorsReader"),
    "hf_dir": ("safetensors", "SafetensorsReader"),
    "torch_file": ("torch_save", "BroadcastingTorchSaveReader"),
}
READERS: dict[str, Callable[[str, dict[str, Any]], Any]] = {
    "FsspecReader": lambda url, opts: ds.FsspecReader(url, opts),
    "SafetensorsReader": lambda url, opts: ds.SafetensorsReader(url, opts),
    "BroadcastingTorchSaveReader": lambda url, opts: ds.BroadcastingTorchSaveReader(url, storage_options=opts),
}


def _write_inputs(root: str, opts: dict[str, Any]) -> dict[str, str]:
    """Each kind of input under ``root`` (a local directory or a bucket prefix); returns kind -> URL."""
    urls = {
        kind: f"{root}/{name}"
        for kind, name in [
            ("dcp_dir", "dcp"),
            ("safetensors_file", "model.safetensors"),
            ("hf_dir", "hf"),
            ("torch_file", "model.pt"),
        ]
    }
    dcp.save(dict(STATE), storage_writer=ds.FsspecWriter(urls["dcp_dir"], opts), no_dist=True)
    dcp.save(dict(STATE), storage_writer=ds.SafetensorsWriter(urls["hf_dir"], opts, max_shard_size=60), no_dist=True)
    fs, _ = fsspec.core.url_to_fs(root, **opts)
    with fs.open(f"{urls['hf_dir']}/config.json", "w") as f:  # what save_pretrained writes beside the weights
        json.dump({"model_type": "toy"}, f)
    with tempfile.TemporaryDirectory() as scratch:  # written locally, then copied to the store
        save_file(STATE, f"{scratch}/model.safetensors")
        torch.save(STATE, f"{scratch}/model.pt")
        fs.put_file(f"{scratch}/model.safetensors", urls["safetensors_file"])
        fs.put_file(f"{scratch}/model.pt", urls["torch_file"])
    return urls


@pytest.fixture(scope="module")
def local_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _write_inputs(str(tmp_path_factory.mktemp("formats")), {})


def _assert_hint(exc: BaseException, url: str, kind: str) -> None:
    found, right_reader = KINDS[kind]
    text = str(exc)
    assert isinstance(exc, WrongFormatError) and isinstance(exc, ValueError), repr(exc)
    assert url.split("://")[-1] in text, text
    assert f"this looks like a {found} checkpoint" in text, text
    assert "open_reader(url)" in text and f"{right_reader}(url)" in text, text
    assert "Errno" not in text, text


@pytest.mark.parametrize("reader_name", list(READERS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_reader_names_the_format_it_found(local_inputs: dict[str, str], reader_name: str, kind: str) -> None:
    url = local_inputs[kind]
    reader = READERS[reader_name](url, {})
    if KINDS[kind][1] == reader_name:  # the right reader: the input is sound
        dest = {k: torch.zeros_like(v) for k, v in STATE.items()}
        dcp.load(dest, storage_reader=reader, no_dist=True)
        assert all(torch.equal(dest[k], STATE[k]) for k in STATE)
        return
    with pytest.raises(WrongFormatError) as info:
        reader.read_metadata()
    _assert_hint(info.value, url, kind)


def test_the_hint_survives_dcp_load(local_inputs: dict[str, str]) -> None:
    """``dcp.load`` re-raises a metadata failure as its own exception; the hint must be in its message."""
    url = local_inputs["hf_dir"]
    with pytest.raises((CheckpointException, AssertionError)) as info:
        dcp.load({k: torch.zeros_like(v) for k, v in STATE.items()}, storage_reader=ds.FsspecReader(url), no_dist=True)
    assert "this looks like a safetensors checkpoint" in str(info.value) and "SafetensorsReader(url)" in str(info.value)


def test_wrong_readers_on_s3_and_no_probe_on_the_happy_path(s3_url: S3Location) -> None:
    base, opts = s3_url
    urls = _write_inputs(base, opts)
    with pytest.raises(WrongFormatError) as info:
        ds.FsspecReader(urls["hf_dir"], opts).read_metadata()
    _assert_hint(info.value, urls["hf_dir"], "hf_dir")
    with pytest.raises(WrongFormatError) as info:
        ds.BroadcastingTorchSaveReader(urls["dcp_dir"], storage_options=opts).read_metadata()
    _assert_hint(info.value, urls["dcp_dir"], "dcp_dir")

    healthy = ds.FsspecReader(urls["dcp_dir"], opts)
    healthy.read_metadata()
    # .metadata and its manifest (what a default load checks the bytes with): no sniffing when all is well
    assert healthy.counters["requests"] == 2, healthy.counters
    unchecked = ds.FsspecReader(urls["dcp_dir"], opts, verify=False)
    unchecked.read_metadata()
    assert unchecked.counters["requests"] == 1, unchecked.counters  # .metadata only
