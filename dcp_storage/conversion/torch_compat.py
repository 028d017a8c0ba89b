"""Drop-ins for ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` / ``torch_save_to_dcp``.

Same names, arguments and results (the ``torch.save`` file holds the nested state dict DCP saved,
non-tensor values included; the DCP checkpoint is what ``dcp.save`` writes for the file's state dict), with
three differences: both paths may be any fsspec URL (pass ``storage_options``), memory stays near one
tensor instead of the whole checkpoint, and ``torch_save_to_dcp`` never unpickles with ``weights_only=False``
(torch's does) unless told ``trust=True``: the file's ``data.pkl`` is decoded through an allow-list (plus
``torch.serialization.add_safe_globals``), so a file holding custom classes raises
:class:`~dcp_storage.errors.UnsafeCheckpointError` naming the class instead of running code. Like torch's,
both replace an existing output.
"""

from __future__ import annotations

import os
from typing import Any

from dcp_storage.conversion.engine import ConvertResult, convert

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]


def dcp_to_torch_save(
    dcp_checkpoint_dir: str | os.PathLike[str],
    torch_save_path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    trust: bool = False,
) -> ConvertResult:
    """Convert the DCP checkpoint in ``dcp_checkpoint_dir`` into one ``torch.save`` file.

    ``trust``: non-tensor items holding other objects than plain data are decoded with
    ``weights_only=False`` (only for a checkpoint you trust; see :func:`convert`).
    """
    return convert(
        dcp_checkpoint_dir,
        torch_save_path,
        to="torch",
        src_format="dcp",
        single_file=True,
        storage_options=storage_options,
        overwrite=True,
        trust=trust,
    )


def torch_save_to_dcp(
    torch_save_path: str | os.PathLike[str],
    dcp_checkpoint_dir: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    trust: bool = False,
) -> ConvertResult:
    """Convert the ``torch.save`` file at ``torch_save_path`` into a DCP checkpoint directory.

    ``trust``: decode the file as ``torch.load(weights_only=False)`` would, as torch's function does (only
    for a file you trust: it may run code); without it, ``data.pkl`` goes through the allow-list.
    """
    return convert(
        torch_save_path,
        dcp_checkpoint_dir,
        to="dcp",
        src_format="torch_save",
        single_file=False,
        storage_options=storage_options,
        overwrite=True,
        trust=trust,
    )
