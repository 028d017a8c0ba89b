"""``RemappingLoadPlanner`` end to end in one process: real checkpoints on disk, ``dcp.load``.

Most tests run on three writer/reader pairs: torch's ``FileSystemWriter``/``FileSystemReader``, ours
(``FsspecWriter``/``FsspecReader``), and torch-written read by ours. Values are compared bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.errors import ShapeMismatchError, UnsafeCheckpointError
from dcp_storage.planners import (
    DtypeMismatchError,
    DtypePolicy,
    IncompatibleKeysError,
    KeyCollisionError,
    KeyMap,
    KeyRules,
    RemappingLoadPlanner,
    ValueTypeMismatchError,
)
from dcp_storage_testing.compare import same_bits
from dcp_storage_testing.models import build_model, reference_state_dict

SEED = 11
SHAPE = {"vocab": 32, "dim": 16, "hidden": 24, "layers": 2}


# ------------------------------------------------------------------------------------------ helpers
@dataclass
class Backend:
    name: str
    writer: Callable[[str], Any]
    reader: Callable[[str], Any]
    root: Path

    def save(self, state_dict: dict[str, Any], name: str = "ckpt") -> str:
        path = str(self.root / f"{self.name}-{name}")
        dcp.save(state_dict, storage_writer=self.writer(path))
        return path

    def load(self, state_dict: dict[str, Any], path: str, planner: Any) -> None:
        dcp.load(state_dict, storage_reader=self.reader(path), planner=planner)


PAIRS = {
    "torch": (FileSystemWriter, FileSystemReader),
    "ours": (FsspecWriter, FsspecReader),
    "torch-written-ours-read": (FileSystemWriter, FsspecReader),
}


@pytest.fixture(params=list(PAIRS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    writer, reader = PAIRS[request.param]
    return Backend(request.param, writer, reader, tmp_path)


@pytest.fixture
def ours(tmp_path: Path) -> Backend:
    return Backend("ours", FsspecWriter, FsspecReader, tmp_path)


def reference() -> dict[str, torch.Tensor]:
    return reference_state_dict(SEED, **SHAPE)


def blank_like(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Destinations that differ from every saved value (NaN), so a missed write shows."""
    return {k: torch.full_like(v, float("nan")) for k, v in sd.items()}


def assert_loaded(actual: dict[str, Any], expected: dict[str, torch.Tensor]) -> None:
    bad = [k for k, v in expected.items() if not same_bits(actual[k], v)]
    assert not bad, f"differ from the reference: {bad}"


def unwrap(exc: BaseException) -> BaseException:
    """Rank 0's exception inside DCP's ``CheckpointException``."""
    if isinstance(exc, CheckpointException):
        (inner, _trace), *_ = exc.failures.values()
        return inner
    return exc


class DDPLike(nn.Module):
    """Names parameters ``module.<fqn>`` as DDP (and DataParallel) do."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


# ----------------------------------------------------------------------------------------- prefixes
def test_ddp_checkpoint_into_plain_model(backend: Backend) -> None:
    ref = reference()
    path = backend.save(DDPLike(build_model(SEED, **SHAPE)).state_dict())
    sd = blank_like(ref)
    planner = RemappingLoadPlanner(KeyMap.add_prefix("module."))
    backend.load(sd, path, planner)
    assert_loaded(sd, ref)
    assert planner.result is not None
    assert planner.result.missing_keys == [] and planner.result.unexpected_keys == []
    assert planner.result.renamed["embed.weight"] == "module.embed.weight"


def test_plain_checkpoint_into_ddp_model(backend: Backend) -> None:
    ref = reference()
    path = backend.save(build_model(SEED, **SHAPE).state_dict())
    wrapped = DDPLike(build_model(SEED + 1, **SHAPE))
    backend.load(wrapped.state_dict(), path, RemappingLoadPlanner(KeyMap.strip_prefix("module.")))
    assert_loaded(wrapped.module.state_dict(), ref)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch._dynamo's import warns about torch.jit
def test_torch_compile_names_both_ways(ours: Backend) -> None:
    ref = reference()
    compiled = torch.compile(build_model(SEED, **SHAPE))  # lazy: nothing compiles until a forward
    saved = compiled.state_dict()
    assert next(iter(saved)).startswith("_orig_mod.")
    path = ours.save(saved, "compiled")
    plain = blank_like(ref)
    ours.load(plain, path, RemappingLoadPlanner(KeyMap.add_prefix("_orig_mod.")))
    assert_loaded(plain, ref)

    plain_path = ours.save(ref, "plain")
    target = torch.compile(build_model(SEED + 1, **SHAPE))
    ours.load(target.state_dict(), plain_path, RemappingLoadPlanner(KeyMap.strip_prefix("_orig_mod.")))
    assert_loaded(target._orig_mod.state_dict(), ref)


def test_nested_state_dict_scoped_map_with_byte_items(backend: Backend) -> None:
    """``{"model": ..., "extra": ...}`` with tensors, BYTE_IO values and a scoped prefix map."""
    ref = reference()
    saved = {
        "model": {"module." + k: v for k, v in ref.items()} | {"module.note": "bf16 run"},
        "extra": {"step": torch.tensor(7), "lr": 0.25, "tags": ["a", "b"]},
    }
    path = backend.save(saved)
    sd = {"model": blank_like(ref) | {"note": None}, "extra": {"step": torch.tensor(0), "lr": 0.0, "tags": []}}
    planner = RemappingLoadPlanner(KeyMap.within("model.", KeyMap.add_prefix("module.")))
    backend.load(sd, path, planner)
    assert_loaded(sd["model"], ref)
    assert sd["model"]["note"] == "bf16 run"
    assert int(sd["extra"]["step"]) == 7 and sd["extra"]["lr"] == 0.25 and sd["extra"]["tags"] == ["a", "b"]
    assert planner.result is not None and planner.result.renamed["model.note"] == "model.module.note"


def test_regex_and_callable(backend: Backend) -> None:
    ref = reference()
    # FSDP1-style names in the checkpoint: _fsdp_wrapped_module. inside each block.
    fsdp1 = {
        k.replace("blocks.0.", "blocks.0._fsdp_wrapped_module.").replace(
            "blocks.1.", "blocks.1._fsdp_wrapped_module."
        ): v
        for k, v in ref.items()
    }
    path = backend.save(fsdp1, "fsdp1")
    sd = blank_like(ref)
    backend.load(sd, path, RemappingLoadPlanner(KeyMap.regex(r"^(blocks\.\d+)\.", r"\1._fsdp_wrapped_module.")))
    assert_loaded(sd, ref)

    hf_like = {k.replace("mlp_up", "fc1").replace("mlp_down", "fc2"): v for k, v in ref.items()}
    path = backend.save(hf_like, "renamed")
    sd = blank_like(ref)
    backend.load(
        sd, path, RemappingLoadPlanner(KeyMap.callable(lambda k: k.replace("mlp_up", "fc1").replace("mlp_down", "fc2")))
    )
    assert_loaded(sd, ref)


def test_collision_is_an_error_before_reading(ours: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = reference()
    path = ours.save(ref)
    reader = FsspecReader(path)
    monkeypatch.setattr(reader, "read_data", _no_read)
    sd = blank_like(ref) | {"module.embed.weight": torch.empty_like(ref["embed.weight"])}
    with pytest.raises(CheckpointException) as info:
        dcp.load(sd, storage_reader=reader, planner=RemappingLoadPlanner(KeyMap.strip_prefix("module.")))
    err = unwrap(info.value)
    assert isinstance(err, KeyCollisionError)
    assert err.collisions == {"embed.weight": ["embed.weight", "module.embed.weight"]}


def _no_read(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("read_data must not run when planning fails")


# ------------------------------------------------------------------------------------------- dtypes
def special_values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * 100
    flat = t.view(-1)
    flat[:6] = torch.tensor([float("inf"), -float("inf"), -0.0, 1e-40, 3.0e38, 1.00390625])
    return t


@pytest.mark.parametrize(("stored", "dest"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_dtype_cast_is_bit_exact(backend: Backend, stored: torch.dtype, dest: torch.dtype) -> None:
    values = {"w": special_values((48, 40), 1), "b": special_values((40,), 2), "t": special_values((40, 48), 3)}
    saved = {k: v.to(stored) for k, v in values.items()}
    path = backend.save(saved)
    expected = {k: v.to(dest) for k, v in saved.items()}  # what .to(dtype) of the reference gives
    sd: dict[str, Any] = {k: torch.full_like(v, float("nan")) for k, v in expected.items()}
    sd["t"] = torch.full((48, 40), float("nan"), dtype=dest).t()  # non-contiguous destination
    planner = RemappingLoadPlanner()
    backend.load(sd, path, planner)
    assert_loaded(sd, expected)
    assert planner.result is not None and planner.result.casts == {k: (stored, dest) for k in values}


def test_dtype_policies_refuse_before_reading(ours: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ours.save({"w": torch.ones(4, dtype=torch.bfloat16), "ids": torch.arange(4.0)})
    for policy, sd, words in [
        (DtypePolicy.exact(), {"w": torch.zeros(4)}, ["'w'", "torch.bfloat16", "torch.float32"]),
        (DtypePolicy.cast(), {"ids": torch.zeros(4, dtype=torch.int64)}, ["'ids'", "torch.int64", "explicit"]),
        (DtypePolicy.explicit({torch.float32: torch.float16}), {"w": torch.zeros(4)}, ["'w'"]),
    ]:
        reader = FsspecReader(path)
        monkeypatch.setattr(reader, "read_data", _no_read)
        with pytest.raises(CheckpointException) as info:
            dcp.load(sd, storage_reader=reader, planner=RemappingLoadPlanner(strict=False, dtype_policy=policy))
        err = unwrap(info.value)
        assert isinstance(err, DtypeMismatchError), err
        assert all(w in str(err) for w in words), str(err)
    sd = {"ids": torch.zeros(4, dtype=torch.int64)}
    ours.load(sd, path, RemappingLoadPlanner(strict=False, dtype_policy=DtypePolicy.unchecked()))
    assert sd["ids"].tolist() == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------- strict
def test_strict_false_report_matches_nn_module(backend: Backend) -> None:
    ref = reference()
    saved = {k: v for k, v in ref.items() if k not in ("head.weight", "blocks.1.norm.bias")}
    saved |= {"blocks.0.extra": torch.ones(3), "extra.w": torch.ones(2), "zzz": torch.ones(1)}
    path = backend.save(saved)

    model = build_model(SEED + 1, **SHAPE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = build_model(SEED + 1, **SHAPE).load_state_dict(saved, strict=False)

    planner = RemappingLoadPlanner(strict=False)
    backend.load(model.state_dict(), path, planner)
    result = planner.result
    assert result is not None
    assert sorted(result.missing_keys) == sorted(expected.missing_keys) == ["blocks.1.norm.bias", "head.weight"]
    assert sorted(result.unexpected_keys) == sorted(expected.unexpected_keys)
    assert len(result.unexpected_keys) == 3
    got = model.state_dict()
    assert_loaded(got, {k: v for k, v in ref.items() if k in saved})
    assert_loaded(got, {k: before[k] for k in result.missing_keys})  # left untouched


def test_strict_true_error_names_keys_and_hints(ours: Backend) -> None:
    ref = reference()
    path = ours.save({"module." + k: v for k, v in ref.items()} | {"module.extra": torch.ones(1)})
    with pytest.raises(CheckpointException) as info:
        ours.load(blank_like(ref), path, RemappingLoadPlanner())
    err = unwrap(info.value)
    assert isinstance(err, IncompatibleKeysError) and isinstance(err, RuntimeError)
    assert sorted(err.missing_keys) == sorted(ref)
    assert len(err.unexpected_keys) == len(ref) + 1
    text = str(err)
    assert f"{len(ref)} missing key(s)" in text and "'blocks.0.attn_out.weight'" in text
    assert "... and 10 more" in text  # 20 keys, 10 shown
    assert "'module.embed.weight'" in text
    assert "KeyMap.add_prefix('module.')" in text  # the hint
    assert "IncompatibleKeysError" in str(info.value) and "'module.embed.weight'" in str(info.value)  # DCP's text

    # With the map only the extra checkpoint key is left; strict fails on it, unless ignored.
    with pytest.raises(CheckpointException) as info:
        ours.load(blank_like(ref), path, RemappingLoadPlanner(KeyMap.add_prefix("module.")))
    err = unwrap(info.value)
    assert isinstance(err, IncompatibleKeysError)
    assert err.missing_keys == [] and err.unexpected_keys == ["module.extra"]
    sd = blank_like(ref)
    ours.load(sd, path, RemappingLoadPlanner(KeyMap.add_prefix("module."), strict=KeyRules.strict(["module.extra"])))
    assert_loaded(sd, ref)


# -------------------------------------------------------------------------------------- shapes, types
def test_shape_mismatch_names_key_and_shapes_before_reading(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = reference()
    path = backend.save({"module." + k: v for k, v in ref.items()})
    reader = backend.reader(path)
    monkeypatch.setattr(reader, "read_data", _no_read)
    sd = blank_like(ref)
    sd["head.weight"] = torch.zeros(SHAPE["vocab"] + 1, SHAPE["dim"])
    with pytest.raises(CheckpointException) as info:
        dcp.load(sd, storage_reader=reader, planner=RemappingLoadPlanner(KeyMap.add_prefix("module.")))
    err = unwrap(info.value)
    assert isinstance(err, ShapeMismatchError), err
    text = str(err)
    assert "'head.weight'" in text and "'module.head.weight'" in text
    assert f"({SHAPE['vocab']}, {SHAPE['dim']})" in text and f"({SHAPE['vocab'] + 1}, {SHAPE['dim']})" in text


def test_non_tensor_destination_for_tensor_is_an_error(ours: Backend) -> None:
    path = ours.save({"step": torch.tensor(3)})
    with pytest.raises(CheckpointException) as info:
        ours.load({"step": 0}, path, RemappingLoadPlanner())
    err = unwrap(info.value)
    assert isinstance(err, ValueTypeMismatchError) and "'step'" in str(err)


# ------------------------------------------------------------------------------------------ BYTE_IO
CALLS: list[str] = []


def record_call(tag: str) -> str:
    CALLS.append(tag)
    return tag


class Payload:
    """Unpickling this calls ``record_call``: a stand-in for a malicious checkpoint."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (record_call, ("payload ran",))


class Trusted:
    def __init__(self, value: int = 0) -> None:
        self.value = value


@pytest.fixture
def calls() -> Iterator[list[str]]:
    CALLS.clear()
    yield CALLS
    CALLS.clear()


def test_byte_io_is_loaded_with_weights_only(backend: Backend, calls: list[str]) -> None:
    path = backend.save({"module.w": torch.ones(2), "module.payload": Payload()})
    sd: dict[str, Any] = {"w": torch.zeros(2), "payload": None}
    with pytest.raises(CheckpointException) as info:
        backend.load(sd, path, RemappingLoadPlanner(KeyMap.add_prefix("module.")))
    err = unwrap(info.value)
    # FsspecReader refuses unsafe BYTE_IO itself; torch's reader hands the bytes to our load_bytes.
    assert isinstance(err, UnsafeCheckpointError), err
    assert "'module.payload'" in str(err) and "record_call" in err.forbidden
    if backend.reader is FileSystemReader:
        assert "state-dict key 'payload'" in str(err)
    assert calls == [], "the checkpoint's code ran"


def test_byte_io_safe_globals_allow_a_trusted_class(backend: Backend) -> None:
    path = backend.save({"obj": Trusted(5)})
    sd: dict[str, Any] = {"obj": None}
    with pytest.raises(CheckpointException) as info:
        backend.load(sd, path, RemappingLoadPlanner())
    assert isinstance(unwrap(info.value), UnsafeCheckpointError)
    with torch.serialization.safe_globals([Trusted]):  # trusted for every layer of this load
        backend.load(sd, path, RemappingLoadPlanner())
    assert isinstance(sd["obj"], Trusted) and sd["obj"].value == 5


def test_planner_safe_globals(tmp_path: Path) -> None:
    """``safe_globals=`` trusts a class for the planner's own decode (torch's reader checks nothing)."""
    path = os.fspath(tmp_path / "ckpt")
    dcp.save({"obj": Trusted(6)}, storage_writer=FileSystemWriter(path))
    sd: dict[str, Any] = {"obj": None}
    dcp.load(sd, storage_reader=FileSystemReader(path), planner=RemappingLoadPlanner(safe_globals=[Trusted]))
    assert isinstance(sd["obj"], Trusted) and sd["obj"].value == 6


def test_torch_default_planner_would_run_it(tmp_path: Path, calls: list[str]) -> None:
    """Why load_bytes is overridden: torch's DefaultLoadPlanner unpickles with weights_only=False."""
    path = os.fspath(tmp_path / "ckpt")
    dcp.save({"payload": Payload()}, storage_writer=FileSystemWriter(path))
    dcp.load({"payload": None}, storage_reader=FileSystemReader(path))
    assert calls == ["payload ran"]


def test_whole_tensor_items_are_torchs_own() -> None:
    """``build_read_items``'s shortcut for a plain tensor stored whole gives exactly torch's read items;
    everything else (another shape, several chunks, an empty or offset chunk, a Parameter) goes to torch."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as TSM

    from dcp_storage._torch import create_read_items
    from dcp_storage.planners.matching import build_read_items

    def one(shape: list[int]) -> TSM:
        return TSM(
            TensorProperties(dtype=torch.float32),
            torch.Size(shape),
            [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))],
        )

    halves = TSM(
        TensorProperties(dtype=torch.float32),
        torch.Size([4, 2]),
        [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 2])),
        ],
    )
    cases = {
        "scalar": (one([]), torch.zeros(())),
        "vector": (one([5]), torch.zeros(5)),
        "matrix": (one([3, 4]), torch.zeros(3, 4)),
        "empty": (one([0, 4]), torch.zeros(0, 4)),
        "smaller": (one([6]), torch.zeros(4)),
        "halves": (halves, torch.zeros(4, 2)),
        "parameter": (one([2]), torch.nn.Parameter(torch.zeros(2))),
    }
    metadata = Metadata(state_dict_metadata={f"ckpt.{k}": md for k, (md, _v) in cases.items()})
    state = {k: v for k, (_md, v) in cases.items()}
    pairs = {k: f"ckpt.{k}" for k in cases}
    ours = build_read_items(state, metadata, pairs)
    theirs = []
    for key, (md, value) in cases.items():
        for item in create_read_items(f"ckpt.{key}", md, value):
            dest = item.dest_index
            theirs.append(replace(item, dest_index=MetadataIndex(key, dest.offset, dest.index)))
    assert ours == theirs
    for a, b in zip(ours, theirs):  # and the same types inside (torch.Size, not lists)
        assert (type(a.dest_offsets), type(a.lengths), a.dest_index.index) == (
            type(b.dest_offsets),
            type(b.lengths),
            b.dest_index.index,
        )
        assert a.storage_index.index == b.storage_index.index
