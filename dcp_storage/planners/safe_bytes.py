"""Decoding ``BYTE_IO`` items without running code from the checkpoint.

torch's ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(value, weights_only=False)``: a checkpoint
can run code on every rank that loads it. Our planners decode with
:func:`~dcp_storage.formats.byte_items.decode_byte_item` instead (``weights_only=True``, torch.save zip
archives only) and turn refusals into :class:`~dcp_storage.errors.UnsafeCheckpointError` naming the key.
Callers that trust a class can allow it with ``safe_globals`` (passed to
``torch.serialization.safe_globals``).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from dcp_storage.formats.byte_items import decode_byte_item

__all__ = ["safe_load_bytes"]


def safe_load_bytes(value: io.BytesIO, where: str, safe_globals: Sequence[Any] = ()) -> Any:
    """The value in ``value``, decoded with ``torch.load(weights_only=True)``; refusals are our errors.

    ``where`` names the item in messages (e.g. ``"checkpoint key 'extra_state'"``).
    """
    return decode_byte_item(value.read(), where, safe_globals)
