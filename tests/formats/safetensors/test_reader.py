"""``SafetensorsReader`` on files written by third-party code, loaded locally and from S3 (moto).

Sources: ``safetensors.torch.save_file`` (every dtype, 0-dim, zero-size), transformers ``save_pretrained``
(single file, and sharded with an index), torch's ``HuggingFaceStorageWriter`` (rank-0 style with two
files and an index; ``save_distributed`` at 2 ranks: chunks across files) and torch's
``FileSystemWriter(serialization_format=SAFETENSORS)`` at 2 ranks (``.distcp`` + ``.metadata``, with a
non-tensor item). Each is loaded into a plain state dict here, and into ``Shard(0)``/``Shard(1)`` DTensor
state dicts at 2 and 3 ranks (one ``run_ranks`` spawn per world size, checks in :mod:`._rank_fns`).
Bit-exactness is checked on raw bytes. Broken checkpoints must fail with errors that name the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from dcp_storage import SafetensorsReader
from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError, WrongFormatError
from dcp_storage.formats.dcp_native.writer import FsspecWriter
from dcp_storage.formats.safetensors.loader import SafetensorsScanConfig
from dcp_storage_testing.compare import same_bits
from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.s3_server import MotoS3Server

from . import _rank_fns as R
from ._build import every_dtype_tensors, torch_reference

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# name -> path under the checkpoint root that the reader is pointed at
SOURCES = {
    "st_file": "st_file/all.safetensors",
    "hf_single": "hf_single",
    "hf_sharded": "hf_sharded/model.safetensors.index.json",
    "torch_hf": "torch_hf",
    "torch_hf_dist": "torch_hf_dist",
    "fsw": "fsw",
}
WITH_STEP = {"fsw"}  # sources holding a non-tensor item ("step": 7)
TIMEOUT_S = 120.0


@dataclass
class Checkpoints:
    root: Path
    s3_prefix: str  # "s3://bucket/st"
    s3_options: dict[str, Any]
    refs: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def url(self, rel: str, backend: str) -> tuple[str, dict[str, Any]]:
        if backend == "local":
            return str(self.root / rel), {}
        return f"{self.s3_prefix}/{rel}", dict(self.s3_options)

    def upload(self, local: Path, rel: str) -> None:
        fs = fsspec.filesystem("s3", **self.s3_options)
        prefix = self.s3_prefix.removeprefix("s3://")
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for path in files:
            dest = f"{prefix}/{rel}" if local.is_file() else f"{prefix}/{rel}/{path.relative_to(local).as_posix()}"
            fs.put_file(str(path), dest)


def _load_files(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(str(path)))
    return out


def _save_transformers(single: Path, sharded: Path) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(single))
    model.save_pretrained(str(sharded), max_shard_size="200KB")


@pytest.fixture(scope="module")
def ckpts(moto_server: MotoS3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkpoints]:
    root = tmp_path_factory.mktemp("safetensors")
    s3 = moto_server.new_location("st", skip_instance_cache=True, use_listings_cache=False)
    c = Checkpoints(root, s3.url, s3.storage_options)

    run_ranks(R.save_distributed, 2, str(root / "torch_hf_dist"), str(root / "fsw"), timeout=TIMEOUT_S)
    c.refs["torch_hf_dist"] = torch_reference()
    c.refs["fsw"] = torch_reference()

    (root / "st_file").mkdir()
    c.refs["st_file"] = every_dtype_tensors()
    safetensors.torch.save_file(c.refs["st_file"], str(root / SOURCES["st_file"]), metadata={"format": "pt"})

    _save_transformers(root / "hf_single", root / "hf_sharded")
    c.refs["hf_single"] = _load_files(root / "hf_single")
    c.refs["hf_sharded"] = _load_files(root / "hf_sharded")
    assert len(list((root / "hf_sharded").glob("*.safetensors"))) >= 3

    reference = torch_reference()
    mapping = {k: 1 + i % 2 for i, k in enumerate(sorted(reference))}
    writer = HuggingFaceStorageWriter(str(root / "torch_hf"), fqn_to_index_mapping=mapping)
    dcp.save(reference, storage_writer=writer, no_dist=True)
    c.refs["torch_hf"] = reference

    # The coordinator's failure must reach every rank: an index naming a shard that is gone.
    shutil.copytree(root / "hf_sharded", root / "broken_sharded")
    os.remove(root / "broken_sharded" / "model-00002-of-00003.safetensors")

    torch.save(c.refs, root / "refs.pt")
    for name in ("st_file", "hf_single", "hf_sharded", "torch_hf", "torch_hf_dist", "fsw", "broken_sharded"):
        c.upload(root / name, name)
    try:
        yield c
    finally:
        with contextlib.suppress(Exception):  # cleanup must not mask the result
            moto_server.delete_bucket(s3.url.split("/")[2])


def _sentinel(full: torch.Tensor) -> torch.Tensor:
    nbytes = full.numel() * full.element_size()
    return torch.full((nbytes,), 0xA5, dtype=torch.uint8).view(full.dtype).reshape(full.shape)


def _check_plain(state: dict[str, Any], reference: dict[str, torch.Tensor], where: str) -> None:
    bad = [k for k, v in reference.items() if not same_bits(state[k], v)]
    assert not bad, f"{where}: tensors differ from the reference: {bad}"


# ------------------------------------------------------------------------------- single process
@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.parametrize("name", list(SOURCES))
def test_plain_state_dict(ckpts: Checkpoints, name: str, backend: str) -> None:
    url, options = ckpts.url(SOURCES[name], backend)
    reference = ckpts.refs[name]
    state: dict[str, Any] = {k: _sentinel(v) for k, v in reference.items()}
    if name in WITH_STEP:
        state["step"] = 0
    dcp.load(state, storage_reader=SafetensorsReader(url, options))
    _check_plain(state, reference, url)
    if name in WITH_STEP:
        assert state["step"] == 7


def test_metadata_describes_chunks_across_files(ckpts: Checkpoints) -> None:
    url, _ = ckpts.url("torch_hf_dist", "local")
    md = SafetensorsReader(url).read_metadata()
    w = md.state_dict_metadata["w_uneven"]
    assert tuple(w.size) == (7, 9) and w.properties.dtype == torch.float32
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in w.chunks) == [((0, 0), (4, 9)), ((4, 0), (3, 9))]
    assert tuple(md.state_dict_metadata["scalar_f32"].size) == ()


def test_directory_with_index_and_memory_backend(ckpts: Checkpoints) -> None:
    # The directory (not the index file) as URL: the index found there is used.
    state = {k: _sentinel(v) for k, v in ckpts.refs["hf_sharded"].items()}
    dcp.load(state, storage_reader=SafetensorsReader(str(ckpts.root / "hf_sharded")))
    _check_plain(state, ckpts.refs["hf_sharded"], "hf_sharded dir")

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/st-reader-test/all.safetensors", (ckpts.root / SOURCES["st_file"]).read_bytes())
    try:
        state = {k: _sentinel(v) for k, v in ckpts.refs["st_file"].items()}
        dcp.load(state, storage_reader=SafetensorsReader("memory://st-reader-test"))
        _check_plain(state, ckpts.refs["st_file"], "memory://")
    finally:
        fs.rm("/st-reader-test", recursive=True)


def test_a_plain_load_reads_headers_in_one_request_per_file(ckpts: Checkpoints) -> None:
    url, options = ckpts.url(SOURCES["hf_sharded"], "s3")
    reader = SafetensorsReader(url, options)
    reader.read_metadata()
    assert reader.counters["requests"] == 1 + 3  # the index, then one header probe per shard


def test_headers_longer_than_the_probe_take_a_second_request(ckpts: Checkpoints) -> None:
    url, _ = ckpts.url(SOURCES["hf_sharded"], "local")
    whole = SafetensorsReader(url).read_metadata()
    reader = SafetensorsReader(url, scan_config=SafetensorsScanConfig(probe_bytes=64))
    assert reader.read_metadata().state_dict_metadata == whole.state_dict_metadata
    assert reader.counters["requests"] == 1 + 2 * 3  # the index, then two reads per shard


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_missing_shard_named_by_the_index(ckpts: Checkpoints, backend: str) -> None:
    url, options = ckpts.url("broken_sharded/model.safetensors.index.json", backend)
    with pytest.raises(CheckpointNotFoundError) as exc:
        SafetensorsReader(url, options).read_metadata()
    message = str(exc.value)
    assert "model-00002-of-00003.safetensors: no such file" in message, message
    assert "model.safetensors.index.json" in message and "named by" in message, message


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/x.safetensors", "s3://bucket/x.safetensors"])
def test_index_entries_that_escape_the_directory(ckpts: Checkpoints, tmp_path: Path, entry: str) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ckpts.root / "hf_sharded", ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = entry
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError) as exc:
        SafetensorsReader(str(ckpt)).read_metadata()
    message = str(exc.value)
    assert "model.safetensors.index.json" in message and "'lm_head.weight'" in message and entry in message


def test_index_entry_the_shard_does_not_hold(ckpts: Checkpoints, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ckpts.root / "hf_sharded", ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["no.such.weight"] = "model-00001-of-00003.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=r"'no.such.weight'.*model-00001-of-00003.safetensors"):
        SafetensorsReader(str(ckpt)).read_metadata()


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.parametrize("cut", ["data", "header"])
def test_truncated_file(ckpts: Checkpoints, tmp_path: Path, backend: str, cut: str) -> None:
    data = (ckpts.root / "hf_single" / "model.safetensors").read_bytes()
    keep = len(data) - 100 if cut == "data" else 200
    local = tmp_path / "model.safetensors"
    local.write_bytes(data[:keep])
    if backend == "local":
        url, options = str(local), {}
    else:
        ckpts.upload(local, f"truncated-{cut}/model.safetensors")
        url, options = ckpts.url(f"truncated-{cut}/model.safetensors", "s3")
    with pytest.raises(CorruptCheckpointError) as exc:
        SafetensorsReader(url, options).read_metadata()
    message = str(exc.value)
    assert "model.safetensors" in message and "truncated" in message, message


def test_torch_distributed_layout_with_a_shard_file_gone(ckpts: Checkpoints, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ckpts.root / "torch_hf_dist", ckpt)
    # The files record where each piece starts but not the full size, so only a gap shows: a missing
    # first shard does; a missing last one makes a smaller tensor, which the load planner then refuses.
    (ckpt / "shard-00001-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"tensor '\w+'.*shard-00002.*shard file is missing"):
        SafetensorsReader(str(ckpt)).read_metadata()


def test_the_same_piece_in_two_files(tmp_path: Path) -> None:
    safetensors.torch.save_file({"w": torch.ones(2, 2)}, str(tmp_path / "a.safetensors"))
    safetensors.torch.save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*a\.safetensors.*b\.safetensors.*stale"):
        SafetensorsReader(str(tmp_path)).read_metadata()


def test_native_dcp_checkpoint_points_at_fsspec_reader(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3, 3)}, storage_writer=FsspecWriter(str(tmp_path / "native")), no_dist=True)
    with pytest.raises(WrongFormatError, match="looks like a dcp checkpoint.*FsspecReader"):
        SafetensorsReader(str(tmp_path / "native")).read_metadata()


def test_nothing_there(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such file or directory"):
        SafetensorsReader(str(tmp_path / "nope")).read_metadata()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README").write_text("hi")
    with pytest.raises(CheckpointNotFoundError, match=r"no \*\.safetensors files"):
        SafetensorsReader(str(tmp_path / "empty")).read_metadata()


# ------------------------------------------------------------------------------ distributed loads
@pytest.fixture(scope="module")
def rank_reports(ckpts: Checkpoints) -> dict[int, list[dict[str, Any]]]:
    sources = []
    for backend in ("local", "s3"):
        for name, rel in SOURCES.items():
            url, options = ckpts.url(rel, backend)
            sources.append({"name": name, "url": url, "options": options, "step": name in WITH_STEP})
    counted = ckpts.url(SOURCES["hf_sharded"], "s3")
    broken = ckpts.url("broken_sharded", "s3")
    refs = str(ckpts.root / "refs.pt")
    return {
        world: run_ranks(R.load_everything, world, sources, refs, counted, broken, timeout=TIMEOUT_S)
        for world in (2, 3)
    }


@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_state_dicts(ckpts: Checkpoints, rank_reports: dict[int, list[dict[str, Any]]], world: int) -> None:
    header_bytes = {}
    for name, rel in SOURCES.items():
        reader = SafetensorsReader(ckpts.url(rel, "local")[0])
        reader.read_metadata()
        header_bytes[name] = reader.counters["bytes_read"]
    reports = rank_reports[world]
    assert len(reports) == world
    for rank, report in enumerate(reports):
        assert len(report["loads"]) == 2 * 2 * len(SOURCES)
        for load in report["loads"]:
            where = f"rank {rank}/{world} Shard({load['dim']}) {load['url']}"
            assert load["bad"] == [], f"{where}: local shards differ from the reference: {load['bad']}"
            if load["url"].startswith("s3://") or load["name"] in WITH_STEP:
                continue
            # Without coalescing a rank reads exactly its own bytes (the coordinator also the headers).
            expected = load["needed"] + (header_bytes[load["name"]] if rank == 0 else 0)
            assert load["bytes_read"] == expected, f"{where}: read {load['bytes_read']} bytes, expected {expected}"


@pytest.mark.parametrize("world", [2, 3])
def test_metadata_is_read_once_per_group(
    ckpts: Checkpoints, rank_reports: dict[int, list[dict[str, Any]]], world: int
) -> None:
    url, options = ckpts.url(SOURCES["hf_sharded"], "s3")
    alone = SafetensorsReader(url, options)
    alone.read_metadata()
    per_rank = [r["metadata_counters"]["requests"] for r in rank_reports[world]]
    assert sum(per_rank) == alone.counters["requests"], per_rank
    assert per_rank[1:] == [0] * (world - 1), per_rank


@pytest.mark.parametrize("world", [2, 3])
def test_a_coordinator_failure_reaches_every_rank(rank_reports: dict[int, list[dict[str, Any]]], world: int) -> None:
    for rank, report in enumerate(rank_reports[world]):
        assert report["error"] is not None, f"rank {rank} did not fail"
        kind, message = report["error"]
        assert kind == "CheckpointNotFoundError", (rank, kind, message)
        assert "model-00002-of-00003.safetensors" in message and "model.safetensors.index.json" in message


def test_the_unchecked_warning_escapes_a_shard_name_from_the_index(tmp_path: Path) -> None:
    """The shard's file name comes from the index: its escape sequences are shown escaped, not run."""
    import warnings

    name = "shard\x1b]0;pwned\x07\x1b[2J\u202e.safetensors"
    safetensors.torch.save_file({"a": torch.ones(3)}, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": name}}))
    dest = {"a": torch.zeros(3)}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dcp.load(dest, storage_reader=SafetensorsReader(str(tmp_path), verify=True), no_dist=True)
    assert torch.equal(dest["a"], torch.ones(3))
    (text,) = [str(w.message) for w in seen if "records no checksums" in str(w.message)]
    assert text.isprintable() and "\\x1b]0;pwned\\x07\\x1b[2J\\u202e" in text, text
