"""Non-tensor (``BYTE_IO``) items: decoded only through a safe path; a planner sees only bytes we wrote.

DCP stores each non-tensor value (a step counter, extra state, a Python object) as a ``torch.save``
archive, and torch's ``DefaultLoadPlanner.load_bytes`` reads it back with ``torch.load(weights_only=
False)``: whatever bytes reach it can run code. Guessing from the first bytes whether an item "is a
pickle" does not help: CPython's C unpickler reads text pickles that :mod:`pickletools` rejects
(``I0x10``), ``torch.load`` hands a TorchScript archive to ``torch.jit.load``, and a legacy (non-zip)
file is one pickle after another. So no sniffing decides anything here:

* :func:`decode_byte_item` accepts a zip archive of stored (uncompressed) entries that is not TorchScript,
  and decodes it with ``torch.load(weights_only=True)`` (torch's allow-list unpickler). Everything else
  (legacy files, bare pickles, TorchScript, refused globals, garbage) raises
  :class:`~dcp_storage.errors.UnsafeCheckpointError` naming the file and the key.
* :func:`vet_byte_item` then re-encodes the decoded object with ``torch.save`` into fresh bytes,
  :class:`VettedBytes`: the only thing a reader hands to ``planner.load_bytes``. Re-pickling objects of
  allow-listed types gives a pickle of those same types, which even an unrestricted unpickler only
  rebuilds.
* ``trust=True`` (``trust_byte_items=True`` on the readers' configs) passes the stored bytes unchanged,
  for checkpoints from a trusted source that store custom objects.

Strategies that forward items (``Broadcasting``) pass :class:`VettedBytes` on and vet anything else
(:func:`ensure_vetted`), so a reader that does not vet cannot open a path around this module.

Planners whose class defines ``load_value(read_item, value)`` (ours: ``RemappingLoadPlanner``,
``DynamicMetaLoadPlanner``) get the decoded value itself (:func:`deliver_byte_item`): one decode per item
and no re-encoding. Only the class is asked, never the instance: a wrapper that forwards unknown
attributes (``Broadcasting``'s routing planner) must keep getting bytes it can route.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
import zipfile
from collections.abc import Sequence
from typing import Any

import torch

from dcp_storage.errors import CorruptCheckpointError, UnsafeCheckpointError
from dcp_storage.formats.dcp_native.records import check_record_zip

__all__ = [
    "VettedBytes",
    "decode_byte_item",
    "deliver_byte_item",
    "ensure_vetted",
    "planner_safe_globals",
    "vet_byte_item",
]


_ZIP_LOCAL = b"PK\x03\x04"
_TRUST_HINT = "pass trust_byte_items=True only if you trust this checkpoint"
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_REASON = re.compile(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", re.DOTALL)


class VettedBytes(io.BytesIO):
    """Bytes of a non-tensor item that this library produced from a safely decoded object (or that the
    user chose to trust): what ``planner.load_bytes`` may receive."""


def _archive_names(data: bytes, where: str) -> list[str]:
    """Entry names of the zip ``data``; refuses compressed entries and sizes beyond the item.

    ``torch.save`` stores every entry uncompressed; a deflated entry could inflate to gigabytes inside
    ``torch.load`` before anything is checked. (:mod:`zipfile` reads only the central directory here.)
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, struct.error) as exc:
        raise UnsafeCheckpointError(where, "damaged zip archive", f"{exc}; {_TRUST_HINT}") from None
    for info in infos:
        if (
            info.compress_type != zipfile.ZIP_STORED
            or info.file_size != info.compress_size
            or info.file_size > len(data)
        ):
            raise UnsafeCheckpointError(
                where,
                "compressed zip entry",
                f"entry {info.filename!r} is compressed or larger than the item; {_TRUST_HINT}",
            )
    return [info.filename for info in infos]


def _is_torchscript(names: Sequence[str]) -> bool:
    """torch's own test (``_is_torchscript_zip``): a ``constants.pkl`` record below the archive's folder."""
    return any(n.rsplit("/", 1)[-1] == "constants.pkl" or n.startswith("code/") or "/code/" in n for n in names)


def decode_byte_item(data: bytes | memoryview, where: str, safe_globals: Sequence[Any] = ()) -> Any:
    """The value stored in ``data``, decoded with ``torch.load(weights_only=True)`` and nothing else.

    ``where`` names the file and key in messages. ``safe_globals`` extends torch's allow-list (as
    ``torch.serialization.safe_globals``; globals added with ``add_safe_globals`` count too).
    """
    data = bytes(data)
    if not data.startswith(_ZIP_LOCAL):
        raise UnsafeCheckpointError(
            where,
            "non-zip payload",
            "not a torch.save zip archive (a legacy torch.save file or a bare pickle, which only an unrestricted "
            f"unpickler reads); {_TRUST_HINT}",
        )
    if _is_torchscript(_archive_names(data, where)):
        raise UnsafeCheckpointError(where, "TorchScript archive", f"torch.load would run its code; {_TRUST_HINT}")
    try:
        if safe_globals:
            with torch.serialization.safe_globals(list(safe_globals)):
                return _weights_only_load(data)
        return _weights_only_load(data)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = _GLOBAL.search(text)
        if found:
            forbidden, detail = found.group(1), ""
        else:
            reason = _REASON.search(text)
            forbidden, detail = "pickle content", (reason.group(1).strip() if reason else "refused by weights_only")
        hint = "if you trust this checkpoint, allow the class with safe_globals=[...] or pass trust_byte_items=True"
        raise UnsafeCheckpointError(where, forbidden, f"{detail}; {hint}" if detail else hint) from None
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: the stored value is nested too deeply to decode") from None
    except Exception as exc:  # noqa: BLE001 - torch's zip reader and rebuild functions raise many kinds
        raise UnsafeCheckpointError(
            where, "undecodable payload", f"weights_only=True could not decode it ({type(exc).__name__}); {_TRUST_HINT}"
        ) from None


def _weights_only_load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True, mmap=False)


def vet_byte_item(
    data: bytes | memoryview, where: str, *, trust: bool = False, safe_globals: Sequence[Any] = ()
) -> VettedBytes:
    """What to hand to ``planner.load_bytes`` for a stored item: a fresh ``torch.save`` of its safely
    decoded value, or (``trust``) the stored bytes themselves."""
    if trust:
        return VettedBytes(bytes(data))
    value = decode_byte_item(data, where, safe_globals)
    out = VettedBytes()
    try:
        torch.save(value, out)
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: the stored value is nested too deeply to re-encode") from None
    out.seek(0)
    return out


def ensure_vetted(value: Any, where: str) -> VettedBytes:
    """``value`` (what a reader passed to ``load_bytes``) if a reader vetted it, else vetted here."""
    if isinstance(value, VettedBytes):
        return value
    data = value.read() if hasattr(value, "read") else bytes(value)
    return vet_byte_item(data, where)


def planner_safe_globals(planner: Any) -> tuple[Any, ...]:
    """The classes a planner trusts for its own ``BYTE_IO`` decode (``RemappingLoadPlanner(safe_globals=...)``):
    a reader that decodes for it honours them too."""
    found = getattr(planner, "safe_globals", ())
    return tuple(found) if isinstance(found, (tuple, list)) else ()


def deliver_byte_item(planner: Any, item: Any, data: bytes | memoryview, where: str, *, trust: bool = False) -> None:
    """Hand stored item ``data`` to ``planner``: the decoded value to a planner class with ``load_value``,
    else :func:`vet_byte_item`'s bytes to ``load_bytes``. ``trust`` passes the stored bytes unchanged."""
    check_record_zip(data, where)  # torch.load trusts the central directory and inflates what it declares
    safe = planner_safe_globals(planner)
    if not trust and _takes_values(type(planner)):
        planner.load_value(item, decode_byte_item(data, where, safe))
    else:
        planner.load_bytes(item, vet_byte_item(data, where, trust=trust, safe_globals=safe))


def _takes_values(cls: type) -> bool:
    """Whether ``cls`` defines ``load_value`` at or below the class that defines its ``load_bytes`` (a
    subclass that overrides only ``load_bytes`` keeps getting bytes)."""
    owners = {name: next((k for k in cls.__mro__ if name in vars(k)), None) for name in ("load_value", "load_bytes")}
    value, raw = owners["load_value"], owners["load_bytes"]
    return value is not None and callable(vars(value)["load_value"]) and (raw is None or issubclass(value, raw))
