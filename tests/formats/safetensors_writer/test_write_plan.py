"""Unit tests of the pure parts: size strings, chunk -> byte runs, packing into files, header bytes and order."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from safetensors.torch import save as st_save

from dcp_storage.formats.safetensors.encode import HeaderEntry, data_order, encode_header, tensor_bytes
from dcp_storage.formats.safetensors.header import SAFETENSORS_TO_TORCH
from dcp_storage.formats.safetensors.write_plan import TensorSpec, chunk_runs, pack_files, parse_size
from dcp_storage_testing.compare import raw_bytes as raw


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (123, 123),
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("500mb", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5 MB", 1_500_000),
        ("64KiB", 65536),
        ("100", 100),
        ("7B", 7),
    ],
)
def test_parse_size(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["5 parsecs", "GB", "", "-1MB", 0, -5, "0MB"])
def test_parse_size_rejects(bad: int | str) -> None:
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size(bad)


@pytest.mark.parametrize("bad", [None, 1.5, True])
def test_parse_size_rejects_types(bad: object) -> None:
    with pytest.raises(TypeError, match="max_shard_size"):
        parse_size(bad)  # type: ignore[arg-type]


def _expected_bytes(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], itemsize: int
) -> list[int]:
    """Brute force: the byte offsets, in chunk order, that the box occupies in the row-major tensor."""
    ids = torch.arange(int(torch.Size(shape).numel()), dtype=torch.int64).reshape(shape) if shape else torch.tensor(0)
    box = ids[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else ids
    return [int(e) * itemsize + b for e in box.reshape(-1).tolist() for b in range(itemsize)]


def _run_bytes(shape, offsets, sizes, itemsize) -> list[int]:  # type: ignore[no-untyped-def]
    runs = chunk_runs(shape, offsets, sizes, itemsize)
    out = [off + b for off in runs.offsets() for b in range(runs.length)]
    assert len(out) == runs.nbytes
    return out


@pytest.mark.parametrize(
    ("shape", "offsets", "sizes", "count"),
    [
        ((), (), (), 1),  # 0-dim
        ((8, 6), (0, 0), (8, 6), 1),  # whole tensor
        ((8, 6), (4, 0), (4, 6), 1),  # Shard(0): one run
        ((8, 6), (0, 3), (8, 3), 8),  # Shard(1): one run per row
        ((8, 6), (2, 3), (1, 3), 1),  # a single partial row
        ((4, 5, 6), (1, 2, 0), (2, 3, 6), 2),  # rows of the middle dim, full last dim
        ((4, 5, 6), (0, 0, 1), (4, 5, 2), 20),
        ((3, 1), (0, 1), (3, 0), 0),  # empty chunk (uneven Shard(1) with nothing left)
        ((0, 5), (0, 0), (0, 5), 0),  # zero-size tensor
    ],
)
def test_chunk_runs_cases(shape, offsets, sizes, count) -> None:  # type: ignore[no-untyped-def]
    runs = chunk_runs(shape, offsets, sizes, 2)
    assert runs.count == count
    assert _run_bytes(shape, offsets, sizes, 2) == _expected_bytes(shape, offsets, sizes, 2)


def test_chunk_runs_random_boxes() -> None:
    rng = random.Random(7)
    for _ in range(300):
        ndim = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 5) for _ in range(ndim))
        offsets = tuple(rng.randint(0, s - 1) for s in shape)
        sizes = tuple(rng.randint(1, s - o) for s, o in zip(shape, offsets))
        itemsize = rng.choice([1, 2, 4, 8])
        assert _run_bytes(shape, offsets, sizes, itemsize) == _expected_bytes(shape, offsets, sizes, itemsize), (
            shape,
            offsets,
            sizes,
        )


def test_chunk_runs_rejects_out_of_bounds() -> None:
    with pytest.raises(ValueError, match="exceed shape"):
        chunk_runs((4, 4), (2, 0), (3, 4), 4)


def _spec(name: str, nbytes: int) -> TensorSpec:
    return TensorSpec(name, "U8", (nbytes,), 1)


def test_pack_files_greedy_in_order() -> None:
    groups = pack_files([_spec("a", 40), _spec("b", 50), _spec("c", 20), _spec("d", 100), _spec("e", 0)], 100)
    assert [[s.fqn for s in g] for g in groups] == [["a", "b"], ["c"], ["d", "e"]]


def test_pack_files_oversized_tensor_alone() -> None:
    groups = pack_files([_spec("a", 10), _spec("big", 500), _spec("c", 10)], 100)
    assert [[s.fqn for s in g] for g in groups] == [["a"], ["big"], ["c"]]
    assert [[s.fqn for s in g] for g in pack_files([], 100)] == [[]]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (*shape, itemsize), generator=g, dtype=torch.uint8)
    return bits.view(dtype).reshape(shape)


def test_header_and_order_match_safetensors_byte_for_byte() -> None:
    """Every dtype of the table, odd names (unicode, quotes), 0-dim and empty tensors, and metadata."""
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, dtype) in enumerate(sorted(SAFETENSORS_TO_TORCH.items())):
        for suffix, shape in (("", (3, 5)), ("_scalar", ()), ("_empty", (0, 2))):
            tensors[f"{name.lower()}{suffix}"] = _random_tensor(dtype, shape, i)
    tensors['weird "name" \\ ü.λ'] = _random_tensor(torch.float32, (2,), 99)
    tensors["\x01control"] = _random_tensor(torch.int16, (3,), 98)
    metadata = {"format": 'p"t\\'}  # one key: safetensors writes several in hash order
    try:
        expected = st_save(tensors, metadata=metadata)
    except Exception as exc:  # noqa: BLE001  # pragma: no cover - a safetensors build without some dtype
        pytest.skip(f"installed safetensors cannot write every dtype: {exc}")

    ordered = data_order([(k, _st_name(v.dtype)) for k, v in tensors.items()])
    entries, pos = [], 0
    for name, st_dtype in ordered:
        n = tensors[name].numel() * tensors[name].element_size()
        entries.append(HeaderEntry(name, st_dtype, tuple(tensors[name].shape), pos, pos + n))
        pos += n
    ours = encode_header(entries, metadata) + b"".join(bytes(tensor_bytes(tensors[n]).numpy()) for n, _ in ordered)
    assert ours == expected


def _st_name(dtype: torch.dtype) -> str:
    from dcp_storage.formats.safetensors.header import safetensors_dtype

    name = safetensors_dtype(dtype)
    assert name is not None
    return name


def test_header_with_several_metadata_keys_loads() -> None:
    from safetensors.torch import load

    t = _random_tensor(torch.bfloat16, (4, 3), 5)
    header = encode_header([HeaderEntry("w", "BF16", (4, 3), 0, 24)], {"format": "pt", "a": "1", "b": "x y"})
    assert len(header) % 8 == 0
    assert torch.equal(raw(load(header + bytes(tensor_bytes(t).numpy()))["w"]), raw(t))


def test_encode_header_refuses_gaps() -> None:
    with pytest.raises(ValueError, match="gap"):
        encode_header([HeaderEntry("a", "U8", (4,), 0, 4), HeaderEntry("b", "U8", (4,), 5, 9)])


def test_tensor_bytes_of_views() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for view in (base.t(), base[1:3, 2:5], base[2], torch.tensor(1.5)):
        assert torch.equal(tensor_bytes(view), raw(view))
    assert list(itertools.islice(iter(tensor_bytes(torch.empty(0, 3)).tolist()), 1)) == []
