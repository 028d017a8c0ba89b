"""Names a checkpoint records for its own files (an HF index's ``weight_map``, DCP's storage entries) that
look plain but become a path out of the checkpoint further down: percent-escapes of ``.`` and ``/``, which
URL libraries decode (yarl, under fsspec's HTTP filesystem, turns ``ckpt/%2e%2e/x`` into ``/x``), and
compatibility characters (fullwidth dots and solidus) that NFKC folds into ``..`` and ``/``.

The end-to-end tests serve a directory over a real HTTP server with Range support: the index or the
``.metadata`` sits in ``ckpt/``, a valid file of the same format sits beside ``ckpt/`` (outside it), and
the server records every path it is asked for.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.paths import check_relative

ENCODED = [
    "%2e%2e/outside.safetensors",
    "%2E%2E/outside.safetensors",
    ".%2e/outside.safetensors",
    "x/%2e%2e/%2e%2e/outside.safetensors",
    "%2e%2e%2foutside.safetensors",
    "..%2Foutside.safetensors",
    "%252e%252e/outside.safetensors",  # decoded twice by some stacks
    "%2fetc/passwd",
    "%5c..%5coutside.safetensors",
    "\uff0e\uff0e/outside.safetensors",  # fullwidth full stops: NFKC gives ".."
    "x\uff0f\uff0e\uff0e\uff0f\uff0e\uff0e\uff0foutside.safetensors",  # fullwidth solidus too
    "%2e",
    "x/%2e/y",
]


@pytest.mark.parametrize("name", ENCODED)
def test_encoded_escapes_are_refused(name: str) -> None:
    with pytest.raises(CorruptCheckpointError) as exc:
        check_relative(name, "http://host/ckpt/model.safetensors.index.json: weight_map entry 'w'")
    assert "weight_map entry 'w'" in str(exc.value)


@pytest.mark.parametrize(
    "name", ["model-00001-of-00002.safetensors", "__0_0.distcp", "0000000000/__0_0.distcp", "100%.safetensors"]
)
def test_plain_names_still_pass(name: str) -> None:
    assert check_relative(name, "x") == name


class _Files(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _FileHandler)
        self.root = root
        self.paths: list[str] = []

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"


class _FileHandler(BaseHTTPRequestHandler):
    server: _Files

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _file(self) -> Path | None:
        self.server.paths.append(self.path)
        path = Path(os.path.normpath(str(self.server.root) + self.path.split("?")[0]))
        return path if path.is_file() else None

    def do_HEAD(self) -> None:
        path = self._file()
        if path is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self) -> None:
        path = self._file()
        if path is None:
            self.send_error(404)
            return
        data = path.read_bytes()
        header = self.headers.get("Range")
        if header:
            first, _, last = header.removeprefix("bytes=").partition("-")
            start, end = int(first), min(len(data), int(last) + 1) if last else len(data)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            data = data[start:end]
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[_Files]:
    pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp")
    server = _Files(tmp_path)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize("name", ["%2e%2e/outside.safetensors", "x/%2e%2e/%2E%2E/outside.safetensors"])
def test_an_index_cannot_name_a_file_outside_over_http(served: _Files, name: str) -> None:
    root = served.root
    (root / "ckpt").mkdir()
    save_file({"a": torch.ones(2)}, str(root / "ckpt" / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.full((2,), 7.0)}, str(root / "outside.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": name}
    (root / "ckpt" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    url = served.url("ckpt/model.safetensors.index.json")
    with pytest.raises(CorruptCheckpointError) as exc:
        ds.SafetensorsReader(url).read_metadata()
    assert "weight_map entry 'b'" in str(exc.value)
    with pytest.raises(CheckpointException) as exc2:  # a BaseException; the message quotes ours
        dcp.load({"a": torch.zeros(2), "b": torch.zeros(2)}, storage_reader=ds.open_reader(url), no_dist=True)
    assert "weight_map entry 'b'" in str(exc2.value)
    assert not [p for p in served.paths if "outside" in p], served.paths


def test_dcp_storage_entries_cannot_name_a_file_outside_over_http(served: _Files) -> None:
    root = served.root
    torch.set_num_threads(1)
    dcp.save({"w": torch.ones(4)}, storage_writer=ds.FsspecWriter(root / "ckpt"), no_dist=True)
    dcp.save({"w": torch.full((4,), 7.0)}, storage_writer=ds.FsspecWriter(root / "other"), no_dist=True)
    metadata = pickle.loads((root / "ckpt" / ".metadata").read_bytes())
    for index, info in list(metadata.storage_data.items()):
        info.relative_path = "%2e%2e/other/" + info.relative_path
        metadata.storage_data[index] = info
    (root / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    (root / "ckpt" / ".dcp_storage.json").unlink()  # the manifest would name the files too
    url = served.url("ckpt")
    with pytest.raises(CorruptCheckpointError) as exc:
        ds.FsspecReader(url).read_metadata()
    assert "%2e%2e/other/" in str(exc.value)
    with pytest.raises(CheckpointException) as exc2:  # a BaseException; the message quotes ours
        dcp.load({"w": torch.zeros(4)}, storage_reader=ds.FsspecReader(url), no_dist=True)
    assert "%2e%2e/other/" in str(exc2.value)
    assert not [p for p in served.paths if "other" in p], served.paths
