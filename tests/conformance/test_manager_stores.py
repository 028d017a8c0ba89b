"""``CheckpointManager`` on every store the conformance suite has (local, file://, memory://, s3, gs, az):
saves, keeps the last two, removes a torn folder on start, answers latest/all steps with and without
its index, and restores bit-exact."""

from __future__ import annotations

import warnings
from typing import Any

import torch

import dcp_storage as ds
from dcp_storage.manager.folders import step_name
from dcp_storage.manager.steps import INDEX_FILE
from dcp_storage.transports import open_transport
from dcp_storage_testing.conformance import Location

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(16, 8, generator=gen), "h": torch.randn(8, generator=gen).bfloat16(), "step": step}


def test_manager_on_every_store(location: Location) -> None:
    url, options = location.url, location.storage_options
    with ds.CheckpointManager(url, options, keep=ds.KeepPolicy(last=2), async_mode="thread", create_bucket=True) as mgr:
        assert mgr.latest_step() is None
        for step in (1, 2, 3):
            assert mgr.save(step, _state(step), metrics={"loss": 1.0 / step})
        mgr.wait()
        assert (mgr.latest_step(), mgr.all_steps()) == (3, [2, 3])
    transport, root = open_transport(url, options)
    try:
        transport.write_file(transport.join(root, step_name(4), "__0_0.distcp"), b"\0" * 32)  # a killed save
        transport.remove(transport.join(root, INDEX_FILE))
        with ds.CheckpointManager(url, options, keep=ds.KeepPolicy(last=2)) as mgr:
            assert mgr.last_cleanup.torn_removed == [4]
            assert (mgr.latest_step(), mgr.all_steps()) == (3, [2, 3])
            target = {"w": torch.zeros(16, 8), "h": torch.zeros(8, dtype=torch.bfloat16), "step": 0}
            assert mgr.restore(target) == 3
        expected = _state(3)
        assert torch.equal(target["w"], expected["w"]) and torch.equal(target["h"], expected["h"])
        assert target["step"] == 3
        names = transport.listdir(root)
        assert sorted(n for n in names if n.startswith("step-")) == [step_name(2), step_name(3)]
    finally:
        transport.close()
