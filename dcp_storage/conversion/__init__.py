"""Checkpoint conversion: any format on any store to any format on any store, one tensor at a time.

* :func:`convert` - the general entry point (``dcp-storage convert``);
* :func:`dcp_to_torch_save` / :func:`torch_save_to_dcp` - drop-ins for torch's
  ``torch.distributed.checkpoint.format_utils`` functions, on any URL and in bounded memory;
* :func:`merge_fsdp_weights` - drop-in for accelerate's FSDP merge (``dcp-storage merge``).
"""

from .engine import ConvertResult, convert
from .merge import merge_fsdp_weights
from .plan import WrittenFile
from .source import TensorSource
from .torch_compat import dcp_to_torch_save, torch_save_to_dcp

__all__ = [
    "ConvertResult",
    "TensorSource",
    "WrittenFile",
    "convert",
    "dcp_to_torch_save",
    "merge_fsdp_weights",
    "torch_save_to_dcp",
]
