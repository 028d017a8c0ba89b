"""``dcp-storage inspect`` and ``verify`` on good, truncated and corrupted checkpoints of every format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dcp_storage.integrity.checksums import DEFAULT_ALGORITHM

from ._helpers import run_batch


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Path]) -> dict[str, Path]:
    from dcp_storage import convert, describe

    root = tmp_path_factory.mktemp("damaged")
    out: dict[str, Path] = {}

    def dcp_copy(name: str) -> Path:
        path = root / name
        shutil.copytree(sources["dcp"], path)
        return path

    data_files = sorted(p.name for p in sources["dcp"].glob("*.distcp"))
    big = max(data_files, key=lambda n: (sources["dcp"] / n).stat().st_size)

    out["dcp_truncated"] = p = dcp_copy("dcp_truncated")
    with open(p / big, "r+b") as f:
        f.truncate(100)
    out["dcp_missing_file"] = p = dcp_copy("dcp_missing_file")
    (p / big).unlink()
    out["dcp_no_metadata"] = p = dcp_copy("dcp_no_metadata")
    (p / ".metadata").unlink()
    (p / "marker.txt").write_text("not a checkpoint file")
    out["dcp_garbled_metadata"] = p = dcp_copy("dcp_garbled_metadata")
    (p / ".metadata").write_bytes(b"\x80\x04not a pickle")
    out["dcp_corrupt_record"] = p = dcp_copy("dcp_corrupt_record")
    info = describe(p)
    chunk = next(t for t in info.tensors if t.key == "model.embed.weight").chunks[0]
    with open(p / str(chunk.file), "r+b") as f:  # clobber the record's zip header: only a deep read sees it
        f.seek(int(chunk.offset or 0))
        f.write(b"garbage!" * 4)

    out["st_truncated"] = p = root / "trunc.safetensors"
    p.write_bytes(sources["safetensors"].read_bytes()[:-7])
    out["st_bad_header"] = p = root / "badheader.safetensors"
    data = bytearray(sources["safetensors"].read_bytes())
    data[9:15] = b"\x00\x01\x02\x03\x04\x05"  # inside the JSON
    p.write_bytes(bytes(data))
    sharded = root / "st_sharded"
    convert(sources["dcp_tensors"], sharded, to="safetensors", max_shard_size="8KB")
    out["st_sharded"] = sharded
    out["st_shard_missing"] = p = root / "st_shard_missing"
    shutil.copytree(sharded, p)
    sorted(p.glob("model-*-of-*.safetensors"))[1].unlink()

    out["pt_truncated"] = p = root / "trunc.pt"
    p.write_bytes(sources["torch"].read_bytes()[:-300])
    out["pt_bitflip"] = p = root / "flip.pt"
    raw = bytearray(sources["torch"].read_bytes())
    start = int(
        next(t for t in describe(sources["torch"]).tensors if t.key == "model.embed.weight").chunks[0].offset or 0
    )
    raw[start + 11] ^= 0x10
    p.write_bytes(bytes(raw))
    return out


def test_inspect_every_format(sources: dict[str, Path], reference: dict) -> None:
    results = run_batch(
        [
            ["inspect", str(sources["dcp"]), "--json"],
            ["inspect", str(sources["safetensors"]), "--json"],
            ["inspect", str(sources["torch"]), "--json"],
            ["inspect", str(sources["dcp"]), "--chunks"],
            ["inspect", str(sources["dcp"] / "nope")],
        ]
    )
    dcp, st, pt, text, missing = results
    for r in (dcp, st, pt, text):
        assert r.rc == 0, r
    infos = [json.loads(r.stdout) for r in (dcp, st, pt)]
    assert [i["format"] for i in infos] == ["dcp/1", "safetensors/1", "torch_save/1"]
    want_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    for info in infos:
        assert info["totals"]["tensors"] == len(reference)
        assert info["totals"]["tensor_bytes"] == want_bytes
        table = {t["key"]: t for t in info["tensors"]}
        emb = table["model.embed.weight"]
        assert emb["dtype"] == "float32" and emb["shape"] == [64, 32] and emb["nbytes"] == 64 * 32 * 4
        assert emb["chunks"][0]["file"] and emb["chunks"][0]["length"]
        assert info["totals"]["file_bytes"] == sum(f["size"] for f in info["files"])
    assert [v["key"] for v in infos[0]["values"]] == ["step"] and [v["key"] for v in infos[2]["values"]] == ["step"]
    assert {f["name"] for f in infos[0]["files"]} >= {".metadata"}
    assert "model.embed.weight" in text.stdout and "float32" in text.stdout and "[64, 32]" in text.stdout
    assert " at [0, 0] size [64, 32]: __0_" in text.stdout
    assert missing.rc == 1 and "no such file or directory" in missing.stderr


def test_verify_good_checkpoints(sources: dict[str, Path], damaged: dict[str, Path]) -> None:
    results = run_batch(
        [
            ["verify", str(sources["dcp"])],
            ["verify", str(sources["dcp"]), "--deep"],
            ["verify", str(sources["safetensors"]), "--deep"],
            ["verify", str(damaged["st_sharded"]), "--deep", "--json"],
            ["verify", str(sources["torch"]), "--deep"],
        ]
    )
    for r in results:
        assert r.rc == 0, r
        assert r.stderr == ""
    assert "OK" in results[0].stdout and "--deep" in results[0].stdout
    assert (
        f"{DEFAULT_ALGORITHM} checksums of 11 records in 2 files checked" in results[1].stdout
    )  # FsspecWriter records them
    assert "no checksums recorded" in results[2].stdout  # safetensors' own save_file records none
    report = json.loads(results[3].stdout)
    assert report["ok"] and report["checked"]["tensors_read"] == report["checked"]["tensors"] > 0
    assert "CRC32" in results[4].stdout


def test_verify_names_every_problem(damaged: dict[str, Path]) -> None:
    names = [
        "dcp_truncated",
        "dcp_missing_file",
        "dcp_no_metadata",
        "dcp_garbled_metadata",
        "st_truncated",
        "st_bad_header",
        "st_shard_missing",
        "pt_truncated",
    ]
    results = run_batch(
        [["verify", str(damaged[n])] for n in names]
        + [
            ["verify", str(damaged["dcp_corrupt_record"])],
            ["verify", str(damaged["dcp_corrupt_record"]), "--deep"],
            ["verify", str(damaged["pt_bitflip"])],
            ["verify", str(damaged["pt_bitflip"]), "--deep", "--json"],
        ]
    )
    got = dict(zip(names, results))
    for name, r in got.items():
        assert r.rc == 1, (name, r)
        assert "PROBLEM:" in r.stdout and "FAILED" in r.stdout, (name, r)
        assert r.stderr.startswith("dcp-storage verify: error:"), (name, r)
    assert "truncated" in got["dcp_truncated"].stdout and "'model.embed.weight'" in got["dcp_truncated"].stdout
    assert "missing (holds" in got["dcp_missing_file"].stdout
    assert "incomplete checkpoint" in got["dcp_no_metadata"].stdout and "no .metadata" in got["dcp_no_metadata"].stdout
    assert "cannot be decoded" in got["dcp_garbled_metadata"].stdout
    assert "runs past the end" in got["st_truncated"].stdout or "truncated" in got["st_truncated"].stdout
    assert "not valid JSON" in got["st_bad_header"].stdout
    assert "no such file" in got["st_shard_missing"].stdout
    assert "truncated" in got["pt_truncated"].stdout
    shallow_record, deep_record, shallow_flip, deep_flip = results[len(names) :]
    assert shallow_record.rc == 0, shallow_record  # sizes and metadata are intact
    assert deep_record.rc == 1 and "tensor 'model.embed.weight'" in deep_record.stdout, deep_record
    assert shallow_flip.rc == 0, shallow_flip
    report = json.loads(deep_flip.stdout)
    assert deep_flip.rc == 1 and not report["ok"]
    assert any("CRC32" in p and "data/" in p for p in report["problems"]), report


def _needs_missing_plugin(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose items all name a stream extension no installed package provides, and whose manifest
    says which distribution wrote it (as a checkpoint saved with a plugin that is not installed here)."""
    import pickle

    shutil.copytree(src, dst)
    md = pickle.loads((dst / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.transform_descriptors = ["stream.nosuchplugin/1"]
    (dst / ".metadata").write_bytes(pickle.dumps(md))
    manifest = json.loads((dst / ".dcp_storage.json").read_text())
    manifest["extensions"] = [
        {"descriptor": "stream.nosuchplugin/1", "distribution": "dcp-storage-nosuch", "version": "2.0"}
    ]
    (dst / ".dcp_storage.json").write_text(json.dumps(manifest))
    return dst


def test_verify_reports_a_missing_extension_plugin_once(tmp_path: Path, sources: dict[str, Path]) -> None:
    """A plain verify used to say OK, and --deep named the missing plugin once per tensor."""
    from dcp_storage import verify

    ckpt = _needs_missing_plugin(sources["dcp"], tmp_path / "needs_plugin")
    for deep in (False, True):
        report = verify(ckpt, deep=deep)
        assert not report.ok and len(report.problems) == 1, report.problems
        problem = report.problems[0]
        assert "'stream.nosuchplugin/1'" in problem and "pip install 'dcp-storage-nosuch==2.0'" in problem, problem
        assert "a load would fail: 11 item(s) in 2 file(s)" in problem, problem
    shallow, deep = run_batch([["verify", str(ckpt)], ["verify", str(ckpt), "--deep"]])
    for r in (shallow, deep):
        assert r.rc == 1 and r.stdout.count("PROBLEM:") == 1 and r.stdout.count("stream.nosuchplugin") == 1, r


def test_verify_one_shard_names_its_set(tmp_path: Path, damaged: dict[str, Path]) -> None:
    whole = damaged["st_sharded"]
    shards = sorted(p.name for p in whole.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    no_index = tmp_path / "no_index"
    shutil.copytree(whole, no_index)
    (no_index / "model.safetensors.index.json").unlink()
    missing = sorted(p.name for p in damaged["st_shard_missing"].glob("*.safetensors"))
    gone = sorted(set(shards) - set(missing))
    alone, without_sibling, without_index = run_batch(
        [
            ["verify", str(whole / shards[0])],
            ["verify", str(damaged["st_shard_missing"] / shards[0])],
            ["verify", str(no_index / shards[-1]), "--json"],
        ]
    )
    assert alone.rc == 0, alone
    index = whole / "model.safetensors.index.json"
    assert f"note: {shards[0]} is one shard of a sharded set: verify {index} to check the whole set" in alone.stdout
    assert f"(siblings: {', '.join(shards[1:])})" in alone.stdout, alone
    assert without_sibling.rc == 1 and f"but {gone[0]} is missing from" in without_sibling.stdout, without_sibling
    report = json.loads(without_index.stdout)
    assert without_index.rc == 1 and not report["ok"], without_index
    assert any("model.safetensors.index.json is missing" in p and "cannot be loaded" in p for p in report["problems"])
