"""``dcp-storage convert``: every format pair, bit-exact, locally and on s3://, through the real CLI."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import torch

from ._helpers import assert_same_tensors, cli_env, flatten, option_flags, run_batch, run_cli, run_python


def _load_dcp(path: Path | str, storage_options: dict | None = None) -> dict[str, object]:
    """Everything in a DCP checkpoint, flattened, read by torch's own reader where it can (local)."""
    from dcp_storage.conversion import TensorSource

    out: dict[str, object] = {}
    with TensorSource.open(str(path), storage_options, "dcp") as src:
        for key in src.tensors:
            out[key] = src.read_tensor(key)
        for key in src.values:
            out[key] = src.read_value(key)
    return out


def _torch_dcp_load(path: Path) -> dict[str, object]:
    """torch's FileSystemReader + _EmptyStateDictLoadPlanner (what dcp_to_torch_save uses): interop check."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, object] = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return flatten(sd)


def _tensors(d: dict[str, object]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}


def test_all_format_pairs_round_trip_bit_exact(tmp_path: Path, sources: dict[str, Path], reference: dict) -> None:
    from safetensors.torch import load_file

    src = str(sources["dcp_tensors"])
    a_st, a_pt, a_dcp = tmp_path / "a.safetensors", tmp_path / "a.pt", tmp_path / "a_dcp"
    b_pt, b_st, b_dcp = tmp_path / "b.bin", tmp_path / "b_st", tmp_path / "b_dcp"
    results = run_batch(
        [
            # dcp -> safetensors -> torch -> dcp
            ["convert", src, str(a_st)],
            ["convert", str(a_st), str(a_pt)],
            ["convert", str(a_pt), str(a_dcp), "--to", "dcp"],
            # dcp -> torch -> safetensors -> dcp
            ["convert", src, str(b_pt), "--json"],
            ["convert", str(b_pt), str(b_st), "--to", "safetensors"],
            ["convert", str(b_st), str(b_dcp), "--to", "dcp"],
        ]
    )
    for r in results:
        assert r.rc == 0, r
    assert "converted" in results[0].stdout and "-> " in results[0].stdout
    summary = json.loads(results[3].stdout)
    assert summary["src_format"] == "dcp/1" and summary["to"] == "torch" and summary["tensors"] == len(reference)

    assert_same_tensors(load_file(str(a_st)), reference)
    assert_same_tensors(flatten(torch.load(a_pt, weights_only=True)), reference)
    assert_same_tensors(flatten(torch.load(b_pt, weights_only=True)), reference)
    assert_same_tensors(load_file(str(b_st / "model.safetensors")), reference)
    for out in (a_dcp, b_dcp):
        assert_same_tensors(_tensors(_load_dcp(out)), reference)
        assert_same_tensors(_tensors(_torch_dcp_load(out)), reference)  # torch reads our DCP output


def test_safetensors_output_is_byte_identical_to_safetensors_library(tmp_path: Path, sources: dict[str, Path]) -> None:
    from dcp_storage import convert

    convert(sources["torch"], tmp_path / "x.safetensors", drop_non_tensors=True)
    ref = (sources["safetensors"]).read_bytes()  # safetensors.torch.save_file of the same tensors
    assert (tmp_path / "x.safetensors").read_bytes() == ref


def test_values_survive_dcp_torch_dcp(tmp_path: Path, sources: dict[str, Path], reference: dict) -> None:
    from dcp_storage import convert

    convert(sources["dcp"], tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert loaded["step"] == 11 and isinstance(loaded["model"], dict)
    convert(tmp_path / "m.pt", tmp_path / "back", to="dcp")
    back = _torch_dcp_load(tmp_path / "back")
    assert back["step"] == 11
    assert_same_tensors(_tensors(back), reference)


def test_drop_ins_match_torch_format_utils(tmp_path: Path, sources: dict[str, Path]) -> None:
    """Same nested result as torch's functions; our data.pkl is byte-identical to torch.save's."""
    from torch.distributed.checkpoint import format_utils as fu

    import dcp_storage

    fu.dcp_to_torch_save(sources["dcp"], tmp_path / "torch_ref")
    dcp_storage.conversion.dcp_to_torch_save(sources["dcp"], tmp_path / "ours")  # no suffix: still one file, as torch
    ours = torch.load(tmp_path / "ours", weights_only=True)
    theirs = torch.load(tmp_path / "torch_ref", weights_only=True)
    assert ours.keys() == theirs.keys() and ours["step"] == theirs["step"]
    assert_same_tensors(flatten(ours["model"]), flatten(theirs["model"]))

    def pkl(path: Path) -> bytes:
        with zipfile.ZipFile(path) as z:
            return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))

    assert pkl(tmp_path / "ours") == pkl(tmp_path / "torch_ref")

    dcp_storage.conversion.torch_save_to_dcp(tmp_path / "torch_ref", tmp_path / "dcp_ours")
    fu.torch_save_to_dcp(tmp_path / "torch_ref", tmp_path / "dcp_theirs")
    a, b = _torch_dcp_load(tmp_path / "dcp_ours"), _torch_dcp_load(tmp_path / "dcp_theirs")
    assert a.keys() == b.keys() and a["step"] == b["step"]
    assert_same_tensors(_tensors(a), _tensors(b))


def test_torch_save_to_dcp_never_runs_pickled_code(tmp_path: Path) -> None:
    import dcp_storage

    class Evil:
        def __reduce__(self):  # would run on a weights_only=False load
            return (print, ("pwned",))

    torch.save({"w": torch.ones(2), "evil": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(dcp_storage.errors.UnsafeCheckpointError):
        dcp_storage.conversion.torch_save_to_dcp(tmp_path / "evil.pt", tmp_path / "out")


def test_sharding_dtype_cast_and_refusals(tmp_path: Path, sources: dict[str, Path], reference: dict) -> None:
    from safetensors.torch import load_file

    from dcp_storage import convert
    from dcp_storage.errors import NonTensorStateError

    res = convert(
        sources["dcp"],
        tmp_path / "sharded",
        to="safetensors",
        max_shard_size="8KB",
        dtype="bf16",
        drop_non_tensors=True,
    )
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and res.dropped_values == ["step"]
    got: dict[str, torch.Tensor] = {}
    for name in set(index["weight_map"].values()):
        got.update(load_file(str(tmp_path / "sharded" / name)))
    want = {
        k: (v.to(torch.bfloat16) if v.dtype in (torch.float16, torch.float32, torch.float64) else v)
        for k, v in reference.items()
    }
    assert_same_tensors(got, want)
    with pytest.raises(NonTensorStateError, match="step"):
        convert(sources["dcp"], tmp_path / "refused.safetensors")
    shards = convert(sources["dcp_tensors"], tmp_path / "bins", to="torch", max_shard_size="8KB")
    assert shards.output.endswith("pytorch_model.bin.index.json") and len(shards.files) > 2


def test_cli_exit_codes_errors_and_no_progress_without_tty(tmp_path: Path, sources: dict[str, Path]) -> None:
    env = cli_env(DCP_STORAGE_PROGRESS_DELAY="0")
    ok = run_cli("convert", str(sources["safetensors"]), str(tmp_path / "o.pt"), env=env)
    assert ok.rc == 0, ok
    assert ok.stderr == "", ok  # stderr is a pipe: no progress bar even with no delay
    results = run_batch(
        [
            ["convert", str(sources["safetensors"]), str(tmp_path / "o.pt")],  # exists
            ["convert", str(tmp_path / "missing"), str(tmp_path / "x.pt")],
            ["convert", str(sources["safetensors"]), str(tmp_path / "plain")],  # format not inferable
            ["convert", str(sources["safetensors"]), str(tmp_path / "y.pt"), "--dtype", "int7"],
            ["convert", str(sources["safetensors"]), str(tmp_path / "y.pt"), "-o", "novalue"],
            ["convert", str(sources["safetensors"]), str(tmp_path / "y.pt"), "--to", "nope"],
            ["convert", str(sources["safetensors"]), str(tmp_path / "o.pt"), "--overwrite", "-o", "auto_mkdir=true"],
        ]
    )
    exists, missing, plain, dtype, option, to, overwrite = results
    assert exists.rc == 1 and "CheckpointExistsError" in exists.stderr and "--overwrite" in exists.stderr
    assert len(exists.stderr.strip().splitlines()) == 1 and "Traceback" not in exists.stderr
    assert missing.rc == 1 and "no such file or directory" in missing.stderr
    assert plain.rc == 2 and "--to" in plain.stderr
    assert dtype.rc == 2 and "unknown dtype 'int7'" in dtype.stderr
    assert option.rc == 2 and "KEY=VALUE" in option.stderr
    assert to.rc == 2 and "invalid choice" in to.stderr
    assert overwrite.rc == 0, overwrite
    debug = run_cli("--debug", "convert", str(tmp_path / "missing"), str(tmp_path / "x.pt"))
    assert debug.rc == 1 and "Traceback" in debug.stderr and "CheckpointNotFoundError" in debug.stderr


def test_cli_convert_on_s3(tmp_path: Path, s3_url, sources: dict[str, Path], reference: dict) -> None:
    import fsspec
    from safetensors.torch import load

    url, options = s3_url
    flags = option_flags(options)
    fs = fsspec.filesystem("s3", **options)
    fs.pipe_file(f"{url}/bad/model.safetensors", sources["safetensors"].read_bytes()[:-5])  # truncated upload
    for f in sources["dcp"].iterdir():
        data = f.read_bytes()
        fs.pipe_file(f"{url}/bad_dcp/{f.name}", data[: len(data) // 2] if f.suffix == ".distcp" else data)
    results = run_batch(
        [
            [
                "convert",
                str(sources["dcp"]),
                f"{url}/st",
                "--to",
                "safetensors",
                "--drop-non-tensors",
                "--max-shard-size",
                "8KB",
                *flags,
            ],
            ["convert", f"{url}/st", f"{url}/m.pt", *flags],
            ["convert", f"{url}/m.pt", str(tmp_path / "back"), "--to", "dcp", *flags],
            ["convert", str(sources["dcp"]), f"{url}/dcp", "--to", "dcp", *flags],
            ["verify", f"{url}/dcp", "--deep", *flags],
            ["inspect", f"{url}/st", "--json", *flags],
            ["verify", f"{url}/bad/model.safetensors", *flags],
            ["verify", f"{url}/bad_dcp", *flags],
        ]
    )
    bad_st, bad_dcp = results[-2:]
    for r in results[:-2]:
        assert r.rc == 0, r
    assert bad_st.rc == 1 and "truncated" in bad_st.stdout and "s3://" in bad_st.stdout, bad_st
    assert bad_dcp.rc == 1 and bad_dcp.stdout.count("(truncated?)") >= 1 and "s3://" in bad_dcp.stdout, bad_dcp
    assert_same_tensors(_tensors(_torch_dcp_load(tmp_path / "back")), reference)
    assert_same_tensors(_tensors(_load_dcp(f"{url}/dcp", options)), reference)
    info = json.loads(results[5].stdout)
    assert info["format"] == "safetensors/1" and info["layout"] == "Hugging Face index"
    assert info["totals"]["tensors"] == len(reference) and len(info["files"]) > 2

    got = {}
    for f in info["files"]:
        if f["name"].endswith(".safetensors"):
            got.update(load(fs.cat_file(f"{url}/st/{f['name']}")))
    assert_same_tensors(got, reference)
    buf = io.BytesIO(fs.cat_file(f"{url}/m.pt"))
    assert_same_tensors(flatten(torch.load(buf, weights_only=True)), reference)


def test_torch_output_of_a_source_failing_midway_is_an_error_not_an_abort(tmp_path: Path) -> None:
    """A source that fails after the ``torch.save`` archive was started (a data file truncated after its
    first records) must raise our error and leave no output. Before, torch's zip writer, left holding the
    abandoned output stream, wrote its end records into the closed file when it was freed: C++ terminate,
    the whole process killed by SIGABRT (exit 134), also in a program that had caught the error."""
    import os

    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecWriter

    src = tmp_path / "ckpt"
    state = {f"t{i}": torch.full((64, 64), float(i)) for i in range(6)}
    dcp.save(state, storage_writer=FsspecWriter(src, thread_count=1), no_dist=True)
    (data,) = src.glob("*.distcp")
    os.truncate(data, data.stat().st_size * 6 // 10)  # the first tensors stay readable

    out = run_cli("convert", str(src), str(tmp_path / "out.pt"))
    assert out.rc == 1, out
    assert "CorruptCheckpointError" in out.stderr and "terminate" not in out.stderr, out
    assert len(out.stderr.strip().splitlines()) == 1, out
    for dst in ("api.pt", "api_dir"):  # in a program that catches the error and goes on
        script = (
            "import gc, dcp_storage as ds\n"
            "try:\n"
            f"    ds.convert({str(src)!r}, {str(tmp_path / dst)!r}, to='torch')\n"
            "except ds.errors.CorruptCheckpointError:\n"
            "    pass\n"
            "gc.collect()\n"
            "print('alive')\n"
        )
        proc = run_python(["-c", script], cli_env())
        assert proc.returncode == 0 and proc.stdout.strip() == "alive", proc
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the directory the run made is gone too


def test_sharded_torch_output_of_a_failing_source_leaves_no_shard_that_opens(tmp_path: Path) -> None:
    """Each ``pytorch_model-0000k-of-0000N.bin`` is a whole ``torch.save`` file that opens and verifies on
    its own (unlike safetensors shards, refused without their index), so the shards written before a
    source failed are removed. Before, they stayed: ``verify`` of one said OK, a load got part of the model."""
    import os

    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecWriter, convert
    from dcp_storage.errors import CorruptCheckpointError

    src = tmp_path / "ckpt"
    state = {f"t{i}": torch.full((512, 1024), float(i)) for i in range(8)}  # 2 MiB each
    dcp.save(state, storage_writer=FsspecWriter(src, thread_count=1), no_dist=True)
    (data,) = src.glob("*.distcp")
    os.truncate(data, data.stat().st_size * 7 // 10)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        convert(str(src), str(tmp_path / "out"), to="torch", max_shard_size="5MB")
    assert not (tmp_path / "out").exists()  # no shard, and not the directory the conversion created


def test_an_output_that_is_the_input_is_refused_with_our_error(tmp_path: Path, sources: dict[str, Path]) -> None:
    """Before, ``ValueError`` (outside the library's hierarchy, so ``except DcpStorageError`` missed it)."""
    from dcp_storage import DcpStorageError, convert, merge_fsdp_weights
    from dcp_storage.errors import TargetError

    (tmp_path / "link").symlink_to(sources["dcp"], target_is_directory=True)
    with pytest.raises(TargetError, match="is the input itself") as caught:
        convert(str(sources["dcp"]), str(tmp_path / "link"), to="dcp", overwrite=True)
    assert isinstance(caught.value, DcpStorageError)
    with pytest.raises(TargetError, match="lies inside"):
        merge_fsdp_weights(str(sources["dcp"]), str(tmp_path / "link" / "merged"), remove_checkpoint_dir=True)
    assert (sources["dcp"] / ".metadata").is_file()
