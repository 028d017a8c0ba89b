"""Any ``Future`` a reader's ``read_data`` returns works where the core waits on it, or a clear error names
the type to return; ``plugin_api.as_torch_future`` gives ``dcp.load`` the torch future it waits on."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.futures

import dcp_storage as ds
from dcp_storage.plugin_api import FutureTypeError, as_torch_future
from dcp_storage.runtime import wait_for


def test_wait_for_either_future_type() -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert wait_for(pool.submit(lambda: 3), object()) == 3
    done: torch.futures.Future[int] = torch.futures.Future()
    done.set_result(4)
    assert wait_for(done, object()) == 4


def test_anything_else_names_the_reader_and_the_type_to_return() -> None:
    class MyReader:
        pass

    with pytest.raises(FutureTypeError, match=r"MyReader.read_data returned a NoneType: return a torch.futures.Future"):
        wait_for(None, MyReader())


def test_as_torch_future_carries_result_and_error() -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert as_torch_future(pool.submit(lambda: 5)).wait() == 5
        failing = as_torch_future(pool.submit(lambda: 1 / 0))
        with pytest.raises(ZeroDivisionError):
            failing.wait()


def test_as_torch_future_is_completed_whatever_the_read_ended_with() -> None:
    """Before: a read cancelled before it ran, or ending in an error that is not an ``Exception``, left the
    torch future pending (the callback's own error was logged and dropped), and ``dcp.load`` waited on it
    forever. Each is checked right after the inner future ended: no waiting on a possibly endless wait."""
    from torch.distributed.checkpoint.api import CheckpointException

    pool = concurrent.futures.ThreadPoolExecutor(1)
    release = threading.Event()
    pool.submit(release.wait)
    queued = as_torch_future(pool.submit(lambda: 1))
    pool.shutdown(wait=False, cancel_futures=True)  # a plugin's pool going away with reads still queued
    release.set()
    assert queued.done()
    with pytest.raises(concurrent.futures.CancelledError, match="cancelled before it ran"):
        queued.wait()

    def exits() -> None:
        raise SystemExit(3)

    def checkpoint_error() -> None:
        raise CheckpointException("load", {0: (ValueError("inner"), None)})

    with concurrent.futures.ThreadPoolExecutor(1) as runner:
        for job, name in ((exits, "SystemExit"), (checkpoint_error, "CheckpointException")):
            inner = runner.submit(job)
            out = as_torch_future(inner)
            concurrent.futures.wait([inner])
            assert out.done(), name
            with pytest.raises(RuntimeError, match=f"{name} in the read") as info:
                out.wait()
            assert type(info.value.__cause__).__name__ == name


class ThreadedReader(ds.FsspecReader):
    """A reader whose read_data runs on an executor, returning its future through as_torch_future."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            return as_torch_future(pool.submit(lambda: super(ThreadedReader, self).read_data(plan, planner).wait()))
        finally:
            pool.shutdown(wait=False)


def test_dcp_load_waits_on_a_converted_future(tmp_path: Path) -> None:
    ds.save({"w": torch.arange(6.0)}, str(tmp_path))
    state = {"w": torch.zeros(6)}
    dcp.load(state, storage_reader=ThreadedReader(str(tmp_path)), no_dist=True)
    assert torch.equal(state["w"], torch.arange(6.0))
