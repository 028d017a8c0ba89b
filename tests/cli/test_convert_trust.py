"""``dcp-storage convert --trust``: a ``torch.save`` file holding an ``argparse.Namespace``, in a real subprocess."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ._helpers import run_cli


def test_convert_refuses_then_trusts(tmp_path: Path) -> None:
    src = str(tmp_path / "train.pt")
    torch.save({"w": torch.ones(3), "args": argparse.Namespace(lr=0.1)}, src)
    refused = run_cli("convert", src, str(tmp_path / "refused"), "--to", "dcp")
    assert refused.rc != 0, refused
    assert "argparse.Namespace" in refused.stderr and src in refused.stderr, refused
    assert "add_safe_globals" in refused.stderr and "--trust" in refused.stderr, refused
    assert not (tmp_path / "refused" / ".metadata").exists()
    done = run_cli("convert", src, str(tmp_path / "out.pt"), "--to", "torch", "--trust")
    assert done.rc == 0, done
    out = torch.load(str(tmp_path / "out.pt"), weights_only=False)
    assert out["args"] == argparse.Namespace(lr=0.1) and torch.equal(out["w"], torch.ones(3))
