"""A non-tensor (``BYTE_IO``) item is bounded before its bytes are fetched (issue 20, turn 2).

Before: an 8 GiB item in a sparse data file made the loader allocate more than 5 GiB (``MemoryError`` under a
6 GiB address-space limit) instead of refusing the size first. Now ``FileTooLargeError`` names the item, its
size and ``DCP_STORAGE_MAX_BYTE_ITEM_BYTES``, at a cost of a few MiB, and a raised setting lets a genuine
large item through.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import textwrap
from dataclasses import replace
from pathlib import Path

import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parents[3]
GIANT = 8 << 30


def _giant_item_checkpoint(root: Path) -> Path:
    """torch's writer; then the item ``step`` (the file's only one) claims 8 GiB of a sparse data file."""
    dcp.save({"step": "x" * 100}, checkpoint_id=str(root), no_dist=True)
    md_file = root / ".metadata"
    md = pickle.loads(md_file.read_bytes())
    (index,) = [i for i in md.storage_data if i.fqn == "step"]
    info = md.storage_data[index]
    md.storage_data[index] = replace(info, length=GIANT)
    md_file.write_bytes(pickle.dumps(md))
    data = root / info.relative_path
    os.truncate(data, max(data.stat().st_size, info.offset + GIANT))
    return root


_LOAD = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
    import torch, torch.distributed.checkpoint as dcp
    from dcp_storage import open_reader
    state = {"step": ""}
    try:
        dcp.load(state, storage_reader=open_reader(sys.argv[1]), no_dist=True)
    except BaseException as exc:
        failures = getattr(exc, "failures", None) or {}
        inner = next(iter(failures.values()), exc)
        inner = inner[0] if isinstance(inner, tuple) else inner
        print(type(inner).__name__, inner)
        sys.exit(3)
    print("loaded", state["step"])
    """
)


def _run(ckpt: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -c _LOAD CKPT`` in a process of its own (a fork of the CLI tests' zygote: torch imported once)."""
    from tests.cli._helpers import run_python

    return run_python(["-c", _LOAD, str(ckpt)], {**os.environ, **env}, timeout=120)


def test_an_8_gib_byte_item_in_a_sparse_file_is_refused_before_any_allocation(tmp_path: Path) -> None:
    ckpt = _giant_item_checkpoint(tmp_path / "ckpt")
    got = _run(ckpt)
    assert got.returncode == 3, got.stdout + got.stderr
    out = got.stdout
    assert out.startswith("FileTooLargeError"), out + got.stderr
    assert "'step'" in out and str(GIANT) in out and "DCP_STORAGE_MAX_BYTE_ITEM_BYTES" in out, out


def test_a_raised_setting_reaches_the_item_and_a_bad_one_is_named(tmp_path: Path) -> None:
    from dcp_storage.formats.paths import BYTE_ITEM

    ckpt = tmp_path / "ok"
    dcp.save({"step": 7}, checkpoint_id=str(ckpt), no_dist=True)
    assert _run(ckpt, DCP_STORAGE_MAX_BYTE_ITEM_BYTES="16").stdout.startswith("FileTooLargeError")
    loaded = _run(ckpt, DCP_STORAGE_MAX_BYTE_ITEM_BYTES="100000")
    assert "loaded 7" in loaded.stdout, loaded.stdout + loaded.stderr
    assert BYTE_ITEM.default == 1 << 30
