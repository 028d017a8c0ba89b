"""``dcp-storage merge``: accelerate's FSDP layout saved by 2 real ranks, merged like merge_fsdp_weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.models import reference_state_dict

from . import _rank_fns
from ._helpers import assert_same_tensors, run_batch


@pytest.fixture(scope="module")
def fsdp_output_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("accelerate_output")
    run_ranks(_rank_fns.save_accelerate_fsdp, 2, str(out))
    return out


def test_merge_like_accelerate(tmp_path: Path, fsdp_output_dir: Path) -> None:
    from safetensors.torch import load_file

    ckpt = fsdp_output_dir / "pytorch_model_fsdp_0"
    want = reference_state_dict(_rank_fns.SEED, **_rank_fns.SHAPE)  # keys without the "model." wrapper
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(ckpt, copy)
    results = run_batch(
        [
            ["merge", str(ckpt), str(tmp_path / "st")],
            [
                "merge",
                str(copy),
                str(tmp_path / "bin"),
                "--no-safe-serialization",
                "--max-shard-size",
                "40KB",
                "--remove-checkpoint-dir",
                "--json",
            ],
            ["merge", str(fsdp_output_dir), str(tmp_path / "wrong")],
        ]
    )
    st, bins, wrong = results
    assert st.rc == 0, st
    assert "merged" in st.stdout and "verified" in st.stdout
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == ["model.safetensors"]
    assert_same_tensors(load_file(str(tmp_path / "st" / "model.safetensors")), want)

    assert bins.rc == 0, bins
    summary = json.loads(bins.stdout)
    assert summary["output"].endswith("pytorch_model.bin.index.json") and summary["removed_checkpoint_dir"]
    index = json.loads((tmp_path / "bin" / "pytorch_model.bin.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"pytorch_model-00001-of-{len(shards):05d}.bin"
    got: dict[str, torch.Tensor] = {}
    for name in shards:
        got.update(torch.load(tmp_path / "bin" / name, weights_only=True))
    assert_same_tensors(got, want)
    assert not copy.exists()  # removed only after the output was verified
    assert ckpt.exists()

    assert wrong.rc == 1 and "pytorch_model_fsdp_0" in wrong.stderr and "no .metadata" in wrong.stderr


def test_merge_keeps_input_when_output_fails_verification(tmp_path: Path, fsdp_output_dir: Path, monkeypatch) -> None:
    import shutil

    from dcp_storage import merge_fsdp_weights
    from dcp_storage.conversion import merge as merge_mod
    from dcp_storage.errors import CorruptCheckpointError

    copy = tmp_path / "copy"
    shutil.copytree(fsdp_output_dir / "pytorch_model_fsdp_0", copy)
    real = merge_mod._run

    def truncating_run(*args, **kwargs):
        result = real(*args, **kwargs)
        target = Path(result.output)
        target.write_bytes(target.read_bytes()[:-10])  # the file is damaged after it was written
        return result

    monkeypatch.setattr(merge_mod, "_run", truncating_run)
    with pytest.raises(CorruptCheckpointError, match="failed verification"):
        merge_fsdp_weights(copy, tmp_path / "out", remove_checkpoint_dir=True)
    assert (copy / ".metadata").exists()
