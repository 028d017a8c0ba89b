"""The native ``.metadata`` decoder: same columns as the Python reference, or ``None`` (never wrong, never a crash).

``decode_columns`` must equal ``columns_from_metadata(pickle.loads(data))`` whenever it returns columns, and
return ``None`` for anything outside the canonical subset torch writes (the general path then names the
problem). Hostile inputs: non-canonical shapes, foreign globals, every truncation, thousands of mutations.
"""

from __future__ import annotations

import collections
import os
import pathlib
import pickle
import random
import time
import warnings

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

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.columns import columns_from_metadata, property_key
from dcp_storage.formats.dcp_native import native as native_decode
from dcp_storage.formats.dcp_native.native import metadata_allow_list
from dcp_storage.safe_unpickle import safe_loads

needs_native = pytest.mark.skipif(not native_decode.available(), reason="C extension not built (no compiler)")

ARRAYS = (
    "is_bytes",
    "prop",
    "shape_at",
    "dims",
    "chunk_at",
    "chunk_offsets",
    "chunk_sizes",
    "box_at",
    "file",
    "byte_offset",
    "byte_length",
    "transform",
)


def test_native_module_built_in_ci():
    """CI builds the extension: a missing one there is a build regression, not a reason to skip."""
    if native_decode.available():
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("dcp_storage.formats.dcp_native._metadata_decode is not built")
    pytest.skip("C extension not built (no compiler)")


def assert_same(a, b):
    assert a is not None and b is not None
    assert a.names == b.names
    for f in ARRAYS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert [property_key(p) for p in a.properties] == [property_key(p) for p in b.properties]
    assert a.files == b.files and a.transforms == b.transforms
    assert a.planner_data == b.planner_data and type(a.planner_data) is type(b.planner_data)
    assert a.storage_meta == b.storage_meta and a.version == b.version


def check_equal(data: bytes):
    got = native_decode.decode_columns(data)
    assert got is not None, "the native decoder refused a regular .metadata"
    assert_same(got, columns_from_metadata(pickle.loads(data)))
    return got


def bench_metadata(n: int, files: int = 3) -> Metadata:
    """Like benchmarks/bench_many_tensors.py::build: shared Size and properties objects."""
    size, props, offset0 = torch.Size([16]), TensorProperties(dtype=torch.float32), torch.Size([0])
    state, storage = {}, {}
    for i in range(n):
        fqn = f"layers.{i // 8}.p{i % 8}.weight"
        state[fqn] = TensorStorageMetadata(props, size, [ChunkStorageMetadata(offset0, size)])
        storage[MetadataIndex(fqn, offset0)] = _StorageInfo(f"__{i % files}_0.distcp", 1024 * (i // files), 1024)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def rich_metadata() -> Metadata:
    """Several chunks per tensor, values, transforms, distinct properties, planner data, storage meta."""
    state, storage = {}, {}
    p1 = TensorProperties(dtype=torch.bfloat16, requires_grad=True, memory_format=torch.channels_last)
    p2 = TensorProperties(dtype=torch.int64, pin_memory=True, memory_format=torch.preserve_format)
    chunks = [ChunkStorageMetadata(torch.Size([r, c]), torch.Size([2, 3])) for r, c in ((0, 0), (0, 3), (2, 0), (2, 3))]
    state["w"] = TensorStorageMetadata(p1, torch.Size([4, 6]), chunks)
    for n, ch in enumerate(chunks):
        storage[MetadataIndex("w", ch.offsets, n)] = _StorageInfo(f"__{n % 2}_0.distcp", 100 * n, 99, ["zstd"])
    state["step"] = BytesStorageMetadata()
    storage[MetadataIndex("step")] = _StorageInfo("__1_0.distcp", 5000, 7)
    state["scalar"] = TensorStorageMetadata(p2, torch.Size([]), [ChunkStorageMetadata(torch.Size([]), torch.Size([]))])
    storage[MetadataIndex("scalar", torch.Size([]), 0)] = _StorageInfo("__0_0.distcp", 6000, 8, ["a", "b"])
    state["empty"] = TensorStorageMetadata(p2, torch.Size([0]), [])
    planner = {"w": ("model", "w"), "step": ["step", 0], "scalar": ("scalar",), "empty": ("e",)}
    meta = StorageMeta(checkpoint_id=pathlib.PurePosixPath("/ckpt/x"), save_id="s", load_id=None, modules=["m"])
    return Metadata(state, planner_data=planner, storage_data=storage, storage_meta=meta, version="1.0.0")


SMALL = pickle.dumps(bench_metadata(3))


# ---- equality with the reference ---------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_bench_layout_every_protocol(protocol):
    """1500 entries: SETITEMS batches, LONG_BINGET memo indices, frames over 64 KiB; GLOBAL in 2/3."""
    data = pickle.dumps(bench_metadata(1500), protocol=protocol)
    assert len(data) > 64 * 1024
    cols = check_equal(data)
    assert len(cols) == 1500 and cols.files == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]


@needs_native
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_multi_chunk_values_transforms_paths(protocol):
    cols = check_equal(pickle.dumps(rich_metadata(), protocol=protocol))
    assert cols.transforms == [("zstd",), ("a", "b")]
    assert cols.chunk_count == 6 and cols.storage_meta.checkpoint_id == pathlib.PurePosixPath("/ckpt/x")


@needs_native
def test_buffers_and_windows_path():
    md = rich_metadata()
    md.storage_meta = StorageMeta(checkpoint_id=pathlib.PureWindowsPath("C:/ckpt"), modules=[])
    data = pickle.dumps(md)
    check_equal(data)
    assert_same(native_decode.decode_columns(bytearray(data)), native_decode.decode_columns(memoryview(data)))


@needs_native
def test_shared_objects():
    """One TensorStorageMetadata and one ChunkStorageMetadata under two keys (GET of built objects)."""
    md = bench_metadata(2)
    shared = md.state_dict_metadata["layers.0.p0.weight"]
    md.state_dict_metadata["layers.0.p1.weight"] = shared
    check_equal(pickle.dumps(md))


@needs_native
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_real_save(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = {
        "model": {"a.weight": torch.zeros(2, 3), "a.bias": torch.zeros(3, dtype=torch.float16)},
        "step": 3,
        "opt": {"lr": 0.1, "names": ["x", "y"]},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=tmp_path)
    cols = check_equal((tmp_path / ".metadata").read_bytes())
    assert cols.planner_data["model.a.weight"] == ("model", "a.weight")
    assert isinstance(cols.storage_meta.checkpoint_id, pathlib.PurePath) and cols.version


# ---- None for everything else ----------------------------------------------------------------------


def _variant(mutate) -> bytes:
    md = rich_metadata()
    mutate(md)
    return pickle.dumps(md)


def _share_chunk_list(md):
    md.state_dict_metadata["empty"].chunks = md.state_dict_metadata["w"].chunks  # GET of a list


def _cycle(md):
    md.storage_meta.save_id = md.storage_meta  # GET of an object before its BUILD


def _drop_storage(md):
    md.storage_data.pop(MetadataIndex("step"))


def _extra_storage(md):
    md.storage_data[MetadataIndex("ghost")] = _StorageInfo("__0_0.distcp", 0, 1)


NOT_CANONICAL = {
    "OrderedDict state dict": lambda md: setattr(
        md, "state_dict_metadata", collections.OrderedDict(md.state_dict_metadata)
    ),
    "planner_data is the state dict (GET of a dict)": lambda md: setattr(md, "planner_data", md.state_dict_metadata),
    "shared chunk list (GET of a list)": _share_chunk_list,
    "self-reference (GET before BUILD)": _cycle,
    "chunk without storage entry": _drop_storage,
    "storage entry without chunk": _extra_storage,
    "negative byte offset": lambda md: setattr(md.storage_data[MetadataIndex("step")], "offset", -1),
    "length over 2**63-1": lambda md: setattr(md.storage_data[MetadataIndex("step")], "length", 2**63),
    "float in planner_data": lambda md: md.planner_data.__setitem__("w", ("w", 1.5)),
    "foreign object in planner_data": lambda md: md.planner_data.__setitem__("w", (pathlib.PurePosixPath("x"),)),
    "list offsets instead of Size": lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", [0, 0]),
    "version an int": lambda md: setattr(md, "version", 1),
    "extra Metadata attribute": lambda md: setattr(md, "extra", 1),
    "storage_data missing": lambda md: delattr(md, "storage_data"),
    "transform_descriptors a tuple": lambda md: setattr(
        md.storage_data[MetadataIndex("scalar", torch.Size([]))], "transform_descriptors", ("a",)
    ),
}


@needs_native
@pytest.mark.parametrize("name", sorted(NOT_CANONICAL))
def test_not_canonical_is_none(name):
    assert native_decode.decode_columns(_variant(NOT_CANONICAL[name])) is None


def test_tuple_transform_descriptors_have_no_columns():
    """Columns keep descriptors as tuples and serve them as torch writes them, lists: a file holding a tuple
    would be served a list (an unequal ``_StorageInfo``), so the python builder refuses it too."""
    md = pickle.loads(_variant(NOT_CANONICAL["transform_descriptors a tuple"]))
    assert columns_from_metadata(md) is None


@needs_native
def test_byte_level_variants_are_none():
    head, body = SMALL[:2], SMALL[2:]
    stop = len(SMALL) - 1
    variants = {
        "trailing bytes": SMALL + b"N",
        "left on the stack": head + b"N" + body,
        "BUILD twice": SMALL[:stop] + b"}b.",
        "protocol 1": pickle.dumps(bench_metadata(2), protocol=1),
        "protocol 0": pickle.dumps(bench_metadata(2), protocol=0),
        "POP opcode": SMALL[:stop] + b"N0.",
        "empty": b"",
        "STOP only": b"\x80\x04.",
        "unbounded MARKs": b"\x80\x04" + b"(" * 100_000 + b".",
        "huge string length": b"\x80\x04\x8d" + (2**63).to_bytes(8, "little") + b".",
        "os.system": b"\x80\x04cos\nsystem\n(X\x04\x00\x00\x00truetR.",
        "os.system via STACK_GLOBAL": b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c\x04true\x85R.",
    }
    # duplicate keys: a second tensor renamed to the first one's name (same length), in both dicts
    dup = pickle.dumps(bench_metadata(2)).replace(b"layers.0.p1.weight", b"layers.0.p0.weight")
    variants["duplicate keys"] = dup
    for name, data in variants.items():
        assert native_decode.decode_columns(data) is None, name


@needs_native
def test_every_truncation_is_none():
    for n in range(len(SMALL)):
        assert native_decode.decode_columns(SMALL[:n]) is None, n


def _general(data: bytes):
    """What the general path makes of data (None when it refuses)."""
    try:
        md = safe_loads(data, "<fuzz>", metadata_allow_list(), expected=Metadata)
    except DcpStorageError:
        return None
    try:
        return columns_from_metadata(md)
    except Exception:  # a shape the reference cannot even walk
        return None


@needs_native
@pytest.mark.parametrize("seed_data", [SMALL, pickle.dumps(rich_metadata(), protocol=2)], ids=["bench", "rich-p2"])
def test_mutations_never_disagree(seed_data):
    """Random flips, deletions and insertions: None, or exactly what the general path decodes."""
    rng = random.Random(1234)
    accepted = 0
    for _ in range(2500):
        data = bytearray(seed_data)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(data))
            op = rng.random()
            if op < 0.6:
                data[pos] = rng.randrange(256)
            elif op < 0.8:
                del data[pos]
            else:
                data.insert(pos, rng.randrange(256))
        got = native_decode.decode_columns(bytes(data))
        if got is None:
            continue
        accepted += 1
        ref = _general(bytes(data))
        assert ref is not None, f"native accepted what the general path refuses: {bytes(data)!r}"
        assert_same(got, ref)
    assert accepted > 0  # some mutations (values in strings and ints) stay regular


# ---- memory bounded by the input ----------------------------------------------------------------------


def _peak_kib_of(fn) -> int:
    """Peak resident memory (KiB) ``fn()`` adds to this process (Linux: VmHWM reset through clear_refs)."""

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def _shared_entry(chunks: int, keys: int, ndim: int = 1) -> Metadata:
    """One tensor entry (``chunks`` chunks of ``ndim`` dims) under ``keys`` names, each chunk with a storage
    entry sharing one ``_StorageInfo`` of length 0: pickle writes the entry, its sizes and the info once."""
    shape = torch.Size([chunks] + [1] * (ndim - 1))
    ones = torch.Size([1] * ndim)
    offsets = [torch.Size([i] + [0] * (ndim - 1)) for i in range(chunks)]
    entry = TensorStorageMetadata(
        TensorProperties(torch.float32), shape, [ChunkStorageMetadata(o, ones) for o in offsets]
    )
    info = _StorageInfo("__0_0.distcp", 0, 0)
    state = {f"k{j}": entry for j in range(keys)}
    storage = {}
    for j in range(keys):
        for o in offsets:
            index = MetadataIndex(f"k{j}")
            object.__setattr__(index, "offset", o)  # the same Size object (__init__ would copy it)
            storage[index] = info
    return Metadata(state, storage_data=storage)


def _entry_under_many_keys() -> bytes:
    entry = _shared_entry(1000, 1).state_dict_metadata["k0"]
    return pickle.dumps(Metadata(dict.fromkeys((f"k{j}" for j in range(5000)), entry), {}))


SHARED = {
    "1000 chunks under 5000 keys": _entry_under_many_keys,
    "1024 dims under 15000 keys": lambda: pickle.dumps(_shared_entry(1, 15_000, ndim=1024)),
}


@needs_native
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak memory is read from Linux's /proc")
@pytest.mark.parametrize("name", sorted(SHARED))
def test_memory_stays_a_small_multiple_of_the_input(name):
    """Memo references repeat an entry (or a shape) at a few bytes each; the columns must not grow by the
    entry's size per reference. The decoder refuses (the general path then keeps the shared objects)."""
    data = SHARED[name]()
    assert len(data) < 1_000_000
    got = []
    peak = _peak_kib_of(lambda: got.append(native_decode.decode_columns(data)))
    assert got == [None]
    assert peak * 1024 < 32 * len(data) + (16 << 20), peak


# ---- time linear in the input -------------------------------------------------------------------------


def _colliding_names(count: int) -> list[str]:
    """``count`` distinct 24-byte ASCII names of one hash in the decoder's tables (its ``hash_bytes`` is not
    keyed and each step is invertible: two random words, then the third that lands on a fixed state)."""
    mask, prime = (1 << 64) - 1, 0x100000001B3
    target = 0x0123456789ABCDEF
    x = target
    for _ in range(3):  # undo h ^= h >> 29
        x = target ^ (x >> 29)
    before = (x * pow(prime, -1, 1 << 64)) & mask  # the state xor the third word must give
    rng = np.random.default_rng(7)
    h0, p, s = np.uint64(0xCBF29CE484222325 ^ 24), np.uint64(prime), np.uint64(29)
    out: list[str] = []
    while len(out) < count:
        words = rng.integers(0x20, 0x7F, size=(1 << 19, 16), dtype=np.uint8)
        w1, w2 = words[:, :8].copy().view("<u8").ravel(), words[:, 8:].copy().view("<u8").ravel()
        with np.errstate(over="ignore"):
            h = (h0 ^ w1) * p
            h ^= h >> s
            h = (h ^ w2) * p
            h ^= h >> s
        w3 = h ^ np.uint64(before)
        ascii_ = (w3 & np.uint64(0x8080808080808080)) == 0
        third = w3[ascii_].view(np.uint8).reshape(-1, 8)
        for a, b in zip(words[ascii_], third):
            out.append((a.tobytes() + b.tobytes()).decode())
    return out[:count]


@needs_native
def test_colliding_names_cost_no_more_than_others():
    """30,000 names of one hash (870 KB): a table probing all earlier names on each insertion took seconds
    (quadratic: hours for a large file). Refused after a bounded probe run; Python's keyed dicts then decide."""
    names = _colliding_names(30_000)
    assert len(set(names)) == len(names)
    data = pickle.dumps(Metadata(dict.fromkeys(names, BytesStorageMetadata()), storage_data={}))
    start = time.monotonic()
    assert native_decode.decode_columns(data) is None
    assert time.monotonic() - start < 0.5
