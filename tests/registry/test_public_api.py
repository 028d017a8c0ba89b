"""The public surface is even: one first parameter across the storage classes, the configs the readers take
exported under one scheme, the pre-0.2 names gone (no deprecation shims in 0.x), and every registry kind
consumed by an API that takes a plugin's name (``strategies``: ``prefix_strategy=``/``read_strategy=``;
``planners``: ``load_full_state_dict(planner=...)``)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import dcp_storage
from dcp_storage import registry
from dcp_storage.fsdp.loading import _planner
from dcp_storage.strategies.read_strategy import ReadStrategies, choose_read_strategy

STORAGE_CLASSES = ("FsspecReader", "FsspecWriter", "SafetensorsReader", "SafetensorsWriter")
# the configs the storage classes take (keyword -> exported class, "module:Class" where the class is not
# one of ``dcp_storage``'s 25 names but lives with what it tunes)
CONFIGS = {
    "transport_config": "TransportConfig",
    "loader_config": (
        "dcp_storage.formats.dcp_native.item_loader:DcpLoaderConfig",
        "dcp_storage.formats.safetensors:SafetensorsLoaderConfig",
    ),
    "scan_config": "dcp_storage.formats.safetensors:SafetensorsScanConfig",
    "archive_config": "dcp_storage.formats.torch_save:TorchSaveArchiveConfig",
    "delivery_config": "dcp_storage.strategies:DeliveryConfig",
}


def _config(name: str) -> type:
    import importlib

    module, _, cls = name.rpartition(":")
    return getattr(importlib.import_module(module or "dcp_storage"), cls)


@pytest.mark.parametrize("name", STORAGE_CLASSES)
def test_storage_classes_take_path_then_storage_options(name: str) -> None:
    params = list(inspect.signature(getattr(dcp_storage, name)).parameters)
    assert params[:2] == ["path", "storage_options"], params


def test_the_torch_save_reader_keeps_torchs_signature() -> None:
    """A drop-in for torch's ``BroadcastingTorchSaveReader(checkpoint_id, coordinator_rank)``: same order."""
    params = list(inspect.signature(dcp_storage.BroadcastingTorchSaveReader).parameters)
    assert params[:3] == ["checkpoint_id", "coordinator_rank", "storage_options"], params


@pytest.mark.parametrize("name", ["SafetensorsReader", "SafetensorsWriter"])
def test_the_old_url_keyword_is_gone(tmp_path, name: str) -> None:
    """0.x dropped its deprecation shims (CHANGELOG): ``url=`` is an unknown keyword, not a warning."""
    with pytest.raises(TypeError, match="url"):
        getattr(dcp_storage, name)(url=str(tmp_path / "x"))


def test_the_readers_configs_are_exported_under_one_scheme() -> None:
    classes = [
        _config(name) for names in CONFIGS.values() for name in (names if isinstance(names, tuple) else (names,))
    ]
    for cls in classes:
        assert cls.__name__.endswith("Config"), cls
        assert dataclasses.is_dataclass(cls)
    # every *_config keyword a storage class takes is annotated with one of them
    for name in [*STORAGE_CLASSES, "BroadcastingTorchSaveReader"]:
        for param, p in inspect.signature(getattr(dcp_storage, name)).parameters.items():
            if param.endswith("_config"):
                assert any(cls.__name__ in str(p.annotation) for cls in classes), (name, param, p.annotation)


@pytest.mark.parametrize(
    ("module", "old"),
    [
        ("dcp_storage.formats.dcp_native.item_loader", "ItemLoaderConfig"),
        ("dcp_storage.formats.safetensors.loader", "LoaderConfig"),
        ("dcp_storage.formats.safetensors.loader", "ScanConfig"),
        ("dcp_storage.formats.torch_save.archive", "ArchiveConfig"),
        ("dcp_storage.formats.torch_save", "ArchiveConfig"),
        ("dcp_storage.plugin_api", "ItemLoaderConfig"),
        ("dcp_storage", "share_object"),
    ],
)
def test_old_names_are_gone(module: str, old: str) -> None:
    import importlib

    with pytest.raises(AttributeError, match=old):
        getattr(importlib.import_module(module), old)


def test_share_object_is_plugin_plumbing_not_a_top_level_name() -> None:
    assert "share_object" not in dcp_storage.__all__
    assert "share_object" in dcp_storage.plugin_api.__all__


class _Strategy(ReadStrategies.per_rank().__class__):  # a plugin's read strategy: any ReadStrategy
    pass


def test_a_read_strategy_plugin_is_chosen_by_name() -> None:
    with registry.registered("strategies", "test-read", _Strategy):
        assert isinstance(ReadStrategies.named("test-read"), _Strategy)
        assert isinstance(choose_read_strategy(None, "test-read", is_local=True), _Strategy)  # the storage option
    with registry.registered("strategies", "test-prefix", dcp_storage.strategies.HexPrefixStrategy):
        with pytest.raises(
            TypeError, match=r"must be a ReadStrategy, got HexPrefixStrategy \(registered as 'test-prefix'\)"
        ):
            ReadStrategies.named("test-prefix")
    with pytest.raises(ValueError, match="unknown read strategy 'nope'; choose one of per_rank, read_once, per_host"):
        ReadStrategies.named("nope")


def test_a_planner_plugin_is_chosen_by_name() -> None:
    with registry.registered("planners", "test-planner", DefaultLoadPlanner):
        assert isinstance(_planner("test-planner"), DefaultLoadPlanner)
    with registry.registered("planners", "test-not-a-planner", dict):
        with pytest.raises(TypeError, match=r"planner must be a torch LoadPlanner, got dict"):
            _planner("test-not-a-planner")
    with pytest.raises(registry.PluginNotFoundError, match="no planners plugin named 'nope'"):
        _planner("nope")
    given = DefaultLoadPlanner()
    assert _planner(given) is given and _planner(None) is None
