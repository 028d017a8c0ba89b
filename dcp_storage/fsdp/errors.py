"""Errors of :mod:`dcp_storage.fsdp`; all derive from :class:`~dcp_storage.errors.DcpStorageError`.

Shape mismatches raise :class:`~dcp_storage.errors.ShapeMismatchError`, refused dtype casts
:class:`~dcp_storage.planners.DtypeMismatchError` and non-tensor values
:class:`~dcp_storage.planners.ValueTypeMismatchError`, as elsewhere in the package.
"""

from __future__ import annotations

from collections.abc import Sequence

from dcp_storage.errors import DcpStorageError
from dcp_storage.planners.errors import format_keys

__all__ = ["FullStateDictKeysError", "UnknownModuleError"]


class FullStateDictKeysError(DcpStorageError, RuntimeError):
    """The full state dict and the model's state dict do not hold the same keys.

    ``missing_keys``: model keys the full state dict lacks; ``unexpected_keys``: full-state-dict keys the
    model does not have (the meanings of ``nn.Module.load_state_dict``).
    """

    def __init__(self, missing_keys: Sequence[str], unexpected_keys: Sequence[str]) -> None:
        self.missing_keys = list(missing_keys)
        self.unexpected_keys = list(unexpected_keys)
        parts = []
        if self.missing_keys:
            parts.append(
                f"{len(self.missing_keys)} missing key(s) (in the model, not in the full state dict): "
                f"{format_keys(self.missing_keys)}"
            )
        if self.unexpected_keys:
            parts.append(
                f"{len(self.unexpected_keys)} unexpected key(s) (in the full state dict, not in the model): "
                f"{format_keys(self.unexpected_keys)}"
            )
        msg = "load_full_state_dict: the full state dict does not match the model: " + "; ".join(parts)
        msg += (
            ". Keys are compared after dropping wrapper segments (_fsdp_wrapped_module, _checkpoint_wrapped_module, "
            "_orig_mod)"
        )
        if self.unexpected_keys and all(k.startswith("module.") for k in self.unexpected_keys):
            msg += "; the unexpected keys all start with 'module.' (a DDP state dict?): strip that prefix first"
        super().__init__(msg)

    def __reduce__(self) -> tuple[object, ...]:  # crosses processes
        return (type(self), (self.missing_keys, self.unexpected_keys))


class UnknownModuleError(DcpStorageError, LookupError):
    """A module name that does not resolve to a submodule of the model (names the part that failed)."""
