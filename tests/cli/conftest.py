"""Reference state dicts and the same checkpoint in each format, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ._scaffold import Scaffolded, scaffold_and_install


def reference_tensors() -> dict[str, torch.Tensor]:
    """Flat keys; every dtype family, a 0-d and an empty tensor, a float8 (pickled by torch as v3)."""
    g = torch.Generator().manual_seed(7)
    return {
        "model.embed.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.w": torch.randn(32, 48, generator=g).to(torch.bfloat16),
        "model.layers.0.b": torch.randn(48, generator=g).to(torch.float16),
        "model.layers.1.w": torch.randn(48, 32, generator=g, dtype=torch.float64),
        "model.norm.scale": torch.tensor(0.5),
        "model.ids": torch.arange(10, dtype=torch.int64),
        "model.mask": torch.rand(7, generator=g) > 0.5,
        "model.bytes": torch.randint(0, 255, (5, 3), generator=g, dtype=torch.uint8),
        "model.q": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "model.empty": torch.zeros(0, 4),
    }


def nested(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """``{"model": {...}}`` with the rest of each key as the inner key (as a model.state_dict() is nested)."""
    return {"model": {k.removeprefix("model."): v for k, v in flat.items()}}


@pytest.fixture(scope="session")
def reference() -> dict[str, torch.Tensor]:
    return reference_tensors()


@pytest.fixture(scope="session")
def sources(tmp_path_factory: pytest.TempPathFactory, reference: dict[str, torch.Tensor]) -> dict[str, Path]:
    """The reference as a DCP directory (with a step counter), a safetensors file and a torch.save file."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from dcp_storage import FsspecWriter

    root = tmp_path_factory.mktemp("sources")
    dcp_dir = root / "ckpt_dcp"
    dcp.save({**nested(reference), "step": 11}, storage_writer=FsspecWriter(dcp_dir), no_dist=True)
    tensors_only = root / "ckpt_tensors_dcp"
    dcp.save(nested(reference), storage_writer=FsspecWriter(tensors_only), no_dist=True)
    st = root / "model.safetensors"
    save_file(reference, str(st), metadata={"format": "pt"})
    pt = root / "model.pt"
    torch.save({**nested(reference), "step": 11}, pt)
    return {"dcp": dcp_dir, "dcp_tensors": tensors_only, "safetensors": st, "torch": pt}


@pytest.fixture(scope="session")
def scaffolded(tmp_path_factory: pytest.TempPathFactory) -> Scaffolded:
    """The three templates' plugins, generated, pip installed and their own tests run, once (``_scaffold.py``)."""
    return scaffold_and_install(tmp_path_factory.mktemp("scaffold"))
