"""FSDP helpers: recognise FSDP1/FSDP2 models, find FSDP units, unwrap, and load full state dicts.

Works for both FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) and FSDP2
(``torch.distributed.fsdp.fully_shard`` / ``FSDPModule``)::

    from dcp_storage import fsdp

    with torch.device("meta"):
        model = build_model()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    full_sd = torch.load("model.pt", weights_only=True) if rank == 0 else None
    fsdp.load_full_state_dict(model, full_sd)          # each rank receives only its own shards
    fsdp.load_full_state_dict(model, "s3://bucket/model.pt")   # or straight from storage

* :func:`is_fsdp_model`, :func:`get_fsdp_parent`, :func:`maybe_get_wrapped`, :func:`set_wrapped_model`:
  :mod:`.introspection`;
* :func:`load_full_state_dict`: :mod:`.loading` (what it does for FSDP1 vs FSDP2), :mod:`.scatter` (the
  rank-0-to-shards protocol), :mod:`.local_shards` (what each rank holds);
* :func:`materialize_meta`: ``to_empty`` that also restores non-persistent buffers (rotary ``inv_freq``),
  for ``to_empty`` + ``dcp.load`` code (:mod:`.materialize`).
"""

from dcp_storage.fsdp.loading import load_full_state_dict, materialize_meta
from dcp_storage.fsdp.local_shards import (
    FullStateDictKeysError,
    UnknownModuleError,
    get_fsdp_parent,
    is_fsdp_model,
    is_fsdp_unit,
    maybe_get_wrapped,
    set_wrapped_model,
)

__all__ = [
    "FullStateDictKeysError",
    "UnknownModuleError",
    "get_fsdp_parent",
    "is_fsdp_model",
    "is_fsdp_unit",
    "load_full_state_dict",
    "materialize_meta",
    "maybe_get_wrapped",
    "set_wrapped_model",
]
