"""Planning on lazy metadata over columns gives exactly the plan torch's ``Metadata`` gives.

The column path (:mod:`dcp_storage.planners.column_plan`) builds ``ReadItem``\\ s without torch's objects;
every case here plans twice, on ``metadata_from_columns(cols)`` (torch's objects: today's path) and on
``lazy_metadata(cols)``, and compares the read items field by field (``MetadataIndex.index`` hints and
``torch.Size`` types too), in order, and the planner's result or error message.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan

from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.errors import ShapeMismatchError
from dcp_storage.formats.columns import columns_from_metadata, columns_of, metadata_from_columns
from dcp_storage.formats.dcp_native.native import lazy_metadata
from dcp_storage.planners import (
    DtypeMismatchError,
    DtypePolicy,
    IncompatibleKeysError,
    KeyMap,
    RemappingLoadPlanner,
    ValueTypeMismatchError,
)
from dcp_storage.planners.column_plan import whole_single_chunk
from dcp_storage_testing.columns import ENTRIES, columns_forced, synthetic_metadata


def _both(entries: list[Any] = ENTRIES) -> tuple[Metadata, Metadata]:
    cols = columns_from_metadata(synthetic_metadata(entries))
    assert cols is not None
    lazy = lazy_metadata(cols)
    assert columns_of(lazy) is cols
    return metadata_from_columns(cols), lazy


def _fields(plan: LoadPlan) -> list[tuple[Any, ...]]:
    def index(i: Any) -> tuple[Any, ...]:
        return (type(i).__name__, i.fqn, i.offset, type(i.offset).__name__, i.index)

    return [
        (
            item.type,
            index(item.dest_index),
            item.dest_offsets,
            type(item.dest_offsets).__name__,
            index(item.storage_index),
            item.storage_offsets,
            type(item.storage_offsets).__name__,
            item.lengths,
            type(item.lengths).__name__,
        )
        for item in plan.items
    ]


def _plan(make: Callable[[], Any], state_dict: dict[str, Any], md: Metadata) -> tuple[Any, Any]:
    planner = make()
    planner.set_up_planner(state_dict, md, True)
    try:
        plan = planner.create_local_plan()
    except Exception as exc:  # compared by type and message
        return type(exc), str(exc)
    return plan, getattr(planner, "result", None)


def _same_plan(make: Callable[[], Any], state_dict: dict[str, Any], entries: list[Any] = ENTRIES) -> LoadPlan:
    plain, lazy = _both(entries)
    want, want_result = _plan(make, state_dict, plain)
    got, got_result = _plan(make, state_dict, lazy)
    if not isinstance(want, LoadPlan):
        assert (got, got_result) == (want, want_result)
        return want
    assert isinstance(got, LoadPlan)
    assert got.items == want.items
    assert _fields(got) == _fields(want)
    assert got_result == want_result
    assert pickle.loads(pickle.dumps(got)).items == want.items  # plans travel between ranks pickled
    return got


def _state_dict(entries: list[Any] = ENTRIES, prefix: str = "", cast: dict[Any, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fqn, dtype, shape, _ in entries:
        if dtype is None:
            out[prefix + fqn] = 0
        else:
            out[prefix + fqn] = torch.zeros(shape, dtype=(cast or {}).get(dtype, dtype))
    return out


def test_whole_and_chunked_tensors_and_values() -> None:
    plan = _same_plan(RemappingLoadPlanner, _state_dict())
    assert len(plan.items) == 17 + 2 - 1  # every chunk and value, less the empty tensor's (torch reads none)
    dest = next(i for i in plan.items if i.dest_index.fqn == "model.embed.weight")
    assert dest.dest_index is dest.storage_index  # one object on the column path (equal ones on torch's)


def test_parameters_and_torchs_default_planner() -> None:
    sd = _state_dict()
    sd["model.embed.weight"] = torch.nn.Parameter(sd["model.embed.weight"])
    _same_plan(RemappingLoadPlanner, sd)
    _same_plan(DefaultLoadPlanner, sd)


@pytest.mark.parametrize(
    "key_map,prefix",
    [
        (KeyMap.add_prefix("model."), ""),
        (KeyMap.strip_prefix("net."), "net."),
        (KeyMap.rename({"model.ids": "model.mask", "model.mask": "model.ids"}), ""),
    ],
    ids=["add_prefix", "strip_prefix", "rename"],
)
def test_key_maps(key_map: KeyMap, prefix: str) -> None:
    if prefix:
        sd = _state_dict(prefix=prefix)
    elif "rename" in repr(key_map):
        sd = _state_dict()
        sd["model.ids"], sd["model.mask"] = torch.zeros(7, dtype=torch.bool), torch.zeros(10, dtype=torch.int64)
    else:
        sd = {k.removeprefix("model."): v for k, v in _state_dict().items()}
    _same_plan(lambda: RemappingLoadPlanner(key_map, strict=False), sd)
    if "add_prefix" not in repr(key_map):
        _same_plan(lambda: RemappingLoadPlanner(key_map), sd)


def test_partial_loads_and_key_errors() -> None:
    sd = _state_dict()
    del sd["model.layers.1.w"], sd["step"]
    sd["model.new"] = torch.zeros(3)
    plan = _same_plan(lambda: RemappingLoadPlanner(strict=False), sd)
    assert plan.items
    assert _same_plan(RemappingLoadPlanner, sd) is IncompatibleKeysError


def test_dtype_casts_and_refusals() -> None:
    sd = _state_dict(cast={torch.float32: torch.float64, torch.int64: torch.int32})
    _same_plan(RemappingLoadPlanner, sd)
    assert _same_plan(lambda: RemappingLoadPlanner(dtype_policy=DtypePolicy.exact()), sd) is DtypeMismatchError
    sd["model.ids"] = torch.zeros(10)  # int -> float: refused by cast()
    assert _same_plan(RemappingLoadPlanner, sd) is DtypeMismatchError


def test_shape_and_kind_mismatches() -> None:
    sd = _state_dict()
    sd["model.embed.weight"] = torch.zeros(8, 16)
    sd["model.layers.0.b"] = torch.zeros(13)
    assert _same_plan(RemappingLoadPlanner, sd) is ShapeMismatchError
    sd = _state_dict()
    sd["model.ids"] = [1, 2]
    assert _same_plan(RemappingLoadPlanner, sd) is ValueTypeMismatchError


def test_flatten_mappings_nested_state_dicts() -> None:
    def nest(flat: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in flat.items():
            head, _, rest = k.partition(".")
            if rest:
                out.setdefault(head, {})[rest] = v
            else:
                out[k] = v
        return out

    sd = nest(_state_dict())
    ours, torchs = RemappingLoadPlanner(), DefaultLoadPlanner()
    ours.set_up_planner(sd, None, True)
    torchs.set_up_planner(sd, None, True)
    assert list(ours.state_dict.items()) == list(torchs.state_dict.items())
    assert list(ours.mappings.items()) == list(torchs.mappings.items())
    _same_plan(RemappingLoadPlanner, sd)
    sd["model"]["extra"] = [torch.zeros(2)]  # a list: torch's own flattening
    _same_plan(lambda: RemappingLoadPlanner(strict=False), sd)
    with pytest.raises(ValueError, match="duplicated flatten key model.ids"):
        RemappingLoadPlanner().set_up_planner({**sd, "model.ids": torch.zeros(1)}, None, True)


def test_random_chunkings_into_whole_tensors() -> None:
    """Row, column and grid shardings, uneven, listed in any order, with empty chunks: same items."""
    rng = np.random.default_rng(5)
    entries = []
    for n in range(40):
        ndim = int(rng.integers(1, 4))
        shape = [int(rng.integers(1, 7)) for _ in range(ndim)]
        cuts = [sorted({0, s, *rng.integers(0, s + 1, size=int(rng.integers(0, 3))).tolist()}) for s in shape]
        boxes = [
            ([a for a, _ in box], [b - a for a, b in box])
            for box in itertools.product(*([(c[i], c[i + 1]) for i in range(len(c) - 1)] for c in cuts))
        ]
        rng.shuffle(boxes)
        if n % 5 == 0:  # an empty chunk at the end of dim 0
            boxes.insert(int(rng.integers(0, len(boxes) + 1)), ([shape[0]] + [0] * (ndim - 1), [0] * ndim))
        entries.append((f"t{n}", torch.float32, shape, boxes))
    _, lazy = _both(entries)
    cols = columns_of(lazy)
    assert cols is not None and 0 < int(whole_single_chunk(cols).sum()) < len(entries)
    _same_plan(RemappingLoadPlanner, _state_dict(entries), entries)


def test_dcp_load_on_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real load through ``FsspecReader`` with lazy metadata: the values arrive, with both planners."""
    g = torch.Generator().manual_seed(1)
    saved = {
        "model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16)},
        "step": 5,
    }
    dcp.save(saved, storage_writer=FsspecWriter(tmp_path), no_dist=True)
    for planner in (RemappingLoadPlanner(), RemappingLoadPlanner(dtype_policy=DtypePolicy.cast()), None):
        out = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.float32)}, "step": 0}
        with columns_forced(monkeypatch):
            dcp.load(out, storage_reader=FsspecReader(tmp_path), planner=planner, no_dist=True)
        assert torch.equal(out["model"]["w"], saved["model"]["w"])
        assert torch.equal(out["model"]["b"], saved["model"]["b"].float())
        assert out["step"] == 5


def test_readers_plan_steps_on_columns(tmp_path: Path) -> None:
    """What the reader's strategies ask per item (stored dtype, splittable) and its key check: as on torch's."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from dcp_storage.errors import CorruptCheckpointError
    from dcp_storage.planners.planner import check_planned_keys
    from dcp_storage.strategies.read_strategy import MetadataItems

    md = synthetic_metadata()
    index = next(i for i in md.storage_data if i.fqn == "model.layers.1.w")
    info = md.storage_data[index]
    md.storage_data[index] = _StorageInfo(info.relative_path, info.offset, info.length, ["stream.zstd"])
    cols = columns_from_metadata(md)
    assert cols is not None and cols.transforms
    plain, lazy = metadata_from_columns(cols), lazy_metadata(cols)
    plan, _ = _plan(RemappingLoadPlanner, _state_dict(), plain)
    dtypes = [[], []]
    for n, metadata in enumerate((plain, lazy)):
        stored = MetadataItems(metadata)
        for item in plan.items:
            try:
                dtypes[n].append(stored.dtype(item))
            except CorruptCheckpointError as exc:
                dtypes[n].append(str(exc))
    assert dtypes[0] == dtypes[1] and "no tensor 'step' in the checkpoint metadata" in dtypes[0]
    for verify in (False, True):
        split = []
        for metadata in (plain, lazy):
            reader = FsspecReader(tmp_path, verify=verify)
            reader.set_up_storage_reader(metadata, True)
            split.append([reader._splittable(item) for item in plan.items])
        assert split[0] == split[1] and (not any(split[0]) if verify else split[0].count(False) == 1)
    planner = DefaultLoadPlanner()
    sd = _state_dict()
    sd["model.nope"] = torch.zeros(1)
    planner.set_up_planner(sd, plain, True)
    errors = []
    for metadata in (plain, lazy):
        with pytest.raises(IncompatibleKeysError) as info_:
            check_planned_keys(planner, metadata)
        errors.append(str(info_.value))
    assert errors[0] == errors[1] and "model.nope" in errors[0]
