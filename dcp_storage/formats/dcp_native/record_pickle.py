"""A strict decoder for the ``data.pkl`` that ``torch.save`` writes for one plain tensor.

Every tensor record of a DCP checkpoint carries a ``data.pkl`` of about 40 opcodes:
``_rebuild_tensor_v2(persistent_id(("storage", FloatStorage, "0", "cpu", numel)), offset, size, stride,
requires_grad, OrderedDict())``. Decoding it with the allow-list unpickler costs ~50 us per record
(a guard walk over the opcodes, an attribute snapshot of the allow-listed objects, the C unpickler with
Python callbacks); a rank that reshards a 2 GiB checkpoint reads a few hundred of them.

:func:`decode_tensor_pickle` interprets only the opcodes that pickle writes for such a record, on a
plain Python stack: globals are looked up in the caller's allow-list by name (nothing is imported),
``REDUCE`` calls only allow-listed callables, the memo is a dict (no index can make it allocate; one past
the stream's length is declined, as the full path refuses it), and there is no ``BUILD``, so nothing can
be mutated. Anything else returns ``None`` and the caller uses the full allow-list unpickler, which
reports it precisely. Records that share shape, dtype and storage key pickle to identical bytes, so
results are cached by those bytes.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

__all__ = ["decode_tensor_pickle"]

_CACHE_LIMIT = 4096
_cache: dict[bytes, Any] = {}

_PROTO = pickle.PROTO[0]
_FRAME = pickle.FRAME[0]
_GLOBAL = pickle.GLOBAL[0]
_BINPUT = pickle.BINPUT[0]
_LONG_BINPUT = pickle.LONG_BINPUT[0]
_MEMOIZE = pickle.MEMOIZE[0]
_BINGET = pickle.BINGET[0]
_LONG_BINGET = pickle.LONG_BINGET[0]
_MARK = pickle.MARK[0]
_BINUNICODE = pickle.BINUNICODE[0]
_SHORT_BINUNICODE = pickle.SHORT_BINUNICODE[0]
_BININT = pickle.BININT[0]
_BININT1 = pickle.BININT1[0]
_BININT2 = pickle.BININT2[0]
_LONG1 = pickle.LONG1[0]
_TUPLE = pickle.TUPLE[0]
_TUPLE1 = pickle.TUPLE1[0]
_TUPLE2 = pickle.TUPLE2[0]
_TUPLE3 = pickle.TUPLE3[0]
_EMPTY_TUPLE = pickle.EMPTY_TUPLE[0]
_NEWTRUE = pickle.NEWTRUE[0]
_NEWFALSE = pickle.NEWFALSE[0]
_NONE = pickle.NONE[0]
_EMPTY_DICT = pickle.EMPTY_DICT[0]
_BINPERSID = pickle.BINPERSID[0]
_REDUCE = pickle.REDUCE[0]
_STOP = pickle.STOP[0]


class _NotCanonical(Exception):
    """The stream uses something outside the subset this decoder interprets."""


def decode_tensor_pickle(
    data: bytes,
    allowed: dict[tuple[str, str], Any],
    persistent_load: Callable[[Any], Any],
) -> Any | None:
    """Decode ``data`` if it is a canonical single-tensor pickle; ``None`` for anything else.

    ``allowed`` and ``persistent_load`` are the same allow-list and persistent-id handler the full
    unpickler would get; results are cached by ``data`` per ``(allowed, persistent_load)``, so they must
    be pure (module-level tables and functions). Any exception, including one raised by an allow-listed
    callable, also returns ``None``: the full unpickler then decodes the stream again and classifies it.
    """
    key = data
    hit = _cache.get(key)
    if hit is not None and hit[0] is allowed and hit[1] is persistent_load:
        return hit[2]
    try:
        result = _interpret(data, allowed, persistent_load)
    except Exception:  # noqa: BLE001 - malformed or unsupported: the full unpickler reports it
        return None
    if len(_cache) >= _CACHE_LIMIT:
        _cache.clear()
    _cache[key] = (allowed, persistent_load, result)
    return result


def _interpret(data: bytes, allowed: dict[tuple[str, str], Any], persistent_load: Callable[[Any], Any]) -> Any:
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    pos, end = 0, len(data)
    from_bytes = int.from_bytes
    while pos < end:
        op = data[pos]
        pos += 1
        if op == _BINPUT:
            memo[data[pos]] = stack[-1]
            pos += 1
        elif op == _MEMOIZE:
            memo[len(memo)] = stack[-1]
        elif op == _BININT1:
            stack.append(data[pos])
            pos += 1
        elif op == _BININT2:
            stack.append(from_bytes(data[pos : pos + 2], "little"))
            pos += 2
        elif op == _BININT:
            stack.append(from_bytes(data[pos : pos + 4], "little", signed=True))
            pos += 4
        elif op == _LONG1:
            n = data[pos]
            stack.append(from_bytes(data[pos + 1 : pos + 1 + n], "little", signed=True))
            pos += 1 + n
        elif op == _BINUNICODE or op == _SHORT_BINUNICODE:
            width = 4 if op == _BINUNICODE else 1
            n = from_bytes(data[pos : pos + width], "little")
            pos += width
            if pos + n > end:
                raise _NotCanonical("string runs past the stream")
            stack.append(data[pos : pos + n].decode("utf-8"))
            pos += n
        elif op == _MARK:
            marks.append(len(stack))
        elif op == _TUPLE:
            k = marks.pop()
            items = tuple(stack[k:])
            del stack[k:]
            stack.append(items)
        elif op == _TUPLE2:
            b = stack.pop()
            stack[-1] = (stack[-1], b)
        elif op == _TUPLE1:
            stack[-1] = (stack[-1],)
        elif op == _TUPLE3:
            c = stack.pop()
            b = stack.pop()
            stack[-1] = (stack[-1], b, c)
        elif op == _EMPTY_TUPLE:
            stack.append(())
        elif op == _NEWFALSE:
            stack.append(False)
        elif op == _NEWTRUE:
            stack.append(True)
        elif op == _NONE:
            stack.append(None)
        elif op == _EMPTY_DICT:
            stack.append({})
        elif op == _BINGET:
            stack.append(memo[data[pos]])
            pos += 1
        elif op == _LONG_BINPUT:
            index = from_bytes(data[pos : pos + 4], "little")
            if index > end:  # no pickler numbers its memo past its own length; the full path refuses it
                raise _NotCanonical("memo index beyond the stream")
            memo[index] = stack[-1]
            pos += 4
        elif op == _LONG_BINGET:
            stack.append(memo[from_bytes(data[pos : pos + 4], "little")])
            pos += 4
        elif op == _GLOBAL:
            first = data.index(b"\n", pos)
            second = data.index(b"\n", first + 1)
            name = (data[pos:first].decode("ascii"), data[first + 1 : second].decode("ascii"))
            stack.append(allowed[name])  # KeyError: not allow-listed
            pos = second + 1
        elif op == _BINPERSID:
            stack[-1] = persistent_load(stack[-1])
        elif op == _REDUCE:
            args = stack.pop()
            func = stack[-1]
            if type(args) is not tuple or not callable(func):
                raise _NotCanonical("REDUCE of a non-callable or without an argument tuple")
            stack[-1] = func(*args)
        elif op == _STOP:
            if len(stack) != 1 or marks or pos != end:
                raise _NotCanonical("STOP with a stack that is not one object")
            return stack[0]
        elif op == _PROTO:
            if data[pos] > pickle.HIGHEST_PROTOCOL:  # the C unpickler refuses it: so do we
                raise _NotCanonical(f"pickle protocol {data[pos]}")
            pos += 1
        elif op == _FRAME:
            pos += 8
        else:
            raise _NotCanonical(f"opcode {op:#x}")
        if pos > end:
            raise _NotCanonical("argument runs past the stream")
    raise _NotCanonical("no STOP")
