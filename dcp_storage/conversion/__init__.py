"""Checkpoint conversion: any format on any store to any format on any store, one tensor at a time.

* :func:`convert` - the general entry point (``dcp-storage convert``);
* :func:`dcp_to_torch_save` / :func:`torch_save_to_dcp` - drop-ins for torch's
  ``torch.distributed.checkpoint.format_utils`` functions, on any URL and in bounded memory;
* :func:`merge_fsdp_weights` - drop-in for accelerate's FSDP merge (``dcp-storage merge``).
"""

from dcp_storage.conversion.engine import ConvertResult, convert, dcp_to_torch_save, torch_save_to_dcp
from dcp_storage.conversion.merge import merge_fsdp_weights
from dcp_storage.conversion.plan import WrittenFile
from dcp_storage.conversion.source import TensorSource

__all__ = [
    "ConvertResult",
    "TensorSource",
    "WrittenFile",
    "convert",
    "dcp_to_torch_save",
    "merge_fsdp_weights",
    "torch_save_to_dcp",
]
