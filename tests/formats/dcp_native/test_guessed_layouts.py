"""Record layouts guessed from the metadata: one round of requests instead of two on object stores.

A DCP load reads each record's header (where its tensor's bytes start) before its data. A record whose length
is exactly what this torch's ``torch.save`` writes for its chunk's shape and dtype has its header fetched with
its data instead (``DcpLoaderConfig.guess_layouts``, on by default for object stores); the item is delivered
only if that header says exactly what was guessed, and read again the usual way otherwise. Checked here: the
guess against real records, that a load takes one round, that wrong guesses (a transposed tensor, a lying
``.metadata``, a damaged header) still load right or fail with the usual error, and that no byte another
rank reads is fetched to merge requests.
"""

from __future__ import annotations

import io
import math
import threading
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

import dcp_storage.formats.dcp_native.reader as reader_module
from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.formats.dcp_native.item_loader import DcpItemLoader, DcpLoaderConfig
from dcp_storage.formats.dcp_native.torch_record import parse_tensor_record, predicted_record
from dcp_storage.transports import ClientSetUp
from dcp_storage.transports.ranges import RangeRequest, plan_fetches
from dcp_storage_testing.s3_server import S3Location

GUESS, PROBE = DcpLoaderConfig(guess_layouts=True), DcpLoaderConfig(guess_layouts=False)


def _record(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.complex64]
SHAPES = [(1,), (7,), (300,), (70_000,), (64, 33), (3, 5, 7), (2, 3, 4, 5), (1, 2, 3, 4, 5, 6)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_guess_is_the_record_s_layout_or_none(dtype: torch.dtype) -> None:
    guessed = 0
    for shape in SHAPES:
        tensor = torch.ones(shape, dtype=dtype)
        raw = _record(tensor)
        real = parse_tensor_record(raw, len(raw), "t")
        guess = predicted_record(dtype, shape, len(raw))
        assert guess is None or guess == real, (shape, guess, real)
        guessed += guess is not None
        for wrong in (len(raw) - 1, len(raw) + 1, len(raw) + 64):  # another layout: never a guess
            assert predicted_record(dtype, shape, wrong) is None
    assert guessed >= len(SHAPES) - 1  # a longer pickle may cross the data's 64-byte alignment once


def test_no_guess_for_zip64_sized_or_empty_records() -> None:
    assert predicted_record(torch.float32, (0, 4), 1000) is None
    huge = (1 << 30, 4)  # 16 GiB: the zip's 64-bit fields change the bytes around the data
    assert predicted_record(torch.float32, huge, math.prod(huge) * 4 + 2000) is None


def test_a_header_is_merged_across_record_overheads_only() -> None:
    data = RangeRequest("f", 10_000, 20_000)
    near = RangeRequest("f", 20_500, 21_000, max_gap=4096)  # the next record's header, 500 bytes on
    far = RangeRequest("f", 100_000, 101_000, max_gap=4096)  # 79 KB on: another rank's bytes between
    groups = plan_fetches([data, near, far], coalesce_gap=256 * 1024, max_request_bytes=1 << 30)
    assert [(g.start, g.end) for g in groups] == [(10_000, 21_000), (100_000, 101_000)]
    plain = plan_fetches([data, RangeRequest("f", 100_000, 101_000)], 256 * 1024, 1 << 30)
    assert [(g.start, g.end) for g in plain] == [(10_000, 101_000)]  # without max_gap: the transport's gap


def _state(*without: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {
        "w": torch.randn(300, 257),  # sliced records (over 256 KiB)
        "emb": torch.randn(700, 128).to(torch.bfloat16),
        "f8": torch.randn(70_000).to(torch.float8_e4m3fn),  # its pickle crosses the 64-byte alignment: no guess
        "t": torch.randn(513, 129).t(),  # saved transposed by torch's writer: guessed row-major, read again
        "norm": torch.randn(257),  # small: fetched whole
        "step": torch.tensor(7),
    }
    return {k: v for k, v in state.items() if k not in without}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _save(root: Path, state: dict[str, torch.Tensor], writer: str = "torch") -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = dcp.FileSystemWriter(str(root)) if writer == "torch" else FsspecWriter(str(root))
        dcp.save(state, storage_writer=made, no_dist=True)


def _counting_rounds(reader: FsspecReader) -> list[int]:
    """A one-element list counting the reader's rounds of requests (its transport's ``read_ranges`` calls)."""
    rounds = [0]
    real = reader.transport.read_ranges

    def counting(requests: Any) -> Any:
        rounds[0] += 1
        return real(requests)

    reader.transport.read_ranges = counting  # type: ignore[method-assign]
    return rounds


def _load(
    url: str, config: DcpLoaderConfig | None, state: dict[str, torch.Tensor], options: dict[str, Any] | None = None
) -> tuple[FsspecReader, int]:
    """Load ``url`` into zeros shaped like ``state`` and compare; the reader and how many rounds it took."""
    dest = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    reader = FsspecReader(url, dict(options or {}), loader_config=config)
    rounds = _counting_rounds(reader)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(dest, storage_reader=reader, no_dist=True)
    for key, value in state.items():
        assert torch.equal(_bits(dest[key]), _bits(value)), key
    return reader, rounds[0]


@pytest.mark.parametrize("writer", ["torch", "dcp_storage"])
def test_guessed_loads_equal_probed_ones(tmp_path: Path, writer: str) -> None:
    _save(tmp_path / "ckpt", _state(), writer)
    for config in (GUESS, PROBE):
        _load(str(tmp_path / "ckpt"), config, _state())


def test_one_round_when_every_layout_is_guessed(tmp_path: Path) -> None:
    state = _state("f8", "t")
    _save(tmp_path / "ckpt", state)
    guessed, guessed_rounds = _load(str(tmp_path / "ckpt"), GUESS, state)
    probed, probed_rounds = _load(str(tmp_path / "ckpt"), PROBE, state)
    assert (guessed_rounds, probed_rounds) == (1, 2)
    assert guessed.transport.counters.requests < probed.transport.counters.requests


@pytest.mark.parametrize("writer", ["torch", "dcp_storage"])
def test_a_wrong_guess_of_a_whole_tensor_is_laid_out_again_in_memory(tmp_path: Path, writer: str) -> None:
    """Transposed and channels_last tensors are saved as they are, with the length of a row-major record: their
    layout is guessed wrong, and their bytes (the whole storage) are laid out again, not fetched again."""
    state = _state("f8")
    state["conv"] = torch.randn(64, 32, 3, 3).to(memory_format=torch.channels_last)
    _save(tmp_path / "ckpt", state, writer)
    guessed, rounds = _load(str(tmp_path / "ckpt"), GUESS, state)
    probed, _rounds = _load(str(tmp_path / "ckpt"), PROBE, state)
    assert rounds == 1
    assert guessed.transport.counters.bytes_read <= probed.transport.counters.bytes_read


class _Planner(LoadPlanner):
    """Delivers hand-made read items into given tensors (a rank's slices, without a process group)."""

    def __init__(self, dests: dict[int, torch.Tensor]) -> None:
        self.dests, self.committed = dests, 0

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None: ...

    def create_local_plan(self) -> Any: ...

    def create_global_plan(self, plans: Any) -> Any: ...

    def finish_plan(self, plan: Any) -> Any: ...

    def load_bytes(self, read_item: ReadItem, value: Any) -> None: ...

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.dests[id(read_item)]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed += 1


def _slice_load(
    url: str, options: dict[str, Any], config: DcpLoaderConfig, key: str, rows: slice
) -> tuple[torch.Tensor, int, FsspecReader]:
    """Load rows ``rows`` of ``key`` alone through the loader, as one rank of a ``Shard(0)`` load would."""
    reader = FsspecReader(url, dict(options), loader_config=config)
    metadata = reader.read_metadata()
    shape = metadata.state_dict_metadata[key].size
    offsets, lengths = [rows.start] + [0] * (len(shape) - 1), [rows.stop - rows.start, *shape[1:]]
    index = MetadataIndex(key, torch.Size([0] * len(shape)))
    item = ReadItem(
        LoadItemType.TENSOR, index, torch.Size([0] * len(shape)), index, torch.Size(offsets), torch.Size(lengths)
    )
    dest = torch.zeros(lengths, dtype=metadata.state_dict_metadata[key].properties.dtype)
    planner = _Planner({id(item): dest})
    loader = DcpItemLoader(
        reader.transport, reader.root, metadata.storage_data, config, metadata=metadata, check_zips=True
    )
    rounds = _counting_rounds(reader)
    loader.load([item], planner)
    assert planner.committed == 1
    return dest, rounds[0], reader


def test_a_wrong_guess_of_a_slice_is_read_again(tmp_path: Path) -> None:
    """Rows of a transposed tensor are not a run of its stored bytes: read again the usual way."""
    state = _state("f8")
    _save(tmp_path / "ckpt", state)
    dest, rounds, _reader = _slice_load(str(tmp_path / "ckpt"), {}, GUESS, "t", slice(30, 100))
    assert rounds == 3  # everything, then the transposed record's header probe, then its rows
    assert torch.equal(dest, state["t"][30:100])


def test_a_guessed_slice_fetches_no_more_than_a_probed_one(s3_url: S3Location, tmp_path: Path) -> None:
    """The header fetched with a slice's rows is merged across no more bytes than the probe it replaces."""
    state = {"w": torch.randn(1000, 1000)}
    _save(tmp_path / "ckpt", state)
    url, options = s3_url
    fsspec.filesystem("s3", **options).put(str(tmp_path / "ckpt"), url, recursive=True)
    for rows in (slice(1, 11), slice(500, 510), slice(990, 1000)):
        got, rounds, guessed = _slice_load(url, options, DcpLoaderConfig(), "w", rows)
        _got, _rounds, probed = _slice_load(url, options, PROBE, "w", rows)
        assert torch.equal(got, state["w"][rows]) and rounds == 1
        assert guessed.transport.counters.bytes_read <= probed.transport.counters.bytes_read, rows


def test_quantized_dtypes_are_not_guessed() -> None:
    for dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2):
        assert predicted_record(dtype, (600, 600), 361_577) is None


@pytest.mark.parametrize("config", [GUESS, PROBE], ids=["guessed", "probed"])
def test_conjugate_and_negative_views_load_their_values(tmp_path: Path, config: DcpLoaderConfig) -> None:
    """A lazy ``conj()`` or ``neg()`` view is saved as its storage plus a bit; the raw elements are not its
    values, so such a record is loaded whole by torch.load, which applies the bit."""
    torch.manual_seed(0)
    state = {"c": torch.randn(300, 300, dtype=torch.complex64).conj(), "n": torch.randn(300, 300)._neg_view()}
    _save(tmp_path / "ckpt", state)
    resolved = {k: v.resolve_conj().resolve_neg() for k, v in state.items()}
    _load(str(tmp_path / "ckpt"), config, resolved)


def _fails_alike(url: str, state: dict[str, torch.Tensor], *words: str) -> None:
    """Guessed and probed loads of ``url`` raise the same ``CorruptCheckpointError``, naming every word."""
    messages = []
    for config in (GUESS, PROBE):
        with pytest.raises(BaseException) as caught:  # dcp.load wraps our error in a CheckpointException
            _load(url, config, state)
        text = str(caught.value)
        messages += [line for line in text.splitlines() if line.startswith("dcp_storage.errors.CorruptCheckpointError")]
        assert messages and all(word in messages[-1] for word in words), text
    assert messages[0] == messages[1]  # the same error either way


def test_a_damaged_guessed_header_fails_as_usual(tmp_path: Path) -> None:
    state = _state("f8", "t")
    _save(tmp_path / "ckpt", state)
    info = next(v for k, v in FsspecReader(str(tmp_path / "ckpt")).read_metadata().storage_data.items() if k.fqn == "w")
    path = tmp_path / "ckpt" / info.relative_path
    raw = bytearray(path.read_bytes())
    at = raw.index(b"data.pkl", info.offset) + len(b"data.pkl")  # the pickle follows the entry's name
    raw[at : at + 40] = b"\xff" * 40
    path.write_bytes(bytes(raw))
    _fails_alike(str(tmp_path / "ckpt"), state, info.relative_path, "data.pkl")


def test_a_record_fetched_with_the_data_is_checked_as_it_lands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small record fetched whole in the one round is checked (zip CRC-32) and decoded by the thread that
    fetched it, while other reads go on; a damaged one fails with the same error as when probed first."""
    import dcp_storage.formats.dcp_native.item_loader as item_loader

    state = _state("f8", "t")
    _save(tmp_path / "ckpt", state)
    threads: list[str] = []
    real = item_loader.tensor_of_record

    def noting(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(item_loader, "tensor_of_record", noting)
    _load(str(tmp_path / "ckpt"), GUESS, state)
    assert threads and threading.main_thread().name not in threads, threads
    info = next(
        v for k, v in FsspecReader(str(tmp_path / "ckpt")).read_metadata().storage_data.items() if k.fqn == "norm"
    )
    path = tmp_path / "ckpt" / info.relative_path
    raw = bytearray(path.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x55  # inside the tensor's bytes
    path.write_bytes(bytes(raw))
    _fails_alike(str(tmp_path / "ckpt"), state, info.relative_path, "CRC")


def test_on_an_object_store_guessing_is_the_default(s3_url: S3Location, tmp_path: Path) -> None:
    """One round and fewer requests than with probes first, and not a byte more."""
    state = _state("f8", "t")
    _save(tmp_path / "ckpt", state)
    url, options = s3_url
    fsspec.filesystem("s3", **options).put(str(tmp_path / "ckpt"), url, recursive=True)
    guessed, guessed_rounds = _load(url, None, state, options)
    probed, probed_rounds = _load(url, PROBE, state, options)
    assert (guessed_rounds, probed_rounds) == (1, 2)
    assert guessed.transport.counters.requests < probed.transport.counters.requests
    assert guessed.transport.counters.bytes_read <= probed.transport.counters.bytes_read


def test_every_rank_builds_its_client_before_the_metadata_is_shared(
    s3_url: S3Location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that receives the ``.metadata`` another rank read builds its S3 client meanwhile, in read_metadata,
    not at its first data request after the wait; building it sends no request."""
    state = _state("f8", "t")
    _save(tmp_path / "ckpt", state)
    url, options = s3_url
    fsspec.filesystem("s3", **options).put(str(tmp_path / "ckpt"), url, recursive=True)
    coordinator = FsspecReader(url, dict(options))
    shared = coordinator._read_per_load_files()
    monkeypatch.setattr(reader_module, "share_within_load", lambda fn, **kw: shared)  # another rank read it
    other = FsspecReader(url, dict(options))
    assert isinstance(other.transport, ClientSetUp) and getattr(other.transport.fs, "_s3", None) is None
    other.read_metadata()
    assert other.transport.fs._s3 is not None and other.transport.counters.requests == 0
