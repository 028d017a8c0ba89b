"""A large safetensors header scanned into columns (``scan_columns``) and served as views of them.

``scan_columns`` must give exactly what ``parse_header`` gives, or ``None`` (then ``parse_header`` decides and
names any problem): never accept what the general path refuses. Checked against the general path on canonical
headers of every dtype and shape, on every non-canonical form we could think of, and on thousands of random
mutations. End to end, ``DCP_STORAGE_LAZY_METADATA_ENTRIES=0`` serves every canonical header as columns: loads
and ``describe`` give what the general path gives, for a file, a directory and an HF index; torch's pieces of a
tensor and an index that disagrees with its files take the general path.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import SafetensorsReader, describe
from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.columns import columns_of
from dcp_storage.formats.safetensors.header import parse_header, scan_columns
from tests.formats.safetensors._build import every_dtype_tensors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _canonical(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[bytes, int]:
    """The header bytes and data size the safetensors library writes for ``tensors``."""
    raw = safetensors.torch.save(tensors, metadata=metadata)
    n = int.from_bytes(raw[:8], "little")
    return raw[8 : 8 + n], len(raw) - 8 - n


def _general(header: bytes, data_size: int, ends: bool = True) -> object:
    try:
        return parse_header(header, data_size, "f", ends_the_file=ends)
    except CorruptCheckpointError as exc:
        return exc


def _same_or_none(header: bytes, data_size: int, ends: bool = True) -> bool:
    """The contract: None, or exactly the general path's header (which then raised nothing)."""
    got = scan_columns(header, data_size, "f", ends_the_file=ends)
    if got is None:
        return False
    ref = _general(header, data_size, ends)
    assert not isinstance(ref, Exception), f"columns accepted what the general path refuses: {ref}"
    assert got.header() == ref
    assert got.data_start == ref.data_start and got.metadata == ref.metadata
    return True


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"a": "b", "c": '{"x":1}'}])
def test_canonical_headers_scan_to_the_general_path_s_header(metadata: dict[str, str] | None) -> None:
    tensors = every_dtype_tensors()
    tensors["nested.name/with-dots.0"] = torch.ones(2, 3, 4)
    tensors["unicodé ☃"] = torch.zeros(5, dtype=torch.int8)
    header, size = _canonical(tensors, metadata)
    assert _same_or_none(header, size)
    got = scan_columns(header, size, "f")
    assert got is not None and len(got.names) == len(tensors)


def test_the_bench_layout_scans(tmp_path: Path) -> None:
    """The form benchmarks/bench_many_safetensors.py writes (json.dumps, no spaces), padded with spaces."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for i in range(3000):
        header[f"model.layers.{i // 8}.block.{i % 8}.weight"] = {
            "dtype": "F32",
            "shape": [16],
            "data_offsets": [i * 64, (i + 1) * 64],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    assert _same_or_none(raw, 3000 * 64)
    assert scan_columns(raw, 3000 * 64 + 1, "f") is None  # a byte no tensor holds: the general path names it
    assert isinstance(_general(raw, 3000 * 64 + 1), CorruptCheckpointError)
    assert _same_or_none(raw, 3000 * 64 + 1, ends=False)  # a blob inside a larger file (DCP layout)


def _entry(name: str, dtype: str = "F32", shape: str = "2", begin: str = "0", end: str = "8") -> bytes:
    return b'"%s":{"dtype":"%s","shape":[%s],"data_offsets":[%s,%s]}' % (
        name.encode(),
        dtype.encode(),
        shape.encode(),
        begin.encode(),
        end.encode(),
    )


NON_CANONICAL = {
    "whitespace": b'{ "a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "space in an entry": b'{"a":{"dtype": "F32","shape":[2],"data_offsets":[0,8]}}',
    "escaped name": b'{"a\\u0062":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "escaped quote": b'{"a\\"":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "key order": b'{"a":{"shape":[2],"dtype":"F32","data_offsets":[0,8]}}',
    "leading zero": b"{" + _entry("a", begin="00", end="8") + b"}",
    "19 digits": b"{" + _entry("a", shape="2", begin="0", end="8000000000000000000") + b"}",
    "metadata last": b"{" + _entry("a") + b',"__metadata__":{"x":"y"}}',
    "metadata not strings": b'{"__metadata__":{"x":1},' + _entry("a") + b"}",
    "metadata twice": b'{"__metadata__":{"x":"y"},"__metadata__":{"x":"y"},' + _entry("a") + b"}",
    "metadata key twice": b'{"__metadata__":{"x":"y","x":"z"},' + _entry("a") + b"}",
    "a tensor named __metadata__": b"{" + _entry("__metadata__") + b"}",
    "duplicate name": b"{" + _entry("a") + b"," + _entry("a", begin="8", end="16") + b"}",
    "unknown dtype": b"{" + _entry("a", dtype="F31") + b"}",
    "wrong byte count": b"{" + _entry("a", end="7") + b"}",
    "gap": b"{" + _entry("a") + b"," + _entry("b", begin="9", end="17") + b"}",
    "overlap": b"{" + _entry("a") + b"," + _entry("b", begin="4", end="12") + b"}",
    "not from byte 0": b"{" + _entry("a", begin="4", end="12") + b"}",
    "garbage between": b"{" + _entry("a") + b",x," + _entry("b", begin="8", end="16") + b"}",
    "no comma": b"{" + _entry("a") + _entry("b", begin="8", end="16") + b"}",
    "brace for a comma": b"{" + _entry("a") + b"{" + _entry("b", begin="8", end="16") + b"}",
    "unclosed": b"{" + _entry("a"),
    "trailing garbage": b"{" + _entry("a") + b"}x",
    "two objects": b"{" + _entry("a") + b"}{}",
    "invalid utf-8 name": b'{"\xff\xfe":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "surrogate in utf-8": b'{"\xed\xa0\x80":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "control character": b'{"a\x01":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "too many dims": b"{" + _entry("a", shape=",".join(["1"] * 65), end="4") + b"}",
    "huge product": b"{" + _entry("a", shape="4294967296,4294967296,4294967296", end="8") + b"}",
    "end before begin": b"{" + _entry("a", shape="0", begin="8", end="0") + b"}",
    "runs past the data": b"{" + _entry("a", shape="4", end="16") + b"}",
    "empty object": b"{}",
    "array": b"[]",
}


@pytest.mark.parametrize("name", sorted(NON_CANONICAL))
def test_what_the_scan_does_not_take_the_general_path_decides(name: str) -> None:
    header = NON_CANONICAL[name]
    size = 8 if name not in ("gap", "no comma", "garbage between", "duplicate name", "brace for a comma") else 16
    size = 17 if name == "gap" else size
    assert scan_columns(header, size, "f") is None, name


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("shape", [[999999999999999999] * 20 + [0], [2] * 1023 + [0], [4294967296] * 3])
def test_shapes_whose_float_product_overflows_warn_nothing(shape: list[int]) -> None:
    """A product that overflows float64 (then inf * 0 = nan) is no warning, and the verdict is the general path's."""
    nbytes = 0 if 0 in shape else 8
    header = json.dumps({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, nbytes]}}, separators=(",", ":"))
    got = scan_columns(header.encode(), nbytes, "f")
    ref = _general(header.encode(), nbytes)
    assert got.header() == ref if got is not None else isinstance(ref, Exception)


def test_random_mutations_never_accept_what_the_general_path_refuses() -> None:
    tensors = {f"t{i}": torch.zeros(i % 4, 3, dtype=torch.float16 if i % 2 else torch.float32) for i in range(40)}
    tensors["s"] = torch.tensor(1.0)
    header, size = _canonical(tensors, {"k": "v"})
    rng = random.Random(1234)
    alphabet = b'{}[],:"0123456789AFUIB_\\ x\x00\xff'
    accepted = 0
    for _ in range(3000):
        data = bytearray(header)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data))
            kind = rng.randrange(3)
            if kind == 0:
                data[at] = rng.choice(alphabet)
            elif kind == 1:
                data.insert(at, rng.choice(alphabet))
            else:
                del data[at]
        for ds in (size, size - 2, size + 6):
            accepted += _same_or_none(bytes(data), ds)
    assert accepted > 20  # some mutations (a name's letter, a digit that keeps the sums) still scan


# ---------------------------------------------------------------------------------------- end to end
def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(4, 3 + i % 3, generator=g) for i in range(12)}
    out["emb"] = torch.randn(7, dtype=torch.float64, generator=g).to(torch.bfloat16)
    out["step"] = torch.tensor(5, dtype=torch.int64)
    out["empty"] = torch.zeros(0, 2)
    return out


def _load(url: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dest = {k: torch.full_like(v, 7) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(dest, storage_reader=SafetensorsReader(url), no_dist=True)
    return dest


def _layouts(root: Path) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    model = _model(1)
    single = root / "single"
    single.mkdir()
    safetensors.torch.save_file(model, str(single / "model.safetensors"), metadata={"format": "pt"})
    sharded = root / "sharded"
    sharded.mkdir()
    names = sorted(model)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in halves.items():
        safetensors.torch.save_file({k: model[k] for k in keys}, str(sharded / file))
        weight_map.update({k: file for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {
        "file": (str(single / "model.safetensors"), model),
        "directory": (str(single), model),
        "index": (str(sharded / "model.safetensors.index.json"), model),
    }


@pytest.mark.parametrize("layout", ["file", "directory", "index"])
def test_columns_load_and_describe_as_the_general_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    url, model = _layouts(tmp_path)[layout]
    general = describe(url)
    monkeypatch.setenv("DCP_STORAGE_LAZY_METADATA_ENTRIES", "0")
    md = SafetensorsReader(url).read_metadata()
    assert columns_of(md) is not None, "served as views of columns"
    assert dict(md.state_dict_metadata.items()) == dict(SafetensorsReader(url).read_metadata().state_dict_metadata)
    copy = pickle.loads(pickle.dumps(md))  # Broadcasting ships it to the other ranks
    assert dict(copy.storage_data.items()) == dict(md.storage_data.items())
    loaded = _load(url, model)
    assert all(torch.equal(loaded[k], model[k]) for k in model)
    info = describe(url)
    assert [
        (t.key, t.dtype, t.shape, t.nbytes, [(c.file, c.offset, c.length) for c in t.chunks]) for t in info.tensors
    ] == [
        (t.key, t.dtype, t.shape, t.nbytes, [(c.file, c.offset, c.length) for c in t.chunks]) for t in general.tensors
    ]
    assert info.files == general.files


def test_what_columns_cannot_serve_takes_the_general_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An index naming a tensor its file lacks is refused naming it; torch's pieces are assembled."""
    url, model = _layouts(tmp_path)["index"]
    index = Path(url)
    doc = json.loads(index.read_text())
    doc["weight_map"]["layers.0.w"] = "model-00002-of-00002.safetensors"  # it is in the first shard
    index.write_text(json.dumps(doc))
    monkeypatch.setenv("DCP_STORAGE_LAZY_METADATA_ENTRIES", "0")
    with pytest.raises(Exception, match=r"layers\.0\.w"):
        SafetensorsReader(url).read_metadata()
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    for n, (lo, hi) in enumerate(((0, 3), (3, 6))):
        info = json.dumps({"w": {"saved_offsets": [lo, 0]}})
        safetensors.torch.save_file(
            {"w": full[lo:hi].clone()},
            str(pieces / f"shard-0000{n}-model-00001-of-00001.safetensors"),
            metadata={"DCP_SHARDING_INFO": info},
        )
    md = SafetensorsReader(str(pieces)).read_metadata()
    assert columns_of(md) is None and list(md.state_dict_metadata["w"].size) == [6, 4]
    assert torch.equal(_load(str(pieces), {"w": full})["w"], full)
    assert os.environ["DCP_STORAGE_LAZY_METADATA_ENTRIES"] == "0"
