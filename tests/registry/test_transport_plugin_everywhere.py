"""A transport plugin chosen with ``transport=NAME`` serves every command and every API, and no path bypasses it.

``CountingTransport`` is a third-party transport as a plugin would write one: it keeps the
:class:`~dcp_storage.transports.Transport` protocol by wrapping the built-in fsspec transport and counts
every call. The ``probe`` fixture registers it for the test and watches every fsspec transport built: one
built anywhere but inside the plugin means some path opened a transport without the factory (the bug this
guards against: ``verify``, ``describe``, ``merge`` and ``convert`` used to ignore ``-o transport=...``).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from dcp_storage import (
    BroadcastingTorchSaveReader,
    FsspecReader,
    FsspecWriter,
    SafetensorsReader,
    SafetensorsWriter,
    convert,
    describe,
    merge_fsdp_weights,
    open_reader,
    open_writer,
    registry,
    verify,
)
from dcp_storage.cli import main as cli_main
from dcp_storage.fsdp import load_full_state_dict
from dcp_storage.transports import FsspecTransport, LocalFileAccess, Transport
from dcp_storage_testing.models import build_model, reference_state_dict

NAME = "counting"
SHAPE = {"vocab": 16, "dim": 8, "hidden": 12, "layers": 1}


class Probe:
    """What the plugin was asked (method -> calls, URLs opened) and fsspec transports built behind its back."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.opened: list[str] = []
        self.bypasses: list[str] = []
        self._inside = threading.local()

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        self._inside.active = True
        try:
            yield
        finally:
            self._inside.active = False

    def built(self) -> None:
        if not getattr(self._inside, "active", False):
            import traceback

            self.bypasses.append("".join(traceback.format_stack(limit=8)))

    def reset(self) -> None:
        self.calls.clear()
        self.opened.clear()
        self.bypasses.clear()


PROBE = Probe()
_DELEGATED = (
    "url", "strip_url", "join", "exists", "size", "listdir", "makedirs", "remove", "remove_tree", "read_file",
    "read_range", "read_ranges", "write_file", "open_atomic", "create_new", "executor", "close", "local_files",
)  # fmt: skip


class CountingTransport:
    """The plugin: every :class:`Transport` method counted, then delegated to a wrapped fsspec transport."""

    def __init__(self, inner: FsspecTransport) -> None:
        self._inner = inner
        self.is_local = inner.is_local
        self.config = inner.config
        self.counters = inner.counters

    @classmethod
    def from_url(cls, url: Any, storage_options: dict[str, Any] | None = None, config: Any = None) -> Any:
        PROBE.calls["from_url"] += 1
        PROBE.opened.append(str(url))
        with PROBE.building():
            inner, path = FsspecTransport.from_url(url, storage_options, config)
        return cls(inner), path

    def reconfigured(self, config: Any) -> CountingTransport:
        PROBE.calls["reconfigured"] += 1
        with PROBE.building():
            return CountingTransport(self._inner.reconfigured(config))

    def __enter__(self) -> CountingTransport:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _counted(name: str) -> Callable[..., Any]:
    def method(self: CountingTransport, *args: Any, **kwargs: Any) -> Any:
        PROBE.calls[name] += 1
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in _DELEGATED:
    setattr(CountingTransport, _name, _counted(_name))


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[Probe]:
    original = FsspecTransport.__init__

    def watched(self: FsspecTransport, *args: Any, **kwargs: Any) -> None:
        PROBE.built()
        original(self, *args, **kwargs)

    monkeypatch.setattr(FsspecTransport, "__init__", watched)
    PROBE.reset()
    with registry.registered("transports", NAME, CountingTransport):
        yield PROBE
    PROBE.reset()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One checkpoint per format (written without the plugin), and an accelerate FSDP directory."""
    root = tmp_path_factory.mktemp("plugin_everywhere")
    ref = reference_state_dict(0, **SHAPE)
    paths = {
        "dcp": root / "dcp", "safetensors": root / "model.safetensors", "torch": root / "model.pt",
        "fsdp": root / "out" / "pytorch_model_fsdp_0",
    }  # fmt: skip
    dcp.save(ref, storage_writer=FsspecWriter(paths["dcp"]), no_dist=True)
    save_file(ref, paths["safetensors"])
    torch.save(ref, paths["torch"])
    dcp.save({"model": ref}, storage_writer=FsspecWriter(paths["fsdp"]), no_dist=True)
    return paths


def _opts() -> dict[str, Any]:
    return {"transport": NAME}


def _load(reader: Any) -> None:
    out = {k: torch.empty_like(v) for k, v in reference_state_dict(0, **SHAPE).items()}
    dcp.load(out, storage_reader=reader, no_dist=True)
    for key, value in reference_state_dict(0, **SHAPE).items():
        assert torch.equal(out[key], value), key


def _memory_url() -> str:
    """A fresh ``memory://`` target: there the writers send every byte through the transport (on a local
    disk, a transport that says ``is_local`` lets the safetensors writer ``pwrite`` its files directly)."""
    return f"memory://plugin-everywhere-{uuid.uuid4().hex}/w"


def _cli(*argv: str) -> None:
    assert cli_main([*argv]) == 0


ENTRY_POINTS: dict[str, Callable[[dict[str, Path], Path], None]] = {
    "FsspecReader": lambda c, _t: _load(FsspecReader(c["dcp"], storage_options=_opts())),
    "SafetensorsReader": lambda c, _t: _load(SafetensorsReader(c["safetensors"], storage_options=_opts())),
    "BroadcastingTorchSaveReader": lambda c, _t: _load(
        BroadcastingTorchSaveReader(checkpoint_id=c["torch"], storage_options=_opts())
    ),
    "open_reader-dcp": lambda c, _t: _load(open_reader(c["dcp"], storage_options=_opts())),
    "open_reader-safetensors": lambda c, _t: _load(open_reader(c["safetensors"], storage_options=_opts())),
    "open_reader-torch": lambda c, _t: _load(open_reader(c["torch"], storage_options=_opts())),
    "FsspecWriter": lambda _c, t: dcp.save(
        reference_state_dict(0, **SHAPE),
        storage_writer=FsspecWriter(_memory_url(), storage_options=_opts()),
        no_dist=True,
    ),
    "SafetensorsWriter": lambda _c, t: dcp.save(
        reference_state_dict(0, **SHAPE),
        storage_writer=SafetensorsWriter(_memory_url(), storage_options=_opts()),
        no_dist=True,
    ),
    "open_writer": lambda _c, t: dcp.save(
        reference_state_dict(0, **SHAPE),
        storage_writer=open_writer(_memory_url(), storage_options=_opts()),
        no_dist=True,
    ),
    "describe-dcp": lambda c, _t: describe(c["dcp"], storage_options=_opts()),
    "describe-safetensors": lambda c, _t: describe(c["safetensors"], storage_options=_opts()),
    "describe-torch": lambda c, _t: describe(c["torch"], storage_options=_opts()),
    "verify-dcp": lambda c, _t: verify(c["dcp"], storage_options=_opts(), deep=True),
    "verify-safetensors": lambda c, _t: verify(c["safetensors"], storage_options=_opts(), deep=True),
    "verify-torch": lambda c, _t: verify(c["torch"], storage_options=_opts(), deep=True),
    "convert": lambda c, t: convert(c["dcp"], t / "out.safetensors", storage_options=_opts()),
    "convert-torch-to-dcp": lambda c, t: convert(c["torch"], t / "out", to="dcp", storage_options=_opts()),
    "merge_fsdp_weights": lambda c, t: merge_fsdp_weights(c["fsdp"], t / "merged", storage_options=_opts()),
    "load_full_state_dict": lambda c, _t: load_full_state_dict(
        build_model(1, **SHAPE), str(c["safetensors"]), storage_options=_opts()
    ),
    "cli-inspect": lambda c, _t: _cli("inspect", str(c["dcp"]), "-o", f"transport={NAME}"),
    "cli-verify": lambda c, _t: _cli("verify", "--deep", str(c["safetensors"]), "-o", f"transport={NAME}"),
    "cli-convert": lambda c, t: _cli("convert", str(c["torch"]), str(t / "out.safetensors"), "-o", f"transport={NAME}"),
    "cli-merge": lambda c, t: _cli("merge", str(c["fsdp"]), str(t / "merged"), "-o", f"transport={NAME}"),
}
# Entry points with a source and a target: both must be opened through the plugin.
TWO_SIDED = {"convert", "convert-torch-to-dcp", "merge_fsdp_weights", "cli-convert", "cli-merge"}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_goes_through_the_plugin(
    entry: str, probe: Probe, ckpts: dict[str, Path], tmp_path: Path
) -> None:
    ENTRY_POINTS[entry](ckpts, tmp_path)
    assert not probe.bypasses, f"{entry}: a transport was built without the factory:\n" + "\n".join(probe.bypasses)
    assert probe.calls["from_url"] >= 1, entry
    moved = probe.calls["read_file"] + probe.calls["read_range"] + probe.calls["read_ranges"]
    moved += probe.calls["write_file"] + probe.calls["open_atomic"]
    assert moved >= 1, f"{entry}: no bytes moved through the plugin ({dict(probe.calls)})"
    if entry in TWO_SIDED:
        assert any(str(tmp_path) in url for url in probe.opened), f"{entry}: target not opened by the plugin"
        assert any(str(tmp_path) not in url for url in probe.opened), f"{entry}: source not opened by the plugin"


def test_the_plugin_keeps_the_protocol() -> None:
    transport, _ = CountingTransport.from_url("memory://protocol-check")
    try:
        assert isinstance(transport, Transport) and isinstance(transport, LocalFileAccess)
    finally:
        transport.close()


def test_the_probe_sees_a_bypass(probe: Probe, tmp_path: Path) -> None:
    """The attack the test above defends against: a transport opened by hand is caught."""
    transport, _ = FsspecTransport.from_url(str(tmp_path))
    transport.close()
    assert len(probe.bypasses) == 1
