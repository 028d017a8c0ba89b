"""Special files, sparse giants, symlinks out of the checkpoint and broadcast views (issue 10, classes 5, 6, 9).

The corpus cases (:mod:`.corpus_files`) go through every entry point in ``test_corpus.py``; here:

* their peak memory and time, measured in a separate process (``_peak_rss``), for every entry point and
  ``convert``;
* the manifest (which a load does not read) as a FIFO, device, directory, sparse file or 100k-deep JSON;
* that a secret in a file outside the checkpoint reaches no message, report, JSON or CLI output, that the
  file is not even read (its access time stays put), and that manifest checksums cannot test guesses;
* that a checksum mismatch never prints the digest of the stored bytes;
* what must keep working: a checkpoint root that is a symlink, symlinks that stay inside, the Hugging Face
  hub cache layout, small broadcast views.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import FsspecWriter, open_reader
from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError, DcpStorageError, FileTooLargeError
from dcp_storage.inspection import describe, verify

from .corpus import Case
from .corpus_files import OUTSIDE, SECRET, can_mknod_device, replace_with
from .harness import ENTRY_POINTS, MAX_SECONDS, _inner, run_entry

REPO = Path(__file__).resolve().parents[2]
PEAK_MIB = 256  # above the level before the call; a whole read of any giant here would be 1-8 GiB
MANIFEST = ".dcp_storage.json"


def _load_error(url: str, dest: dict[str, Any], **options: Any) -> BaseException:
    """The reader's own error from ``dcp.load`` (DCP wraps it in a ``CheckpointException``)."""
    try:
        dcp.load(dest, storage_reader=open_reader(url, **options), no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        inner = _inner(exc)
        if isinstance(inner, AssertionError) and "metadata read failed" in str(inner):
            # DCP re-raises a failed read_metadata as its own AssertionError (tests/README.md): the reader's
            # error class comes from the same read on a fresh reader.
            try:
                open_reader(url, **options).read_metadata()
            except BaseException as again:  # noqa: BLE001
                return again
        return inner
    raise AssertionError(f"{url}: loaded")


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.ERROR, logger="torch.distributed.checkpoint")


def _resource_cases(corpus: list[Case]) -> list[Case]:
    return [c for c in corpus if "-is-" in c.name or "sparse" in c.name or "broadcast" in c.name]


def test_special_files_and_broadcasts_cost_bounded_memory_and_time(corpus: list[Case]) -> None:
    cases = _resource_cases(corpus)
    assert len(cases) >= 40
    rows = [[c.name, c.family, c.url, c.culprit, c.in_metadata, c.marker, c.keys] for c in cases]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "tests.hostile._peak_rss"],
        input=json.dumps(rows),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) == 4 * len(cases)
    failures = []
    for r in results:
        case = next(c for c in cases if c.name == r["case"])
        if r["seconds"] > MAX_SECONDS or r["peak_mib_above"] > PEAK_MIB:
            failures.append(f"{r['case']} [{r['entry']}]: {r['seconds']} s, {r['peak_mib_above']} MiB")
        elif r["entry"] == "convert" and not (r["ours"] and case.culprit in r["message"]):
            failures.append(f"{r['case']} [convert]: {r['raised']}: {r['message'][:200]}")
    worst = max(results, key=lambda r: r["peak_mib_above"])
    slowest = max(results, key=lambda r: r["seconds"])
    print(
        f"{len(results)} runs; peak {worst['peak_mib_above']} MiB ({worst['case']} {worst['entry']}); "
        f"slowest {slowest['seconds']} s ({slowest['case']} {slowest['entry']})"
    )
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------ the manifest
def _dcp_checkpoint(path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"w": torch.arange(64.0).reshape(8, 8), "step": 3}
        dcp.save(state, storage_writer=FsspecWriter(str(path)), no_dist=True)
    return path


MANIFEST_KINDS = ["fifo", "dev-zero", "socket", "dir", "sparse-8GiB", "deep-json", "device"]


@pytest.mark.parametrize("kind", MANIFEST_KINDS)
def test_a_hostile_manifest_is_reported_by_verify_and_never_hangs(tmp_path: Path, kind: str) -> None:
    if kind == "device" and not can_mknod_device(tmp_path):
        pytest.skip("mknod of a device needs root or CAP_MKNOD")
    ckpt = _dcp_checkpoint(tmp_path / "ckpt")
    if kind == "deep-json":
        (ckpt / MANIFEST).write_text("[" * 100_000)
    else:
        replace_with(ckpt / MANIFEST, kind)
    start = time.monotonic()
    report = verify(str(ckpt), deep=True)
    assert not report.ok and any(MANIFEST in p for p in report.problems), report.problems
    info = describe(str(ckpt))  # the manifest only feeds the provenance shown: reported there
    assert MANIFEST in json.dumps(info.provenance), info.provenance
    error = _load_error(str(ckpt), {"w": torch.zeros(8, 8)}, verify=True)
    assert isinstance(error, DcpStorageError) and MANIFEST in str(error), error
    assert time.monotonic() - start < MAX_SECONDS


def test_a_large_manifest_is_refused_before_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _dcp_checkpoint(tmp_path / "ckpt")
    size = (ckpt / MANIFEST).stat().st_size
    monkeypatch.setenv("DCP_STORAGE_MAX_MANIFEST_BYTES", str(size - 1))
    report = verify(str(ckpt), deep=True)
    assert any(MANIFEST in p and "DCP_STORAGE_MAX_MANIFEST_BYTES" in p for p in report.problems), report.problems
    monkeypatch.setenv("DCP_STORAGE_MAX_MANIFEST_BYTES", str(size))
    assert verify(str(ckpt), deep=True).ok


def test_a_large_metadata_file_is_refused_naming_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _dcp_checkpoint(tmp_path / "ckpt")
    monkeypatch.setenv("DCP_STORAGE_MAX_METADATA_BYTES", "100")
    with pytest.raises(FileTooLargeError, match=r"\.metadata: is \d+ bytes, more than the 100-byte limit") as err:
        open_reader(str(ckpt)).read_metadata()
    assert "DCP_STORAGE_MAX_METADATA_BYTES" in str(err.value)
    monkeypatch.setenv("DCP_STORAGE_MAX_METADATA_BYTES", "lots")
    with pytest.raises(ValueError, match="DCP_STORAGE_MAX_METADATA_BYTES"):
        open_reader(str(ckpt)).read_metadata()


# ---------------------------------------------------------------------------------- nothing outside is read
def _outputs_of(case: Case) -> list[str]:
    """Every message, report and CLI output the case produces."""
    texts = []
    for entry in ENTRY_POINTS:
        out = run_entry(case, entry)
        texts += [out.message, *out.problems]
    for produce in (lambda: describe(case.url).__dict__, lambda: verify(case.url, deep=True).__dict__):
        try:
            texts.append(json.dumps(produce(), default=str))
        except DcpStorageError as exc:
            texts.append(str(exc))
    return texts


def test_no_output_quotes_or_fingerprints_a_file_outside(corpus: list[Case], corpus_root: Path) -> None:
    from dcp_storage.integrity.checksums import checksum

    escapes = [c for c in corpus if "escape" in c.name]
    assert len(escapes) >= 12
    outside = sorted(p for p in (corpus_root / OUTSIDE).rglob("*") if p.is_file())
    fingerprints = {checksum(p.read_bytes()) for p in outside}
    old = 1_000_000_000  # an access time older than the modification time: any read moves it (relatime)
    for p in outside:
        os.utime(p, (old, p.stat().st_mtime))
    probe = corpus_root / "atime-probe"
    probe.write_bytes(b"x")
    os.utime(probe, (old, probe.stat().st_mtime))
    probe.read_bytes()
    atime_works = probe.stat().st_atime != old  # noatime mounts cannot show reads

    from tests.cli._helpers import run_batch

    texts: list[str] = []
    for case in escapes:
        texts += _outputs_of(case)
    commands = [[*cmd, c.url, "--json"] for c in escapes for cmd in (["inspect"], ["verify", "--deep"])]
    texts += [out for r in run_batch(commands, timeout=600) for out in (r.stdout, r.stderr)]
    leaks = [t[:300] for t in texts if SECRET in t or "root:x:0:0" in t or any(f in t for f in fingerprints)]
    assert not leaks, leaks
    if atime_works:
        read = [str(p) for p in outside if p.stat().st_atime != old]
        assert not read, f"files outside the checkpoint were read: {read}"


def test_manifest_checksums_cannot_test_guesses_about_a_file_outside(tmp_path: Path) -> None:
    from dcp_storage.integrity.checksums import checksum

    secret = tmp_path / "secret.txt"
    secret.write_text(f"password={SECRET}\n")
    right = checksum(secret.read_bytes())
    reports = []
    for guess in (right, "0" * len(right)):
        ckpt = _dcp_checkpoint(tmp_path / f"ckpt-{guess[:4]}")
        doc = json.loads((ckpt / MANIFEST).read_text())
        size = secret.stat().st_size
        name = os.path.relpath(secret, ckpt)
        doc["checksums"]["files"][name] = {"size": size, "items": [[0, size, guess]]}
        (ckpt / MANIFEST).write_text(json.dumps(doc))
        report = verify(str(ckpt), deep=True)
        assert any(MANIFEST in p and "escapes the checkpoint" in p for p in report.problems), report.problems
        reports.append([p.replace(str(ckpt), "CKPT") for p in report.problems])
    assert reports[0] == reports[1]  # the right guess and a wrong one look the same


def test_a_checksum_mismatch_does_not_print_the_digest_of_the_stored_bytes(tmp_path: Path) -> None:
    from dcp_storage.integrity.checksums import checksum

    ckpt = _dcp_checkpoint(tmp_path / "ckpt")
    doc = json.loads((ckpt / MANIFEST).read_text())
    [(name, entry)] = doc["checksums"]["files"].items()
    data = bytearray((ckpt / name).read_bytes())
    offset, length, _digest = entry["items"][-1]
    data[offset + length - 3] ^= 0xFF
    (ckpt / name).write_bytes(bytes(data))
    computed = checksum(bytes(data[offset : offset + length]))
    problems = verify(str(ckpt), deep=True).problems
    assert any("checksum mismatch" in p for p in problems), problems
    error = _load_error(str(ckpt), {"w": torch.zeros(8, 8), "step": 0}, verify=True)
    assert "checksum mismatch" in str(error)
    assert computed not in json.dumps(problems) and computed not in str(error)


# ------------------------------------------------------------------------------------- what keeps working
def _loads(url: str) -> torch.Tensor:
    dest = {"w": torch.zeros(8, 8)}
    dcp.load(dest, storage_reader=open_reader(url), no_dist=True)
    return dest["w"]


def test_a_symlinked_root_and_links_inside_it_load(tmp_path: Path) -> None:
    real = _dcp_checkpoint(tmp_path / "real")
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    assert torch.equal(_loads(str(tmp_path / "link")), torch.arange(64.0).reshape(8, 8))
    (real / "store").mkdir()
    (real / "__0_0.distcp").rename(real / "store" / "__0_0.distcp")
    (real / "__0_0.distcp").symlink_to(Path("store") / "__0_0.distcp")  # a link that stays inside
    assert torch.equal(_loads(str(tmp_path / "link")), torch.arange(64.0).reshape(8, 8))
    assert verify(str(tmp_path / "link"), deep=True).ok


def test_the_hugging_face_hub_cache_layout_loads(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    save_file({"w": torch.arange(64.0).reshape(8, 8)}, str(repo / "blobs" / "abc123"))
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(Path("..") / ".." / "blobs" / "abc123")
    assert torch.equal(_loads(str(snap / "model.safetensors")), torch.arange(64.0).reshape(8, 8))
    assert torch.equal(_loads(str(snap)), torch.arange(64.0).reshape(8, 8))
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"w": torch.ones(8, 8)}, str(outside))
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(outside)  # past the repository: refused
    with pytest.raises(DcpStorageError, match="outside the checkpoint"):
        describe(str(snap))


def test_a_subfolder_of_a_hub_snapshot_loads_and_links_past_its_repository_are_refused(tmp_path: Path) -> None:
    """diffusers-style repositories keep models in subfolders of a snapshot (``snapshots/<rev>/unet/``),
    linked three levels up into ``blobs/``. Before, only a snapshot's own directory could reach its
    repository, so a subfolder was refused as "outside the checkpoint"."""
    from safetensors.torch import save_file

    hub = tmp_path / "hub"
    repo = hub / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    save_file({"w": torch.arange(64.0).reshape(8, 8)}, str(repo / "blobs" / "abc123"))
    unet = repo / "snapshots" / "0123abcd" / "unet"
    unet.mkdir(parents=True)
    (unet / "model.safetensors").symlink_to(Path("..") / ".." / ".." / "blobs" / "abc123")
    assert torch.equal(_loads(str(unet / "model.safetensors")), torch.arange(64.0).reshape(8, 8))
    assert torch.equal(_loads(str(unet)), torch.arange(64.0).reshape(8, 8))
    other = hub / "models--org--other"
    (other / "blobs").mkdir(parents=True)
    save_file({"w": torch.ones(8, 8)}, str(other / "blobs" / "def456"))
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"w": torch.ones(8, 8)}, str(outside))
    for target in (Path("..") / ".." / ".." / ".." / "models--org--other" / "blobs" / "def456", outside):
        (unet / "model.safetensors").unlink()
        (unet / "model.safetensors").symlink_to(target)  # another repository, or past the hub: refused
        with pytest.raises(DcpStorageError, match="outside the checkpoint"):
            describe(str(unet / "model.safetensors"))
    # a directory merely named "snapshots" deeper inside a snapshot does not widen anything
    nested = repo / "snapshots" / "0123abcd" / "snapshots" / "x"
    nested.mkdir(parents=True)
    (nested / "model.safetensors").symlink_to(Path("..") / ".." / ".." / ".." / ".." / ".." / "elsewhere.safetensors")
    with pytest.raises(DcpStorageError, match="outside the checkpoint"):
        describe(str(nested / "model.safetensors"))


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "dir"])
def test_a_missing_or_special_checkpoint_url_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"\0" * 16)
    replace_with(target, kind)
    start = time.monotonic()
    with pytest.raises(DcpStorageError):
        describe(str(target))
    assert isinstance(_load_error(str(target), {"w": torch.zeros(8, 8)}), DcpStorageError)
    assert time.monotonic() - start < MAX_SECONDS
    with pytest.raises(CheckpointNotFoundError):
        describe(str(tmp_path / "nothing-here"))


def test_a_small_broadcast_view_loads_and_converts(tmp_path: Path) -> None:
    from dcp_storage import convert

    expected = torch.arange(8.0).expand(8, 8)
    torch.save({"w": expected}, tmp_path / "model.pt")
    assert torch.equal(_loads(str(tmp_path / "model.pt")), expected)
    convert(str(tmp_path / "model.pt"), str(tmp_path / "out"), to="safetensors")
    assert torch.equal(_loads(str(tmp_path / "out")), expected)


def test_a_broadcast_view_past_the_limit_is_refused_and_the_limit_can_be_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save({"w": torch.arange(8.0).expand(2**10, 8)}, tmp_path / "model.pt")  # 32 KiB from 32 bytes
    monkeypatch.setenv("DCP_STORAGE_MAX_BROADCAST_BYTES", str(16 * 1024))
    with pytest.raises(CorruptCheckpointError, match="model.pt.*DCP_STORAGE_MAX_BROADCAST_BYTES"):
        describe(str(tmp_path / "model.pt"))
    monkeypatch.setenv("DCP_STORAGE_MAX_BROADCAST_BYTES", str(32 * 1024))
    assert describe(str(tmp_path / "model.pt")).tensors[0].shape == [2**10, 8]


def test_broadcast_views_of_a_file_share_one_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each view stays within the limit, but N of them (a few bytes of pickle each) repeat the storage N
    times: before, 10,000 views of 64 MiB each in a 1 MB file made ``convert`` write 640 GiB and
    ``verify --deep`` read as much. Together they now share the limit one view has."""
    base = torch.arange(8.0)
    torch.save({f"w{i}": base.expand(2**9, 8) for i in range(4)}, tmp_path / "model.pt")  # 4 x 16 KiB
    monkeypatch.setenv("DCP_STORAGE_MAX_BROADCAST_BYTES", str(32 * 1024))
    with pytest.raises(CorruptCheckpointError, match="model.pt.*DCP_STORAGE_MAX_BROADCAST_BYTES"):
        describe(str(tmp_path / "model.pt"))
    monkeypatch.setenv("DCP_STORAGE_MAX_BROADCAST_BYTES", str(64 * 1024))
    assert len(describe(str(tmp_path / "model.pt")).tensors) == 4
    tied = torch.randn(64, 64)  # tied weights: full views of one storage repeat nothing beyond it
    torch.save({"embed": tied, "head": tied, "again": tied}, tmp_path / "tied.pt")
    monkeypatch.setenv("DCP_STORAGE_MAX_BROADCAST_BYTES", "0")
    assert len(describe(str(tmp_path / "tied.pt")).tensors) == 3


def _broadcast_record_checkpoint(path: Path, rows: int, parameter: bool = False) -> Any:
    """A DCP checkpoint whose ``w`` ([rows, 2**12] f32) is stored as one element broadcast (stride 0);
    ``parameter``: saved as an ``nn.Parameter`` (a pickle the record parser leaves to ``torch.load``)."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from .corpus import _torch_save_bytes

    _dcp_checkpoint(path)
    (path / MANIFEST).unlink()  # torch's writers record no checksums either
    view = torch.zeros(1).expand(rows, 2**12)
    record = _torch_save_bytes(torch.nn.Parameter(view, requires_grad=False) if parameter else view)
    (path / "evil.distcp").write_bytes(record)
    md = pickle.loads((path / ".metadata").read_bytes())
    size = torch.Size([rows, 2**12])
    md.state_dict_metadata["w"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), size, [ChunkStorageMetadata(torch.Size([0, 0]), size)]
    )
    md.storage_data = {
        (MetadataIndex("w", torch.Size([0, 0]), 0) if i.fqn == "w" else i): (
            _StorageInfo("evil.distcp", 0, len(record)) if i.fqn == "w" else info
        )
        for i, info in md.storage_data.items()
    }
    (path / ".metadata").write_bytes(pickle.dumps(md))


def test_broadcast_records_of_a_dcp_checkpoint_share_one_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each record stays within the limit alone, but N of them (a few hundred bytes each) expand N times:
    before, ``convert`` and ``verify --deep`` of 10,000 such records (a few MB) read and wrote 640 GiB.
    From ``.metadata`` alone, records together may describe the limit beyond what they store."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from .corpus import _torch_save_bytes

    path = _dcp_checkpoint(tmp_path / "ckpt")
    (path / MANIFEST).unlink()
    record = _torch_save_bytes(torch.zeros(1).expand(2, 2**12))  # 32 KiB described
    (path / "evil.distcp").write_bytes(record * 4)
    md = pickle.loads((path / ".metadata").read_bytes())
    size = torch.Size([2, 2**12])
    for i in range(4):
        md.state_dict_metadata[f"b{i}"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), size, [ChunkStorageMetadata(torch.Size([0, 0]), size)]
        )
        md.storage_data[MetadataIndex(f"b{i}", torch.Size([0, 0]), 0)] = _StorageInfo(
            "evil.distcp", i * len(record), len(record)
        )
    (path / ".metadata").write_bytes(pickle.dumps(md))
    monkeypatch.setenv("DCP_STORAGE_MAX_BROADCAST_BYTES", str(64 * 1024))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata.*DCP_STORAGE_MAX_BROADCAST_BYTES"):
        describe(str(path))
    monkeypatch.setenv("DCP_STORAGE_MAX_BROADCAST_BYTES", str(256 * 1024))
    assert verify(str(path), deep=True).ok


@pytest.mark.parametrize("parameter", [False, True])
def test_a_dcp_record_that_broadcasts_is_refused_by_convert_verify_and_load(tmp_path: Path, parameter: bool) -> None:
    from dcp_storage import convert

    _broadcast_record_checkpoint(tmp_path / "ckpt", rows=2**14, parameter=parameter)  # 256 MiB of view from 4 bytes
    url = str(tmp_path / "ckpt")
    with pytest.raises(CorruptCheckpointError, match="evil.distcp.*broadcast"):
        convert(url, str(tmp_path / "out"), to="safetensors", drop_non_tensors=True)
    assert any("evil.distcp" in p and "broadcast" in p for p in verify(url, deep=True).problems)
    error = _load_error(url, {"w": torch.empty(2**14, 2**12)})
    assert isinstance(error, CorruptCheckpointError) and "evil.distcp" in str(error), error
