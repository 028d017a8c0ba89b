"""Hostile pickles must not change the process: no allow-listed global modified, memory bounded.

A ``.metadata`` or ``data.pkl`` built only from allow-listed globals can still ``BUILD`` one of them (a
class's ``__qualname__`` or ``__bases__``, a function's ``__defaults__``, an enum member's ``_value_``): the
load "succeeds" and every later ``dcp.save`` or memory-format lookup in the process is broken. Each case
here is decoded by every unpickler that reads such files (``load_metadata``, the DCP record parser, the
``torch.save`` ``data.pkl`` decoder, ``open_reader`` + ``dcp.load``) between two snapshots of every
allow-listed global (:mod:`.process_state`); the decode must raise our error and the snapshots must be
equal. A subprocess shows that each attack does change the process when only the allow-list guards it.
Size bombs run in a subprocess whose peak RSS is measured.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_storage.errors import DcpStorageError

from . import payloads as P
from .process_state import changed, snapshot

ROOT = Path(__file__).resolve().parents[2]


def _metadata_pickle() -> bytes:
    from tests.fuzz.test_unpicklers import _valid_metadata

    return pickle.dumps(_valid_metadata(), protocol=2)


def _record_pickle() -> bytes:
    from tests.hostile.corpus import _data_pkl, _FakeStorage, _FakeTensor

    return _data_pkl(_FakeTensor(_FakeStorage(torch.FloatStorage, 128), 0, (16, 8), (8, 1)))


def _decoders() -> dict[str, Callable[[bytes], Any]]:
    from dcp_storage.formats.dcp_native.native import load_metadata
    from dcp_storage.formats.dcp_native.torch_record import UnsupportedRecord, load_tensor_record, parse_tensor_record
    from dcp_storage.formats.torch_save.pickle_tree import decode_data_pkl
    from tests.hostile.corpus import _handmade_torch_zip

    def record(data: bytes) -> Any:
        blob, where = _handmade_torch_zip(data, b"\0" * 512), "ckpt/__0_0.distcp [0, 900)"
        try:
            return parse_tensor_record(blob, len(blob), where)
        except UnsupportedRecord:  # what the item loader does next: torch.load(weights_only=True)
            return load_tensor_record(blob, where)

    return {
        "metadata": lambda data: load_metadata(data, "ckpt/.metadata"),
        "record": record,
        "data_pkl": lambda data: decode_data_pkl(data, "ckpt/model.pt (data.pkl)"),
    }


def _cases() -> list[tuple[str, str, bytes]]:
    """``(name, decoder, bytes)`` for every hostile stream."""
    md, rec = _metadata_pickle(), _record_pickle()
    cases = [(f"metadata/{n}", "metadata", P.splice(p, md)) for n, p in P.STATE_ATTACKS.items()]
    cases += [(f"metadata/{n}", "metadata", P.splice(P.as_prefix(w), md)) for n, w in P.FRESH_ATTACKS.items()]
    for decoder in ("record", "data_pkl"):
        cases += [(f"{decoder}/{n}", decoder, P.splice(p, rec)) for n, p in P.RECORD_STATE_ATTACKS.items()]
        cases += [(f"{decoder}/{n}", decoder, P.splice(p, rec)) for n, p in P.STATE_ATTACKS.items()]
    for decoder in ("metadata", "record", "data_pkl"):
        cases += [(f"{decoder}/bomb-{op}", decoder, P.size_bomb(op)) for op in P.BOMBS]
    cases.append(("data_pkl/deep-nesting", "data_pkl", P.deep_nesting()))
    return cases


CASES = _cases()


def test_the_snapshot_sees_every_allow_listed_global() -> None:
    from .process_state import _objects

    objects = _objects()
    kinds = {type(o).__name__ for o in objects}
    assert len(objects) > 80 and {"type", "function", "_MEM_FORMAT_ENCODING", "dtype"} <= kinds, kinds
    assert snapshot() == snapshot()  # stable when nothing happens


@pytest.mark.parametrize(("name", "decoder", "data"), CASES, ids=[c[0] for c in CASES])
def test_hostile_pickle_changes_nothing(name: str, decoder: str, data: bytes) -> None:
    before = snapshot()
    try:
        with pytest.raises(DcpStorageError) as info:
            _decoders()[decoder](data)
    finally:
        diff = changed(before, snapshot())
    assert not diff, f"{name} changed the process: {diff[:3]}"
    assert "ckpt/" in str(info.value), info.value


def test_through_open_reader_and_dcp_load(tmp_path: Path) -> None:
    """The metadata attacks through the public entry points, one snapshot around them all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_storage import FsspecWriter, open_reader
    from dcp_storage.inspection import describe, verify

    good = tmp_path / "good"
    dcp.save({"w": torch.ones(4), "step": 3}, storage_writer=FsspecWriter(str(good)), no_dist=True)
    valid = pickle.dumps(pickle.loads((good / ".metadata").read_bytes()), protocol=2)
    before = snapshot()
    for name, prefix in {**P.STATE_ATTACKS, **{n: P.as_prefix(w) for n, w in P.FRESH_ATTACKS.items()}}.items():
        (good / ".metadata").write_bytes(P.splice(prefix, valid))
        with pytest.raises((CheckpointException, AssertionError)):  # dcp.load wraps read_metadata's error
            dcp.load({"w": torch.zeros(4), "step": 0}, storage_reader=open_reader(str(good)), no_dist=True)
        with pytest.raises(DcpStorageError, match=r"\.metadata"):
            describe(str(good))
        assert not verify(str(good), deep=True).ok, name
    diff = changed(before, snapshot())
    assert not diff, diff[:3]


_LIVE = """
import json, pickle, sys
from tests.hostile import payloads as P
from tests.hostile.process_state import changed, snapshot, unguarded_loads
from tests.hostile.test_process_state import _metadata_pickle, _record_pickle
md, rec = _metadata_pickle(), _record_pickle()
out = {}
for table, attacks, valid in (("metadata", P.STATE_ATTACKS, md), ("record", P.RECORD_STATE_ATTACKS, rec)):
    for name, prefix in attacks.items():
        before = snapshot()
        try:
            unguarded_loads(P.splice(prefix, valid), table)
        except Exception:  # a record pickle stops at its persistent id: the prefix has run by then
            pass
        out[name] = len(changed(before, snapshot()))
for name, whole in P.FRESH_ATTACKS.items():
    obj = unguarded_loads(whole, "metadata")
    out[name] = [type(obj).__name__, sorted(k for k in vars(obj) if k.startswith("__"))]
print(json.dumps(out))
"""


def test_state_attacks_are_live_without_the_guard() -> None:
    """Each attack changes the process (or the instance) when only the allow-list stands in its way."""
    from tests.cli._helpers import run_python  # a process of its own: a fork of the zygote (torch imported)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = run_python(["-c", _LIVE], env, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name in [*P.STATE_ATTACKS, *P.RECORD_STATE_ATTACKS]:
        assert isinstance(out[name], int) and out[name] > 0, (name, out[name])
    assert out["fresh-instance-class-swap"][0] == "Metadata"  # a StorageMeta turned into a Metadata
    assert out["fresh-instance-dunder"] == ["StorageMeta", ["__reduce_ex__"]]
    assert out["fresh-instance-dict-from-call"] == ["StorageMeta", ["__eq__"]]
    assert (
        out["fresh-instance-dunder-text-key"]
        == out["fresh-instance-dunder-binstring-key"]
        == ["StorageMeta", ["__reduce_ex__"]]
    )


_BOMBS = """
import json, resource, sys
from tests.hostile import payloads as P
from tests.hostile.test_process_state import _decoders
decoders = _decoders()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
errors = {}
for op in P.BOMBS:
    for name, decode in decoders.items():
        try:
            decode(P.size_bomb(op))
            errors[f"{name}/{op}"] = "accepted"
        except Exception as exc:
            errors[f"{name}/{op}"] = type(exc).__name__
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grown_kib": peak - base, "errors": errors}))
"""


def test_size_bombs_are_refused_before_any_allocation() -> None:
    """Every bomb claims 2-3 GiB (the memo bomb 16 GiB) from a few bytes; the process grows by < 64 MiB."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = textwrap.dedent(_BOMBS)
    res = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    ours = {"CorruptCheckpointError", "UnsafeCheckpointError"}
    assert all(kind in ours for kind in out["errors"].values()), out["errors"]
    assert out["grown_kib"] < 64 * 1024, out
