"""``SafetensorsWriter`` from 2 real gloo ranks: FSDP2 and ``Shard(1)`` DTensor state dicts, local and S3.

One ``run_ranks`` call (module fixture) does every save; the tests then read the files back with
safetensors (and ``transformers``) in this process and compare them bit for bit with references rebuilt
from the same seeds. Local saves use positioned writes from both ranks; S3 saves stream through the
coordinator over the process group.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.models import reference_state_dict
from dcp_storage_testing.s3_server import MotoS3Server

from . import _rank_fns as R
from ._helpers import mismatches, read_checkpoint

WORLD = 2
TIMEOUT_S = 90.0
MAX_WRITE_RATIO = 1.02  # bytes written (all ranks) / bytes of the checkpoint's files
LLAMA_SEED = 7


def _llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )


def _llama_reference() -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(LLAMA_SEED)
    model = LlamaForCausalLM(_llama_config())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(moto_server: MotoS3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root: Path = tmp_path_factory.mktemp("st_writer")
    llama, llama_path = None, None
    if importlib.util.find_spec("transformers") is not None:  # else only test_llama_from_pretrained skips
        llama = _llama_reference()
        llama_path = str(root / "llama_reference.pt")
        torch.save(llama, llama_path)
        (root / "llama").mkdir()
        _llama_config().save_pretrained(root / "llama")
    s3 = {
        name: tuple(
            moto_server.new_location(name.replace("_", "-"), skip_instance_cache=True, use_listings_cache=False)
        )
        for name in ("fsdp2", "shard1", "crash_sender", "crash_coordinator")
    }
    reports = run_ranks(R.save_all, WORLD, str(root), s3, llama_path, timeout=TIMEOUT_S)
    try:
        yield {"root": root, "s3": s3, "reports": reports, "llama": llama}
    finally:
        for url, _opts in s3.values():
            try:
                moto_server.delete_bucket(url.split("/")[2])
            except Exception:  # noqa: BLE001, S110 - cleanup must not mask the result
                pass


def _written(saved: dict[str, Any], key: str) -> int:
    return sum(r[key]["bytes_written"] for r in saved["reports"])


def _size_on_storage(url: str, options: dict[str, Any]) -> int:
    """Bytes of the checkpoint's own files (not, e.g., a ``config.json`` saved beside them)."""
    fs, root = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()
    paths = fs.ls(root, detail=False)
    return sum(fs.size(p) for p in paths if p.rsplit("/", 1)[-1].startswith("model"))


def _check(
    saved: dict[str, Any],
    key: str,
    url: str,
    options: dict[str, Any],
    reference: dict[str, torch.Tensor],
    sharded: bool,
) -> None:
    out = read_checkpoint(url, options)
    assert mismatches(out["tensors"], reference) == [], f"{key}: tensors differ from the reference"
    assert (out["index"] is not None) == sharded, f"{key}: files {out['names']}"
    assert not [n for n in out["names"] if n.startswith(".")], f"{key}: temp files left: {out['names']}"
    written, size = _written(saved, key), _size_on_storage(url, options)
    assert size <= written <= MAX_WRITE_RATIO * size, (
        f"{key}: wrote {written} bytes for {size} bytes of files ({written / size:.4f}x)"
    )


def test_fsdp2_local_sharded(saved: dict[str, Any]) -> None:
    _check(
        saved, "fsdp2_local", str(saved["root"] / "fsdp2"), {}, reference_state_dict(R.SEED, **R.SHAPE), sharded=True
    )
    # Both ranks wrote their own rows in place.
    assert all(r["fsdp2_local"]["bytes_written"] > 0 for r in saved["reports"])


def test_fsdp2_s3_sharded_through_coordinator(saved: dict[str, Any]) -> None:
    url, options = saved["s3"]["fsdp2"]
    _check(saved, "fsdp2_s3", url, options, reference_state_dict(R.SEED, **R.SHAPE), sharded=True)
    # Streaming: only the coordinator touches storage.
    assert saved["reports"][1]["fsdp2_s3"]["bytes_written"] == 0


def test_shard1_local_single_file(saved: dict[str, Any]) -> None:
    url = str(saved["root"] / "shard1")
    _check(saved, "shard1_local", url, {}, R.shard1_reference(), sharded=False)
    from safetensors.torch import load_file

    assert mismatches(load_file(os.path.join(url, "model.safetensors")), R.shard1_reference()) == []
    # Both ranks wrote their own columns in place.
    assert all(r["shard1_local"]["bytes_written"] > 0 for r in saved["reports"])


def test_shard1_s3_sharded(saved: dict[str, Any]) -> None:
    url, options = saved["s3"]["shard1"]
    _check(saved, "shard1_s3", url, options, R.shard1_reference(), sharded=True)


def test_llama_from_pretrained(saved: dict[str, Any]) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    directory = saved["root"] / "llama"
    _check(saved, "llama_local", str(directory), {}, saved["llama"], sharded=False)
    model = LlamaForCausalLM.from_pretrained(directory)
    loaded = {k: v.detach() for k, v in model.state_dict().items()}
    assert mismatches(loaded, saved["llama"]) == []


def test_overwrite_from_two_ranks(saved: dict[str, Any]) -> None:
    refused = saved["reports"][0]["refused_local"]
    assert refused["raised"] and refused["types"] == ["CheckpointExistsError"], refused
    out = read_checkpoint(str(saved["root"] / "fsdp2"))  # the refused save left it untouched
    assert mismatches(out["tensors"], reference_state_dict(R.SEED, **R.SHAPE)) == []
    # overwrite=True replaced a sharded checkpoint with a single file: no stale shards or index remain.
    out = read_checkpoint(str(saved["root"] / "overwrite"))
    assert out["names"] == ["model.safetensors"]
    assert mismatches(out["tensors"], R.shard1_reference()) == []


@pytest.mark.parametrize("case", ["crash_local", "crash_s3_sender", "crash_s3_coordinator"])
def test_interrupted_save_never_looks_complete(saved: dict[str, Any], case: str) -> None:
    for rank, report in enumerate(saved["reports"]):
        assert report[case]["raised"], f"rank {rank}: {case} did not fail"
        assert "simulated crash" in report[case]["message"], report[case]["message"]
    if case == "crash_local":
        url, options = str(saved["root"] / "crash"), {}
    else:
        url, options = saved["s3"][case.replace("crash_s3_", "crash_")]
    fs, root = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()
    names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] if fs.exists(root) else []
    assert "model.safetensors" not in names and "model.safetensors.index.json" not in names, names
