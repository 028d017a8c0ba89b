"""``dcp_storage.fsdp`` without a process group: plain models, wrappers that need none, argument checks."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from torch import nn

import dcp_storage
from dcp_storage.fsdp import (
    FullStateDictKeysError,
    UnknownModuleError,
    get_fsdp_parent,
    is_fsdp_model,
    load_full_state_dict,
    maybe_get_wrapped,
    set_wrapped_model,
)
from dcp_storage.strategies import DeliveryStats
from dcp_storage_testing.models import build_model, reference_state_dict

SHAPE = {"vocab": 16, "dim": 8, "hidden": 12, "layers": 1}


def test_exported() -> None:
    assert dcp_storage.fsdp.load_full_state_dict is load_full_state_dict
    assert "fsdp" in dir(dcp_storage)  # a submodule, not one of the 25 names


def test_plain_models() -> None:
    # (torch.compile wrappers are checked on one rank of test_distributed: importing dynamo costs seconds)
    model = build_model(0, **SHAPE)
    assert not is_fsdp_model(model)
    assert maybe_get_wrapped(model) is model
    assert get_fsdp_parent("blocks.0.mlp_up", model) is None
    assert get_fsdp_parent("_fsdp_wrapped_module.blocks.0", model) is None  # wrapper segments are optional
    with pytest.raises(UnknownModuleError, match=r"'blocks\.0\.nope'.*no child 'nope'") as info:
        get_fsdp_parent("blocks.0.nope", model)
    assert isinstance(info.value, LookupError)
    with pytest.raises(TypeError):
        is_fsdp_model("not a module")  # type: ignore[arg-type]


def test_set_wrapped_model() -> None:
    state = types.SimpleNamespace(model=None, step=3)
    model = build_model(0, **SHAPE)
    set_wrapped_model(state, model)
    assert state.model is model
    with pytest.raises(TypeError, match="no 'model' attribute"):
        set_wrapped_model(object(), model)
    with pytest.raises(TypeError, match="must be an nn.Module"):
        set_wrapped_model(state, "model")  # type: ignore[arg-type]


def test_load_into_meta_plain_model_without_process_group() -> None:
    ref = reference_state_dict(0, **SHAPE)
    with torch.device("meta"):
        model = build_model(1, **SHAPE)
    model.register_buffer("scratch", torch.empty(3, device="meta"), persistent=False)
    stats = DeliveryStats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_full_state_dict(model, ref, stats=stats) is model
    assert any("'scratch'" in str(w.message) for w in caught)  # nothing can fill it: said so
    for key, value in model.state_dict().items():
        assert torch.equal(value, ref[key]), key
    assert stats.bytes_local == sum(v.numel() * v.element_size() for v in ref.values())
    # Wrapper segments in the full state dict's keys are ignored.
    prefixed = {k.replace("blocks.0.", "blocks.0._fsdp_wrapped_module."): v * 2 for k, v in ref.items()}
    load_full_state_dict(model, prefixed)
    assert torch.equal(model.blocks[0].mlp_up.weight, ref["blocks.0.mlp_up.weight"] * 2)


def test_single_process_errors_and_arguments(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ref = reference_state_dict(0, **SHAPE)
    model = build_model(1, **SHAPE)
    with pytest.raises(FullStateDictKeysError, match="'module.embed.weight'.*DDP state dict") as info:
        load_full_state_dict(model, {f"module.{k}": v for k, v in ref.items()})
    assert info.value.missing_keys and all(k.startswith("module.") for k in info.value.unexpected_keys)
    with pytest.raises(TypeError, match="cpu_offload"):
        load_full_state_dict(model, ref, cpu_offload="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nn.Module"):
        load_full_state_dict(ref, ref)  # type: ignore[arg-type]
    path = tmp_path / "m.pt"
    torch.save(ref, path)
    load_full_state_dict(model, path)  # os.PathLike: read through dcp.load
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def test_not_a_module_parent_lookup_on_wrapper_children() -> None:
    outer = nn.Sequential(build_model(0, **SHAPE))
    assert get_fsdp_parent("0.blocks.0", outer) is None
