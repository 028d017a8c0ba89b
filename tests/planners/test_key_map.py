"""Unit tests of the planners' parts (no checkpoint I/O): KeyMap, KeyRules, DtypePolicy, messages, hints."""

from __future__ import annotations

import pickle

import pytest
import torch

from dcp_storage import DcpStorageError
from dcp_storage.planners import (
    DtypePolicy,
    IncompatibleKeysError,
    KeyCollisionError,
    KeyMap,
    KeyRules,
    RemappingLoadPlanner,
)
from dcp_storage.planners.key_map import format_keys, suggest_key_map
from dcp_storage.planners.matching import match_keys


def test_prefix_maps() -> None:
    assert KeyMap.add_prefix("module.")("embed.weight") == "module.embed.weight"
    strip = KeyMap.strip_prefix("_orig_mod.")
    assert strip("_orig_mod.embed.weight") == "embed.weight"
    assert strip("embed.weight") == "embed.weight"  # keys without the prefix are left alone
    with pytest.raises(ValueError):
        KeyMap.add_prefix("")


def test_regex_rename_within_chain_callable() -> None:
    fsdp1 = KeyMap.regex(r"^(blocks\.\d+)\.", r"\1._fsdp_wrapped_module.")
    assert fsdp1("blocks.3.mlp_up.weight") == "blocks.3._fsdp_wrapped_module.mlp_up.weight"
    assert fsdp1("head.weight") == "head.weight"
    assert KeyMap.rename({"head.weight": "lm_head.weight"})("head.weight") == "lm_head.weight"
    scoped = KeyMap.within("model.", KeyMap.add_prefix("module."))
    assert scoped("model.embed.weight") == "model.module.embed.weight"
    assert scoped("optim.state.x") == "optim.state.x"
    chained = KeyMap.chain(KeyMap.strip_prefix("module."), KeyMap.add_prefix("model."), str.upper)
    assert chained("module.a.b") == "MODEL.A.B"
    assert KeyMap.add_prefix("a.").then(KeyMap.add_prefix("b."))("x") == "b.a.x"
    assert KeyMap.callable(lambda k: k.replace("ln_", "norm_"))("ln_f.weight") == "norm_f.weight"
    assert "add_prefix('module.')" in repr(scoped)


def test_coerce_and_bad_callable() -> None:
    assert KeyMap.coerce(None)("x") == "x"
    assert KeyMap.coerce({"a": "b"})("a") == "b"
    assert KeyMap.coerce(str.upper)("a") == "A"
    with pytest.raises(TypeError, match="must return a str"):
        KeyMap.callable(lambda k: None)("key")  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError):
        KeyMap.coerce(3)  # type: ignore[arg-type]


def test_collision_names_both_keys() -> None:
    key_map = KeyMap.strip_prefix("module.")
    with pytest.raises(KeyCollisionError) as info:
        match_keys(["module.w", "w", "b"], ["w", "b"], key_map, KeyRules.strict())
    err = info.value
    assert isinstance(err, DcpStorageError) and isinstance(err, ValueError)
    assert err.collisions == {"w": ["module.w", "w"]}
    assert "'module.w', 'w' -> 'w'" in str(err) and "KeyMap.strip_prefix('module.')" in str(err)


def test_match_keys_missing_unexpected_ignored() -> None:
    m = match_keys(["a", "b", "c"], ["c", "x.a", "optim.s", "z"], KeyMap.identity(), KeyRules.strict(["optim.*"]))
    assert m.pairs == {"c": "c"}
    assert m.missing == ["a", "b"]
    assert m.unexpected == ["x.a", "z"]  # checkpoint order, ignored pattern left out


def test_incompatible_keys_message_truncates() -> None:
    missing = [f"layer.{i}.weight" for i in range(1000)]
    err = IncompatibleKeysError(missing, ["extra"])
    text = str(err)
    assert "1000 missing key(s)" in text and "'layer.0.weight'" in text and "... and 990 more" in text
    assert "'layer.999.weight'" not in text
    assert "1 unexpected key(s)" in text and "'extra'" in text and "strict=False" in text
    assert len(text) < 1200
    assert format_keys(["a", "b"]) == "'a', 'b'"


def test_errors_pickle() -> None:
    """DCP gathers each rank's exception by pickle: ours must survive the trip."""
    errors = [
        IncompatibleKeysError(["a"], ["b"], "hint"),
        KeyCollisionError({"x": ["a", "b"]}, KeyMap.callable(lambda k: "x")),
    ]
    for err in errors:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
    assert pickle.loads(pickle.dumps(errors[0])).missing_keys == ["a"]
    assert pickle.loads(pickle.dumps(errors[1])).collisions == {"x": ["a", "b"]}


def test_hint_finds_prefix_either_way_and_in_scope() -> None:
    keys = ["embed.weight", "head.weight"]
    assert "KeyMap.add_prefix('module.')" in suggest_key_map(keys, ["module." + k for k in keys])
    assert "KeyMap.strip_prefix('_orig_mod.')" in suggest_key_map(["_orig_mod." + k for k in keys], keys)
    hint = suggest_key_map(["model." + k for k in keys], ["model.module." + k for k in keys])
    assert "KeyMap.within('model.', KeyMap.add_prefix('module.'))" in hint
    assert suggest_key_map(["a"], ["b"]) == ""


@pytest.mark.parametrize(
    ("policy", "stored", "dest", "ok"),
    [
        (DtypePolicy.cast(), torch.bfloat16, torch.float32, True),
        (DtypePolicy.cast(), torch.float32, torch.float16, True),
        (DtypePolicy.cast(), torch.int32, torch.int64, True),
        (DtypePolicy.cast(), torch.float32, torch.int64, False),
        (DtypePolicy.cast(), torch.int64, torch.float32, False),
        (DtypePolicy.cast(), torch.bool, torch.uint8, False),
        (DtypePolicy.exact(), torch.bfloat16, torch.float32, False),
        (DtypePolicy.exact(), torch.float32, torch.float32, True),
        (DtypePolicy.explicit({torch.bfloat16: torch.float32}), torch.bfloat16, torch.float32, True),
        (DtypePolicy.explicit({torch.bfloat16: torch.float32}), torch.float32, torch.bfloat16, False),
        (DtypePolicy.unchecked(), torch.float32, torch.int64, True),
    ],
)
def test_dtype_policies(policy: DtypePolicy, stored: torch.dtype, dest: torch.dtype, ok: bool) -> None:
    assert policy.allows(stored, dest) is ok


def test_constructor_validation() -> None:
    with pytest.raises(TypeError, match="strict"):
        RemappingLoadPlanner(strict="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype_policy"):
        RemappingLoadPlanner(dtype_policy=torch.float32)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        DtypePolicy.explicit({"bf16": torch.float32})  # type: ignore[dict-item]
