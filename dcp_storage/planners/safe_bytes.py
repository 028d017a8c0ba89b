"""Decoding ``BYTE_IO`` items without running code from the checkpoint.

torch's ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(value, weights_only=False)``: a checkpoint
can run code on every rank that loads it. We load with ``weights_only=True`` (torch's allow-listing
unpickler) and turn its refusal into :class:`~dcp_storage.errors.UnsafeCheckpointError` naming the key;
bytes that are not a torch.save payload at all raise :class:`~dcp_storage.errors.CorruptCheckpointError`.
Callers that trust a class can allow it with ``safe_globals`` (passed to
``torch.serialization.safe_globals``).
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["safe_load_bytes"]

_REFUSAL = "Weights only load failed"
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_REASON = re.compile(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", re.DOTALL)


def safe_load_bytes(value: io.BytesIO, where: str, safe_globals: Sequence[Any] = ()) -> Any:
    """``torch.load(value, weights_only=True)``, with refusals and garbage mapped to our errors.

    ``where`` names the item in messages (e.g. ``"checkpoint key 'extra_state'"``).
    """
    try:
        if safe_globals:
            with torch.serialization.safe_globals(list(safe_globals)):
                return torch.load(value, map_location="cpu", weights_only=True)
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if _REFUSAL not in text:
            raise CorruptCheckpointError(f"{where}: not a valid torch.save payload ({exc})") from exc
        found = _GLOBAL.search(text)
        if found:
            forbidden, detail = found.group(1), ""
        else:
            reason = _REASON.search(text)
            forbidden, detail = "pickle content", (reason.group(1).strip() if reason else "refused by weights_only")
        hint = "if you trust this checkpoint, allow the class with safe_globals=[...]"
        raise UnsafeCheckpointError(where, forbidden, f"{detail}; {hint}" if detail else hint) from None
    except (EOFError, RuntimeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: not a valid torch.save payload ({type(exc).__name__}: {exc})") from exc
