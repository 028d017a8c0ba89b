"""The collector pause around metadata decoding and ``describe``: off inside, restored after, even on error."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from dcp_storage.runtime import gc_paused


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_restored_after_an_error() -> None:
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the inner one must not turn it back on
            pass
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled() -> None:
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_describe_and_metadata_decode_pause_and_restore(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_storage import describe
    from dcp_storage.formats.dcp_native import column_checks, metadata_checks
    from dcp_storage.formats.dcp_native.native import available

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    paths = [("off", "check_metadata", metadata_checks)]  # the general path: guarded unpickler, object checks
    if available():  # the native decoder's columns, checked on arrays
        paths.append(("native", "columns_sound", column_checks))
    for decoder, checks, module in paths:
        monkeypatch.setenv("DCP_STORAGE_METADATA_DECODER", decoder)
        seen: list[bool] = []
        check = getattr(module, checks)

        def spy(*args, check=check, seen=seen):  # the checks of a decoded .metadata run with the collector off
            seen.append(gc.isenabled())
            return check(*args)

        monkeypatch.setattr(f"dcp_storage.formats.dcp_native.native.{checks}", spy)
        info = describe(tmp_path)
        assert [t.key for t in info.tensors] == ["w"]
        assert seen == [False], decoder
        assert gc.isenabled()


def test_overlapping_pauses_in_two_threads_keep_it_off_until_the_last_ends() -> None:
    """Thread A pauses, thread B pauses, A ends: B still decodes, so the collector must stay off."""
    import threading

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    during_b: list[bool] = []

    def first() -> None:
        with gc_paused():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second() -> None:
        a_in.wait(10)
        with gc_paused():
            b_in.set()
            a_out.wait(10)
            during_b.append(gc.isenabled())

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert during_b == [False]
    assert gc.isenabled()


def test_a_child_forked_inside_a_pause_gets_its_collector_back() -> None:
    """The pause belongs to the parent's thread, which is not in the child: the child's collector is on, and
    its own later pauses end as they should."""
    import os

    with gc_paused():
        assert not gc.isenabled()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's outcome is its exit status
            ok = gc.isenabled()
            with gc_paused():
                ok = ok and not gc.isenabled()
            os._exit(0 if ok and gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
