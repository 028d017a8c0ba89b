"""``SafetensorsWriter`` through ``dcp.save`` in one process (no process group).

Runs on a local directory (positioned writes into temp files, renamed in ``finish``) and on ``memory://``
(an fsspec filesystem that is not local, so the streaming path: one atomic upload per file). Output is read
back with safetensors itself, and compared bit for bit (NaN payloads, -0.0 and the like included).
"""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as st_load
from safetensors.torch import load_file
from safetensors.torch import save as st_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_storage import SafetensorsWriter
from dcp_storage.errors import CheckpointExistsError, DcpStorageError, NonTensorStateError, UnsupportedDtypeError
from dcp_storage.formats.safetensors.header import SAFETENSORS_TO_TORCH
from dcp_storage_testing.compare import same_bits

from ._helpers import mismatches, read_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (*shape, itemsize), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def _safetensors_roundtrips(dtype: torch.dtype) -> bool:
    """Whether the installed ``safetensors.torch`` can load this dtype back (0.8 cannot read F8_E8M0)."""
    try:
        st_load(st_save({"x": torch.zeros(1, dtype=dtype)}))
    except Exception:  # noqa: BLE001 - any failure means "not testable here"
        return False
    return True


def all_dtypes_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    sd: dict[str, torch.Tensor] = {}
    for i, (name, dtype) in enumerate(sorted(SAFETENSORS_TO_TORCH.items())):
        if _safetensors_roundtrips(dtype):  # the others are covered byte for byte in test_write_plan
            sd[f"w.{name.lower()}"] = random_bits((7, 5), dtype, i)
    fp32 = random_bits((9, 4), torch.float32, 50)
    fp32[0] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    sd.update(
        {
            "fp32_specials": fp32,
            "bool": torch.rand(5, 3, generator=g) > 0.5,
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "scalar_bf16": torch.tensor(-1.25, dtype=torch.bfloat16),
            "empty": torch.empty(0, 5),
            "empty_mid": torch.empty(3, 0, 2, dtype=torch.float16),
            "transposed": torch.randn(6, 4, generator=g).t(),
            "sliced": torch.randn(20, 8, generator=g)[5:9, 2:6],
            "nested.layer.weight": random_bits((64, 33), torch.bfloat16, 51),
        }
    )
    return sd


def model_like_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(64, 32, generator=g)}
    for layer in range(3):
        sd[f"layers.{layer}.attn.weight"] = torch.randn(32, 32, generator=g)
        sd[f"layers.{layer}.norm.weight"] = torch.randn(32, generator=g).to(torch.bfloat16)
        sd[f"layers.{layer}.mlp.weight"] = torch.randn(48, 32, generator=g).to(torch.float16)
    sd["head.weight"] = torch.randn(64, 32, generator=g)
    return sd


@pytest.fixture(params=["local", "memory"])
def location(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "ckpt")
        return
    url = f"memory://st-writer-{uuid.uuid4().hex}/ckpt"
    yield url
    fs = fsspec.filesystem("memory")
    root = url.split("://", 1)[1].split("/", 1)[0]
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)


def listing(url: str) -> list[str]:
    """Every name under ``url``, hidden temp files included."""
    fs, root = fsspec.core.url_to_fs(url)
    if not fs.exists(root):
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))


def unwrap(exc: BaseException) -> BaseException:
    if isinstance(exc, CheckpointException):
        (inner, _trace), *_ = exc.failures.values()
        return inner
    return exc


def checkpoint_bytes(url: str) -> int:
    fs, root = fsspec.core.url_to_fs(url)
    return sum(fs.size(f"{root}/{n}") for n in listing(url) if not n.startswith("."))


# ------------------------------------------------------------------------------------------- content
def test_every_dtype_bit_exact_and_byte_identical_to_safetensors(location: str) -> None:
    sd = all_dtypes_state_dict()
    writer = SafetensorsWriter(location)
    dcp.save(sd, storage_writer=writer)

    assert listing(location) == ["model.safetensors"]
    out = read_checkpoint(location)
    assert out["index"] is None
    assert mismatches(out["tensors"], sd) == []
    # The file is what safetensors itself writes (order, header, padding, offsets) given the same metadata
    # (which adds our checksums; safetensors orders metadata keys by hash, so the headers compare parsed).
    data = out["files"]["model.safetensors"]
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    assert header["__metadata__"]["format"] == "pt" and "dcp_storage.checksum_algorithm" in header["__metadata__"]
    expected = st_save({k: v.contiguous() for k, v in sd.items()}, metadata=header["__metadata__"])
    assert expected[:8] == data[:8] and json.loads(expected[8 : 8 + n]) == header and expected[8 + n :] == data[8 + n :]
    if "://" not in location:
        loaded = load_file(os.path.join(location, "model.safetensors"))
        assert mismatches(loaded, sd) == []
    ratio = writer.counters["bytes_written"] / checkpoint_bytes(location)
    assert ratio == 1.0, f"wrote {writer.counters['bytes_written']} bytes for a {checkpoint_bytes(location)}-byte file"


def test_without_checksums_byte_identical_to_safetensors(location: str) -> None:
    sd = all_dtypes_state_dict()
    dcp.save(sd, storage_writer=SafetensorsWriter(location, checksum_algorithm=None))
    expected = st_save({k: v.contiguous() for k, v in sd.items()}, metadata={"format": "pt"})
    assert read_checkpoint(location)["files"]["model.safetensors"] == expected


def test_sharded_output_index_and_files(location: str) -> None:
    sd = model_like_state_dict()
    limit = 12_000
    writer = SafetensorsWriter(location, max_shard_size=limit)
    dcp.save(sd, storage_writer=writer)

    out = read_checkpoint(location)  # checks every file loads and matches the index
    n = len(out["files"])
    assert n > 2
    assert listing(location) == sorted(
        [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)] + ["model.safetensors.index.json"]
    )
    assert mismatches(out["tensors"], sd) == []
    assert set(out["index"]["weight_map"]) == set(sd)
    # Files follow the state dict's order, each within the limit (no tensor here exceeds it alone).
    file_of = out["index"]["weight_map"]
    assert [file_of[k] for k in sd] == sorted(file_of[k] for k in sd)
    for name in out["files"]:
        tensors = [k for k, f in file_of.items() if f == name]
        assert sum(sd[k].numel() * sd[k].element_size() for k in tensors) <= limit, name
    ratio = writer.counters["bytes_written"] / checkpoint_bytes(location)
    assert 1.0 <= ratio <= 1.02


def test_prefix_and_metadata(location: str) -> None:
    sd = {"a": torch.arange(6, dtype=torch.int32)}
    dcp.save(
        sd, storage_writer=SafetensorsWriter(location, filename_prefix="adapter_model", metadata={"source": "test"})
    )
    assert listing(location) == ["adapter_model.safetensors"]
    fs, root = fsspec.core.url_to_fs(location)
    from safetensors import safe_open

    data = fs.cat_file(f"{root}/adapter_model.safetensors")
    header_len = int.from_bytes(data[:8], "little")
    assert b'"__metadata__":{' in data[8 : 8 + header_len]
    assert b'"format":"pt"' in data[8 : 8 + header_len] and b'"source":"test"' in data[8 : 8 + header_len]
    if "://" not in location:
        with safe_open(os.path.join(location, "adapter_model.safetensors"), "pt") as f:
            md = f.metadata()
            assert md["format"] == "pt" and md["source"] == "test"
            assert md["dcp_storage.writer"].startswith("dcp-storage/")


# ------------------------------------------------------------------------------------------- refusals
def test_non_tensor_entries_refused_by_name(location: str) -> None:
    sd = {"w": torch.ones(3), "step": 7, "optim": {"names": ["a", "b"]}}
    with pytest.raises(CheckpointException) as info:
        dcp.save(sd, storage_writer=SafetensorsWriter(location))
    err = unwrap(info.value)
    assert isinstance(err, NonTensorStateError) and isinstance(err, DcpStorageError)
    assert "'step'" in str(err) and "'optim.names'" in str(err) and "allow_extra_state=True" in str(err)
    assert "model.safetensors" not in listing(location)


def test_extra_state_sidecar(location: str) -> None:
    sd = {"w": torch.arange(4.0), "step": 7, "optim": {"names": ["a", 3, (4.5, None)]}}
    writer = SafetensorsWriter(location, allow_extra_state=True)
    dcp.save(sd, storage_writer=writer)
    assert listing(location) == ["extra_state.pt", "model.safetensors"]
    out = read_checkpoint(location)
    assert set(out["tensors"]) == {"w"}
    fs, root = fsspec.core.url_to_fs(location)
    extra = torch.load(io.BytesIO(fs.cat_file(f"{root}/extra_state.pt")), weights_only=True)
    assert set(extra) == {"step", "optim.names"}
    assert all(isinstance(v, bytes) for v in extra.values())
    assert torch.load(io.BytesIO(extra["step"]), weights_only=False) == 7
    assert torch.load(io.BytesIO(extra["optim.names"]), weights_only=False) == ["a", 3, (4.5, None)]
    assert writer.counters["bytes_written"] == checkpoint_bytes(location)


def test_unsupported_dtype_names_key_and_dtype(location: str) -> None:
    sd = {"ok": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)}
    with pytest.raises(CheckpointException) as info:
        dcp.save(sd, storage_writer=SafetensorsWriter(location))
    err = unwrap(info.value)
    assert isinstance(err, UnsupportedDtypeError)
    assert "'z'" in str(err) and "complex128" in str(err) and "'ok'" not in str(err)


def test_constructor_validation(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="filename_prefix"):
        SafetensorsWriter(str(tmp_path), filename_prefix="a/b")
    with pytest.raises(TypeError, match="metadata"):
        SafetensorsWriter(str(tmp_path), metadata={"n": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="max_shard_size"):
        SafetensorsWriter(str(tmp_path), max_shard_size="lots")


# ------------------------------------------------------------------------------------------- overwrite
def test_overwrite_refused_by_default(location: str) -> None:
    first = model_like_state_dict()
    dcp.save(first, storage_writer=SafetensorsWriter(location))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.zeros(3)}, storage_writer=SafetensorsWriter(location))
    err = unwrap(info.value)
    assert isinstance(err, CheckpointExistsError) and "model.safetensors" in str(err) and "overwrite=True" in str(err)
    assert mismatches(read_checkpoint(location)["tensors"], first) == []  # untouched


def test_overwrite_refused_when_only_the_index_exists(location: str) -> None:
    dcp.save(model_like_state_dict(), storage_writer=SafetensorsWriter(location, max_shard_size=12_000))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.zeros(3)}, storage_writer=SafetensorsWriter(location, max_shard_size=12_000))
    assert "model.safetensors.index.json" in str(unwrap(info.value))


def test_overwrite_true_replaces_and_removes_stale_shards(location: str) -> None:
    dcp.save(
        model_like_state_dict(),
        storage_writer=SafetensorsWriter(location, max_shard_size=12_000, allow_extra_state=True),
    )
    assert len(listing(location)) > 3
    second = {"w": torch.arange(5.0)}
    dcp.save(second, storage_writer=SafetensorsWriter(location, overwrite=True))
    assert listing(location) == ["model.safetensors"]
    assert mismatches(read_checkpoint(location)["tensors"], second) == []
    # And back to sharded over a single file.
    third = model_like_state_dict()
    dcp.save(third, storage_writer=SafetensorsWriter(location, overwrite=True, max_shard_size=12_000))
    out = read_checkpoint(location)
    assert "model.safetensors" not in listing(location)
    assert mismatches(out["tensors"], third) == []


# ------------------------------------------------------------------------------------------- crash safety
class FailingPlanner(DefaultSavePlanner):
    """Raises when asked for ``fail_on``'s data, i.e. in the middle of ``write_data``."""

    def __init__(self, fail_on: str) -> None:
        super().__init__()
        self.fail_on = fail_on

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == self.fail_on:
            raise RuntimeError(f"simulated crash while writing {self.fail_on}")
        return super().resolve_data(write_item)


@pytest.mark.parametrize("max_shard_size", ["5GB", 12_000])
def test_interrupted_save_never_looks_complete(location: str, max_shard_size: int | str) -> None:
    sd = model_like_state_dict()
    with pytest.raises(CheckpointException, match="simulated crash"):
        dcp.save(
            sd,
            storage_writer=SafetensorsWriter(location, max_shard_size=max_shard_size),
            planner=FailingPlanner("layers.2.mlp.weight"),
        )
    names = listing(location)
    assert "model.safetensors" not in names and "model.safetensors.index.json" not in names
    # A retry with overwrite=True succeeds and clears what the crash left (hidden local temp files).
    dcp.save(sd, storage_writer=SafetensorsWriter(location, max_shard_size=max_shard_size, overwrite=True))
    assert not [n for n in listing(location) if n.startswith(".")]
    assert mismatches(read_checkpoint(location)["tensors"], sd) == []


def test_replicated_views_of_one_storage_are_saved_separately(location: str) -> None:
    """Tied weights (two keys, one storage) are two full tensors in the file, as safetensors loaders expect."""
    w = torch.randn(8, 4)
    sd = {"embed.weight": w, "head.weight": w}
    dcp.save(sd, storage_writer=SafetensorsWriter(location))
    out = read_checkpoint(location)["tensors"]
    assert same_bits(out["embed.weight"], w) and same_bits(out["head.weight"], w)
