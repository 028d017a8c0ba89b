"""Slices checked by their covering blocks: bit-exact for every slice shape, every flipped byte of the covering
range refused, and how many bytes the covering blocks add to a ``Shard(0)`` split (none when the split falls
on a block boundary, which aligning blocks to the elements makes the common case)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.dcp_native.torch_record import parse_tensor_record
from dcp_storage.formats.dcp_native.writer import FsspecWriter
from dcp_storage.formats.reading import StoredTensor, plan_slice_read, read_slices
from dcp_storage.integrity.blocks import BlockCover
from dcp_storage.integrity.checksums import digest_width
from dcp_storage.transports import open_transport

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, dict]:
    root = tmp_path_factory.mktemp("blocks")
    w = torch.randn(1024, 1000, generator=torch.Generator().manual_seed(3))  # 3.9 MiB: 5 blocks
    dcp.save({"w": w}, storage_writer=FsspecWriter(str(root)), no_dist=True)
    sums = json.loads((root / ".dcp_storage.json").read_bytes())["checksums"]
    ((name, entry),) = sums["files"].items()
    (item,) = entry["items"]
    (offset, digests, first, size) = entry["blocks"][0]
    algorithm = sums["algorithm"]
    return (
        root / name,
        w,
        {
            "offset": offset,
            "length": item[1],
            "digests": digests,
            "first": first,
            "size": size,
            "algorithm": algorithm,
            "width": digest_width(algorithm),
        },
    )


def _read(path: Path, w: torch.Tensor, rec: dict, offsets: list[int], lengths: list[int], dest: torch.Tensor) -> int:
    transport, fpath = open_transport(str(path))
    with transport:
        head = bytes(transport.read_range(fpath, rec["offset"], rec["offset"] + 4096))
        parsed = parse_tensor_record(head, rec["length"], str(path))
        width = rec["width"]
        digests = tuple(rec["digests"][i : i + width] for i in range(0, len(rec["digests"]), width))
        cover = BlockCover(
            rec["offset"], rec["length"], rec["size"], digests, rec["algorithm"], str(path), rec["first"]
        )
        stored = StoredTensor(
            fpath, rec["offset"] + parsed.data_start, parsed.dtype, parsed.shape, parsed.stride, 0, str(path)
        )
        work = plan_slice_read("k", stored, offsets, lengths, dest, cover=cover)
        asked = sum(r.length for r in work.requests)
        read_slices(transport, [work], lambda _w: None)
        return asked


def test_the_first_block_is_the_header(saved: tuple[Path, torch.Tensor, dict]) -> None:
    _path, _w, rec = saved
    assert 0 < rec["first"] < 4096 and rec["size"] == 64 * 1024  # 4 MB of elements: 1/64 of them, a power of 2
    assert len(rec["digests"]) == rec["width"] * (1 + -(-(rec["length"] - rec["first"]) // rec["size"]))


def test_every_slice_shape_is_bit_exact(saved: tuple[Path, torch.Tensor, dict]) -> None:
    path, w, rec = saved
    rng = random.Random(5)
    for _ in range(12):
        r0, c0 = rng.randrange(1024), rng.randrange(1000)
        r1, c1 = rng.randrange(r0, 1024) + 1, rng.randrange(c0, 1000) + 1
        for dest in (torch.empty(r1 - r0, c1 - c0), torch.empty(r1 - r0, c1 - c0, dtype=torch.float64)):
            _read(path, w, rec, [r0, c0], [r1 - r0, c1 - c0], dest)
            assert torch.equal(dest, w[r0:r1, c0:c1].to(dest.dtype))
        dest = torch.empty(r1 - r0, 1000)  # one run, straight into the destination
        _read(path, w, rec, [r0, 0], [r1 - r0, 1000], dest)
        assert torch.equal(dest, w[r0:r1])


def test_a_shard0_split_on_a_block_boundary_reads_nothing_more(saved: tuple[Path, torch.Tensor, dict]) -> None:
    path, w, rec = saved
    half = 512 * 1000 * 4  # not a whole number of MiB: the two halves share one block
    for r0, r1 in ((0, 512), (512, 1024)):
        read = _read(path, w, rec, [r0, 0], [r1 - r0, 1000], torch.empty(r1 - r0, 1000))
        assert read - half <= rec["size"]
    w2 = torch.randn(1024, 1024)  # halves of exactly 2 MiB: only the last block reads the record's zip tail
    root = path.parent / "aligned"
    dcp.save({"w": w2}, storage_writer=FsspecWriter(str(root)), no_dist=True)
    entry = next(iter(json.loads((root / ".dcp_storage.json").read_bytes())["checksums"]["files"].values()))
    _offset, digests, first, size = entry["blocks"][0]
    rec2 = {**rec, "offset": 0, "length": entry["items"][0][1], "digests": digests, "first": first, "size": size}
    name = next(root.glob("*.distcp"))
    assert _read(name, w2, rec2, [0, 0], [512, 1024], torch.empty(512, 1024)) == 512 * 1024 * 4
    assert _read(name, w2, rec2, [512, 0], [512, 1024], torch.empty(512, 1024)) - 512 * 1024 * 4 < 4096


def test_a_flip_anywhere_in_the_covering_blocks_is_refused(
    saved: tuple[Path, torch.Tensor, dict], tmp_path: Path
) -> None:
    path, w, rec = saved
    rng = random.Random(9)
    good = path.read_bytes()
    for _ in range(8):
        r0 = rng.randrange(1000)
        cover = BlockCover(rec["offset"], rec["length"], rec["size"], (), "", "", rec["first"])
        lo = rec["offset"] + rec["first"] + 64 * 0 + r0 * 4000  # roughly the slice's first byte
        start, end = cover.covering(lo, lo + 4000 * 10)
        bad = bytearray(good)
        bad[rng.randrange(start, end)] ^= 0x01
        path.write_bytes(bad)
        try:
            with pytest.raises(CorruptCheckpointError, match=r"block \d+ of the record"):
                _read(path, w, rec, [r0, 0], [10, 1000], torch.empty(10, 1000))
        finally:
            path.write_bytes(good)
