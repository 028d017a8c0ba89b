"""Meta-device loads are complete: non-persistent buffers (rotary ``inv_freq``) are restored, or named.

A tiny Hugging Face Llama (built from a config, no download) and a toy rotary model, each built on the
meta device and loaded with ``load_full_state_dict`` (in memory, and from a file on 2 gloo ranks with
FSDP2) or with ``materialize_meta`` + ``dcp.load``, must give exactly the logits of the same model built
normally. A buffer no initialiser recomputes is NaN and named in a warning, never silently garbage.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dcp_storage import fsdp
from dcp_storage_testing.distributed import run_ranks

TOKENS = torch.arange(12).reshape(1, 12) % 64


def llama(meta: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    if not meta:
        return LlamaForCausalLM(config).eval()
    with torch.device("meta"):
        return LlamaForCausalLM(config).eval()


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def inv_freq(dim: int, device: torch.device | None = None) -> torch.Tensor:
    return 1.0 / (10_000 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


class Rotary(nn.Module):
    """A rotary embedding whose ``inv_freq`` is computed in ``__init__`` only."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", inv_freq(dim), persistent=False)


class ResettableRotary(Rotary):
    """The same, with torch's re-initialisation hook."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq(self.dim, self.inv_freq.device))


class Toy(nn.Module):
    def __init__(self, rotary: type[Rotary]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.rotary = rotary(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * self.rotary.inv_freq
        return self.proj(x) * torch.cat([angles.cos(), angles.sin()], dim=-1)


def test_hf_llama_on_meta_gives_the_logits_of_a_normal_build() -> None:
    ref = llama()
    model = llama(meta=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp.load_full_state_dict(model, ref.state_dict())
    assert not [w for w in caught if "non-persistent" in str(w.message)]
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert torch.equal(logits(model), logits(ref))


def test_materialize_meta_then_dcp_load(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecReader, FsspecWriter

    ref = llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled"
        dcp.save(ref.state_dict(), storage_writer=FsspecWriter(str(tmp_path / "ckpt")))
        model = llama(meta=True)
        assert fsdp.materialize_meta(model, "cpu") == []
        dcp.load(model.state_dict(), storage_reader=FsspecReader(str(tmp_path / "ckpt")))
    assert torch.equal(logits(model), logits(ref))


def test_a_module_reset_parameters_recomputes_its_buffer() -> None:
    ref = Toy(ResettableRotary)
    with torch.device("meta"):
        model = Toy(ResettableRotary)
    fsdp.load_full_state_dict(model, ref.state_dict())
    x = torch.randn(5, 8)
    assert torch.equal(model(x), ref(x))


def test_a_buffer_nothing_recomputes_is_named_and_nan() -> None:
    ref = Toy(Rotary)
    with torch.device("meta"):
        model = Toy(Rotary)
    with pytest.warns(UserWarning, match=r"non-persistent buffers 'rotary\.inv_freq' .*reset_parameters"):
        fsdp.load_full_state_dict(model, ref.state_dict())
    assert model.rotary.inv_freq.isnan().all()
    assert model(torch.randn(5, 8)).isnan().any()  # loud, not silently wrong
    assert torch.equal(model.proj.weight, ref.proj.weight)


def _fsdp2_llama_logits(rank: int, world: int, path: str) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    model = llama(meta=True)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp.load_full_state_dict(model, path)
    return logits(model).flatten().tolist()


def test_fsdp2_llama_on_meta_from_a_file_at_two_ranks(tmp_path: Path) -> None:
    ref = llama()
    path = str(tmp_path / "model.safetensors")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    want = logits(ref).flatten().tolist()
    for got in run_ranks(_fsdp2_llama_logits, 2, path, timeout=120.0):
        assert got == want  # bit-exact: the same weights, buffers and kernels as the normal build
