"""Slices of many close runs from an object store: one bounding-range read and a strided copy.

The transport would coalesce such runs into the same bytes anyway; planning them one by one cost seconds
of CPU per rank on a large ``Shard(1)`` reshard. The bounding-range path must deliver the same bits and
read no more than the runs' span; sparse or short slices keep one request per run.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from dcp_storage.formats.reading import StoredTensor, dense_gap_of, plan_slice_read, read_slices
from dcp_storage.transports import FsspecTransport
from dcp_storage_testing.compare import same_bits

ROWS, COLS, HEAD = 200, 64, 96  # HEAD: bytes before the tensor's elements in the file


@pytest.fixture
def stored() -> tuple[FsspecTransport, StoredTensor, torch.Tensor]:
    transport, root = FsspecTransport.from_url(f"memory://dense-{uuid.uuid4().hex}")
    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5))
    path = transport.join(root, "t.bin")
    transport.write_file(path, b"h" * HEAD + full.numpy().tobytes())
    return transport, StoredTensor.contiguous(path, HEAD, torch.float32, (ROWS, COLS), "memory t.bin"), full


def _load(
    transport: FsspecTransport,
    stored: StoredTensor,
    offsets: tuple[int, int],
    lengths: tuple[int, int],
    gap: int | None,
) -> tuple[torch.Tensor, int]:
    dest = torch.empty(lengths)
    work = plan_slice_read("k", stored, offsets, lengths, dest, dense_gap=gap)
    planned = len(work.requests)
    read_slices(transport, [work], lambda _w: None)
    return dest, planned


def test_dense_column_slice_is_one_bounding_read(stored: tuple[FsspecTransport, StoredTensor, torch.Tensor]) -> None:
    transport, tensor, full = stored
    assert dense_gap_of(transport) == transport.config.coalesce_gap  # memory:// is not a local disk
    before = transport.counters.snapshot()["bytes_read"]
    dest, planned = _load(transport, tensor, (0, 16), (ROWS, 32), transport.config.coalesce_gap)
    assert planned == 1 and same_bits(dest, full[:, 16:48].contiguous())
    read = transport.counters.snapshot()["bytes_read"] - before
    assert read == ((ROWS - 1) * COLS + 32) * 4  # first run's start to the last run's end, nothing more


def test_without_a_gap_every_run_is_a_request(stored: tuple[FsspecTransport, StoredTensor, torch.Tensor]) -> None:
    transport, tensor, full = stored
    dest, planned = _load(transport, tensor, (10, 8), (150, 40), None)
    assert planned == 150 and same_bits(dest, full[10:160, 8:48].contiguous())


@pytest.mark.parametrize(
    ("offsets", "lengths", "gap", "planned"),
    [
        ((0, 0), (ROWS, 4), 64, ROWS),  # gaps of 240 bytes against a 64-byte gap: sparse, one request per run
        ((0, 0), (40, 8), 1 << 20, 40),  # 40 runs: few enough to plan one by one
        ((5, 0), (100, COLS), 1 << 20, 1),  # whole rows are one run whatever the gap
    ],
)
def test_sparse_or_short_slices_keep_their_runs(
    stored: tuple[FsspecTransport, StoredTensor, torch.Tensor],
    offsets: tuple[int, int],
    lengths: tuple[int, int],
    gap: int,
    planned: int,
) -> None:
    transport, tensor, full = stored
    dest, got = _load(transport, tensor, offsets, lengths, gap)
    rows, cols = (slice(o, o + n) for o, n in zip(offsets, lengths))
    assert got == planned and same_bits(dest, full[rows, cols].contiguous())


def test_dense_slice_into_a_casting_destination(stored: tuple[FsspecTransport, StoredTensor, torch.Tensor]) -> None:
    """A float64 destination: the bounding range is staged in the stored dtype, then copied with the cast."""
    transport, tensor, full = stored
    dest = torch.empty(190, 20, dtype=torch.float64)
    work = plan_slice_read("k", tensor, (7, 30), (190, 20), dest, dense_gap=transport.config.coalesce_gap)
    assert len(work.requests) == 1 and work.staging is not None and work.staging.dtype == torch.float32
    read_slices(transport, [work], lambda _w: None)
    assert same_bits(dest, full[7:197, 30:50].double().contiguous())
