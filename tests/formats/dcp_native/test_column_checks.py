"""``columns_sound`` gives ``metadata_problems``' verdict on columns: differential, over generated metadata.

Each case is a random ``Metadata`` (seeded): tensors cut into chunks (one, a run along an axis, a grid)
then perhaps damaged (a gap, an overlap, a chunk outside its tensor, a huge or negative dimension, a byte
count past 2**63), records laid out as torch's native writer or the DCP-safetensors layout does, then
perhaps damaged (a path leaving the checkpoint, a negative or impossible byte range, two records sharing
bytes, records shorter than their chunk around the broadcast limit, transform descriptors), properties of
the wrong types, storage metadata missing a field. Wherever the reference builder gives columns, the two
verdicts must agree; the cases are checked to reach both verdicts and most kinds of damage.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage.formats.columns import MetadataColumns, columns_from_metadata, metadata_from_columns
from dcp_storage.formats.dcp_native.column_checks import columns_sound
from dcp_storage.formats.dcp_native.metadata_checks import metadata_problems
from dcp_storage.formats.paths import MAX_BYTES

CAP = 256  # DCP_STORAGE_MAX_BROADCAST_BYTES in these tests: broadcast totals just under and over it
DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool, torch.complex64]
GOOD_FILES = ["__0_0.distcp", "__1_0.distcp", "sub/__2_0.distcp"]
BAD_FILES = ["../x.distcp", "/abs.distcp", "s3://other/x", "a/./b", "%2e%2e/x", "", "dir/", "C:x", "ok\x00"]


@pytest.fixture(autouse=True)
def _small_broadcast_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCP_STORAGE_MAX_BROADCAST_BYTES", str(CAP))


def _split(n: int, k: int, rng: random.Random) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``k`` runs (some empty when ``n < k``)."""
    cuts = sorted(rng.randint(0, n) for _ in range(k - 1))
    bounds = [0, *cuts, n]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(k)]


def _boxes(shape: list[int], rng: random.Random, damage: Counter[str]) -> list[tuple[list[int], list[int]]]:
    ndim = len(shape)
    mode = (
        rng.choice(["one"] * 4 + ["axis"] * 4 + ["grid"] * 3 + ["none"]) if ndim else rng.choice(["one"] * 9 + ["none"])
    )
    if mode == "none":
        boxes: list[tuple[list[int], list[int]]] = []
    elif mode == "one":
        boxes = [([0] * ndim, list(shape))]
    elif mode == "axis":
        axis = rng.randrange(ndim)
        boxes = []
        for start, length in _split(shape[axis], rng.randint(2, 4), rng):
            off, size = [0] * ndim, list(shape)
            off[axis], size[axis] = start, length
            boxes.append((off, size))
    else:
        runs = [_split(s, rng.randint(1, 3), rng) for s in shape]
        boxes = [([r[0] for r in cell], [r[1] for r in cell]) for cell in _product(runs)]
    if rng.random() < 0.2 and boxes:
        kind = rng.choice(["gap", "overlap", "outside", "negative", "grow", "shuffle", "shift"])
        damage[kind] += 1
        i = rng.randrange(len(boxes))
        off, size = list(boxes[i][0]), list(boxes[i][1])
        if kind == "gap":
            del boxes[i]
            return boxes
        if kind == "shuffle":
            rng.shuffle(boxes)
            return boxes
        if not ndim:
            return boxes
        d = rng.randrange(ndim)
        if kind == "overlap" and off[d] > 0:
            off[d] -= 1
            size[d] += 1
        elif kind == "outside":
            size[d] += rng.choice([1, 2**62, MAX_BYTES])
        elif kind == "negative":
            off[d] = -1
        elif kind == "grow":
            size[d] = max(0, size[d] - 1)
        elif kind == "shift":
            off[d] += 1
        boxes[i] = (off, size)
    # distinct offsets per tensor: two chunks at one offset have no columns (a case for the general path)
    # (keeping the one holding the most elements: a run cut empty starts where the next one does)
    best: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
    for off, size in boxes:
        kept = best.get(tuple(off))
        if kept is None or math.prod(size) > math.prod(kept[1]):
            best[tuple(off)] = (off, size)
    return list(best.values())


def _product(runs: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    out: list[list[tuple[int, int]]] = [[]]
    for r in runs:
        out = [cell + [x] for cell in out for x in r]
    return out


def _shape(rng: random.Random, damage: Counter[str]) -> list[int]:
    ndim = rng.choice([0, 1, 1, 2, 2, 3])
    shape = [rng.choice([0, 1, 2, 3, 4, 5, 7]) for _ in range(ndim)]
    if ndim and rng.random() < 0.04:
        kind = rng.choice(["huge", "huge_zero", "near_limit", "negative_dim"])
        damage[kind] += 1
        d = rng.randrange(ndim)
        if kind == "huge":
            shape[d] = rng.choice([2**62, MAX_BYTES, 2**40])
        elif kind == "huge_zero":  # bytes 0: fine
            shape = [MAX_BYTES] * ndim
            shape[d] = 0
        elif kind == "near_limit":  # prod * itemsize right at 2**63 - 1 or 2**63
            shape = [1] * ndim
            shape[d] = rng.choice([2**61 - 1, 2**61, 2**60, 2**62 - 1, 2**63 - 1])
        else:
            shape[d] = -rng.choice([1, 2**62])
    return shape


def _properties(rng: random.Random, damage: Counter[str]) -> TensorProperties:
    props = TensorProperties(dtype=rng.choice(DTYPES))
    if rng.random() < 0.02:
        kind = rng.choice(["grad_int", "pin_none", "layout_str", "dtype_str", "no_dtype"])
        damage[kind] += 1
        if kind == "grad_int":
            props.requires_grad = 1  # type: ignore[assignment]
        elif kind == "pin_none":
            props.pin_memory = None  # type: ignore[assignment]
        elif kind == "layout_str":
            props.layout = "strided"  # type: ignore[assignment]
        elif kind == "dtype_str":
            props.dtype = "float32"  # type: ignore[assignment]
        else:
            del props.dtype
    return props


class _Layout:
    """Byte ranges in files as a writer lays them out: native records (elements plus a zip) or raw elements."""

    def __init__(self, rng: random.Random, safetensors: bool) -> None:
        self.rng = rng
        self.safetensors = safetensors
        self.ends = dict.fromkeys(GOOD_FILES, 0)

    def record(self, nbytes: int, damage: Counter[str]) -> _StorageInfo:
        rng = self.rng
        rel = rng.choice(GOOD_FILES)
        length = nbytes if self.safetensors else nbytes + rng.choice([64, 512])  # a zip around the elements
        if length > 2**40:
            length = rng.choice([0, 1000])  # a huge (or broadcast) tensor stored in a few bytes
        offset = self.ends[rel]
        transform = None
        if rng.random() < 0.06:
            kind = rng.choice(["bad_file", "neg_offset", "past_end", "shared", "broadcast", "transform", "empty_tr"])
            damage[kind] += 1
            if kind == "bad_file":
                rel = rng.choice(BAD_FILES)
            elif kind == "neg_offset":
                offset = -rng.choice([1, 2**62])
            elif kind == "past_end":
                offset = MAX_BYTES - rng.choice([0, 1, length // 2])
            elif kind == "shared":
                offset = max(0, offset - rng.choice([1, 8, 64]))
            elif kind == "broadcast":
                length = max(0, nbytes - rng.choice([1, CAP // 2, CAP, CAP + 1]))
            elif kind == "transform":
                transform = ["zstd"]
                length = max(1, nbytes // 2)
            else:
                transform = []
        self.ends[rel] = max(self.ends.get(rel, 0), offset + max(length, 0))
        return _StorageInfo(rel, offset, length, transform)


def _metadata(seed: int, damage: Counter[str]) -> Metadata:
    rng = random.Random(seed)
    layout = _Layout(rng, safetensors=rng.random() < 0.3)
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for k in range(rng.randint(1, 7)):
        fqn = f"layer{k}.w"
        if rng.random() < 0.15:
            state[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = layout.record(rng.choice([0, 5, 300]), damage)
            continue
        shape = _shape(rng, damage)
        props = _properties(rng, damage)
        boxes = _boxes(shape, rng, damage) if all(s >= 0 for s in shape) else [([0] * len(shape), list(shape))]
        chunks = [ChunkStorageMetadata(torch.Size(o) if min(o, default=0) >= 0 else o, s) for o, s in boxes]  # type: ignore[arg-type]
        size = torch.Size(shape) if min(shape, default=0) >= 0 else shape
        state[fqn] = TensorStorageMetadata(props, size, chunks)  # type: ignore[arg-type]
        itemsize = props.dtype.itemsize if isinstance(getattr(props, "dtype", None), torch.dtype) else 4
        for o, s in boxes:
            nbytes = math.prod(s) * itemsize if min(s, default=0) >= 0 else 0
            key = MetadataIndex(fqn)
            object.__setattr__(key, "offset", tuple(o))  # MetadataIndex(fqn, o) refuses negative offsets
            storage[key] = layout.record(nbytes, damage)
    meta: Any = rng.choice([None, StorageMeta(), StorageMeta(checkpoint_id="x", modules=["m"])])
    if rng.random() < 0.03:
        damage["storage_meta_str"] += 1
        meta = "not a StorageMeta"
    elif rng.random() < 0.03:
        damage["storage_meta_incomplete"] += 1
        meta = StorageMeta()
        del meta.modules
    return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=meta)


def test_verdicts_agree_on_generated_metadata() -> None:
    damage: Counter[str] = Counter()
    verdicts: Counter[bool] = Counter()
    skipped = 0
    for seed in range(4000):
        md = _metadata(seed, damage)
        cols = columns_from_metadata(md)
        if cols is None:
            skipped += 1
            continue
        expected = metadata_problems(md, "ckpt/.metadata")
        assert columns_sound(cols, "ckpt/.metadata") == (not expected), (seed, expected)
        verdicts[not expected] += 1
        if not expected:  # the columns' own metadata (what the fast path would serve) is as sound
            assert metadata_problems(metadata_from_columns(cols), "ckpt/.metadata") == []
    assert verdicts[True] > 800 and verdicts[False] > 800, verdicts
    assert skipped < 800, skipped
    assert len(damage) >= 25, damage


def _sound_columns() -> MetadataColumns:
    rng = random.Random(1)
    for seed in range(100):
        md = _metadata(seed, Counter())
        cols = columns_from_metadata(md)
        if cols is not None and columns_sound(cols, "p") and len(cols) >= 3 and cols.dims.size and rng:
            return cols
    raise AssertionError("no sound case")


@pytest.mark.parametrize(
    "change",
    [
        {"shape_at": lambda c: c.shape_at[:-1]},
        {"dims": lambda c: c.dims.astype(np.int32)},
        {"chunk_at": lambda c: np.concatenate((c.chunk_at[:-1], [c.chunk_at[-1] + 1]))},
        {"box_at": lambda c: c.box_at[::-1].copy()},
        {"file": lambda c: np.full_like(c.file, len(c.files))},
        {"transform": lambda c: np.full_like(c.transform, -2)},
        {"prop": lambda c: np.full_like(c.prop, len(c.properties))},
        {"names": lambda c: [c.names[0]] * len(c.names)},
        {"names": lambda c: [b"x", *c.names[1:]]},
        {"chunk_sizes": lambda c: c.chunk_sizes[:-1]},
        {"is_bytes": lambda c: np.ones_like(c.is_bytes)},
        {"transforms": lambda c: [None]},
    ],
)
def test_inconsistent_columns_are_refused(change: dict[str, Any]) -> None:
    """A decoder's bug (arrays that disagree with each other) is never taken as sound."""
    cols = _sound_columns()
    ((name, fn),) = change.items()
    bad = dataclasses.replace(cols, **{name: fn(cols)})
    if name == "transforms":
        bad = dataclasses.replace(bad, transform=np.zeros_like(cols.transform))
    assert columns_sound(cols, "p")
    assert not columns_sound(bad, "p")


def test_duplicate_offsets_give_no_columns() -> None:
    """Two chunks of one tensor at one offset (two records would share one MetadataIndex): the general path."""
    props = TensorProperties(dtype=torch.float32)
    chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([0])) for _ in range(2)]
    chunks.append(ChunkStorageMetadata(torch.Size([0]), torch.Size([4])))
    state = {"w": TensorStorageMetadata(props, torch.Size([4]), chunks)}
    storage = {
        MetadataIndex("w", [0]): _StorageInfo("__0_0.distcp", 0, 100),
        MetadataIndex("w", [2]): _StorageInfo("../orphan", 0, 100),
    }
    assert columns_from_metadata(Metadata(state, storage_data=storage)) is None  # type: ignore[arg-type]


def test_property_types_are_not_merged() -> None:
    """``requires_grad=1`` next to ``True``: two rows, so the malformed one is seen."""
    good, bad = TensorProperties(torch.float32, requires_grad=True), TensorProperties(torch.float32)
    bad.requires_grad = 1  # type: ignore[assignment]
    state, storage = {}, {}
    for k, props in enumerate((good, bad)):
        state[f"t{k}"] = TensorStorageMetadata(
            props, torch.Size([1]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))]
        )
        storage[MetadataIndex(f"t{k}", [0])] = _StorageInfo("__0_0.distcp", 100 * k, 4)
    md = Metadata(state, storage_data=storage)  # type: ignore[arg-type]
    cols = columns_from_metadata(md)
    assert cols is not None and len(cols.properties) == 2
    assert metadata_problems(md, "p") and not columns_sound(cols, "p")


def test_integers_beyond_int64_give_no_columns() -> None:
    props = TensorProperties(torch.float32)
    state = {
        "w": TensorStorageMetadata(
            props, torch.Size([2**64]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([2**64]))]
        )
    }
    storage = {MetadataIndex("w", [0]): _StorageInfo("__0_0.distcp", 0, 4)}
    assert columns_from_metadata(Metadata(state, storage_data=storage)) is None  # type: ignore[arg-type]


def _broadcast_case(excesses: list[int], transforms: list[list[str] | None]) -> Metadata:
    """One fp32 tensor of 4096 elements per record, each record ``excess`` bytes shorter than its chunk."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    offset = 0
    for k, (excess, transform) in enumerate(zip(excesses, transforms)):
        props = TensorProperties(torch.float32)
        state[f"t{k}"] = TensorStorageMetadata(
            props, torch.Size([4096]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([4096]))]
        )
        length = 4096 * 4 - excess
        storage[MetadataIndex(f"t{k}", [0])] = _StorageInfo("__0_0.distcp", offset, length, transform)
        offset += length
    return Metadata(state, storage_data=storage)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("excesses", "transforms"),
    [
        ([CAP], [None]),
        ([CAP + 1], [None]),
        ([CAP - 10, 10], [None, None]),
        ([CAP - 10, 11], [None, None]),
        ([CAP - 10, 11], [None, ["zstd"]]),  # a transformed record has its own bound: not counted
        ([CAP - 10, 11], [None, []]),  # empty descriptors: a plain record
        ([1] * (CAP + 1), [None] * (CAP + 1)),
        ([1] * CAP, [None] * CAP),
    ],
)
def test_broadcast_total_at_the_limit(excesses: list[int], transforms: list[list[str] | None]) -> None:
    md = _broadcast_case(excesses, transforms)
    cols = columns_from_metadata(md)
    assert cols is not None
    expected = not metadata_problems(md, "p")
    counted = sum(e for e, t in zip(excesses, transforms) if not t)
    assert expected == (counted <= CAP)
    assert columns_sound(cols, "p") == expected


@pytest.mark.parametrize(
    ("shape", "sound"),
    [
        ([MAX_BYTES] * 40 + [0], True),  # no elements: fits, though the other dims' product is past any float
        ([MAX_BYTES] * 40 + [1], False),
        ([2**61 - 1, 1], True),  # fp32: 2**63 - 4 bytes
        ([2**61, 1], False),  # fp32: 2**63 bytes
        ([1] * 1024, True),
        ([1] * 1025, False),  # more than MAX_NDIM dimensions
    ],
)
def test_byte_counts_at_the_limits(shape: list[int], sound: bool) -> None:
    props = TensorProperties(torch.float32)
    chunk = ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))
    state = {"w": TensorStorageMetadata(props, torch.Size(shape), [chunk])}
    storage = {MetadataIndex("w", [0] * len(shape)): _StorageInfo("__0_0.distcp", 0, 0)}
    md = Metadata(state, storage_data=storage)  # type: ignore[arg-type]
    cols = columns_from_metadata(md)
    assert cols is not None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DCP_STORAGE_MAX_BROADCAST_BYTES", str(MAX_BYTES))  # a record of 0 bytes for it all
        assert (metadata_problems(md, "p") == []) == sound
        assert columns_sound(cols, "p") == sound
