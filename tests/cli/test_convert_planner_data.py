"""``planner_data`` paths from ``.metadata`` checked as one tree before ``convert`` builds containers (issue 20).

Before: a ``.metadata`` whose ``planner_data`` names list index ``2**40`` sent ``convert`` (and
``dcp_to_torch_save``) into an unbounded allocation (torch's ``set_element`` appends ``None`` up to the
index); a negative index, a list index mixed with a key, or a tensor under another key raised a bare
``IndexError``/``TypeError``. Now each is a ``CorruptCheckpointError`` naming the key, before any output.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ._helpers import cli_env, run_python

BIG = 2**40


def _checkpoint(root: Path, state: dict[str, Any], paths: dict[str, tuple[Any, ...]]) -> Path:
    """A DCP checkpoint (torch's own writer) of ``state`` whose ``planner_data`` is replaced by ``paths``."""
    dcp.save(state, checkpoint_id=str(root), no_dist=True)
    md_file = root / ".metadata"
    md = pickle.loads(md_file.read_bytes())
    md.planner_data = paths
    md_file.write_bytes(pickle.dumps(md))
    return root


# ``python -m dcp_storage.cli ARGV`` with the address space limited to 4 GiB first (a process of its own: a
# fork of the CLI tests' zygote, see _helpers.run_python).
_CLI_IN_4_GIB = (
    "import resource, runpy, sys\n"
    "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
    "sys.argv = ['dcp-storage', *sys.argv[1:]]\n"
    "runpy.run_module('dcp_storage.cli', run_name='__main__', alter_sys=True)\n"
)


def test_a_list_index_of_2_to_the_40_is_refused_before_any_allocation(tmp_path: Path) -> None:
    ckpt = _checkpoint(
        tmp_path / "ckpt",
        {"a": {str(BIG): torch.ones(3)}, "b": torch.zeros(2)},
        {f"a.{BIG}": ("a", BIG), "b": ("b",)},
    )
    assert (ckpt / ".metadata").stat().st_size < 2000
    for to in ("torch", "dcp"):
        argv = ["convert", str(ckpt), str(tmp_path / f"out.{to}"), "--to", to]
        proc = run_python(["-c", _CLI_IN_4_GIB, *argv], cli_env())
        assert proc.returncode == 1, proc.stderr
        assert "CorruptCheckpointError" in proc.stderr and f"a.{BIG}" in proc.stderr, proc.stderr
        assert "list index" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not (tmp_path / f"out.{to}").exists()


@pytest.mark.parametrize(
    ("state", "paths", "named", "why"),
    [
        ({"a": {"-1": torch.ones(2)}}, {"a.-1": ("a", -1)}, "a.-1", "negative list index"),
        (
            {"a": {"0": torch.ones(2), "x": torch.ones(2)}},
            {"a.0": ("a", 0), "a.x": ("a", "x")},
            "a.x",
            "both a list and a dict",
        ),
        (
            {"a": torch.ones(2), "a.b": torch.ones(2)},
            {"a": ("a",), "a.b": ("a", "b")},
            "a.b",
            "itself a stored value",
        ),
        ({"0": {"w": torch.ones(2)}}, {"0.w": (0, "w")}, "0.w", "top level holds names"),
    ],
)
def test_conflicting_paths_are_refused_naming_the_key(
    tmp_path: Path, state: dict[str, Any], paths: dict[str, tuple[Any, ...]], named: str, why: str
) -> None:
    from dcp_storage import convert
    from dcp_storage.conversion import dcp_to_torch_save
    from dcp_storage.errors import CorruptCheckpointError

    ckpt = _checkpoint(tmp_path / "ckpt", state, paths)
    with pytest.raises(CorruptCheckpointError, match=why) as caught:
        dcp_to_torch_save(ckpt, tmp_path / "out.pt")
    assert repr(named) in str(caught.value) and "planner_data" in str(caught.value)
    with pytest.raises(CorruptCheckpointError, match=why):
        convert(ckpt, tmp_path / "out", to="dcp")
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "out").exists()


def test_lists_with_holes_from_dropped_empty_containers_still_convert(tmp_path: Path) -> None:
    """What must keep working: torch drops an empty container from a list, leaving a hole at its index."""
    from dcp_storage.conversion import dcp_to_torch_save

    state = {"opt": {"groups": [{}, {"lr": torch.tensor(0.1)}, [torch.ones(2), torch.zeros(3)]]}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["opt"]["groups"][0] is None and torch.equal(got["opt"]["groups"][2][1], torch.zeros(3))
