"""A walk over a pickle's opcodes, before the C unpickler sees them: what may be mutated, and sizes.

CPython's unpickler applies ``BUILD`` (set state), ``SETITEM(S)``, ``APPEND(S)`` and ``ADDITEMS`` to
whatever object is on its stack, and it offers no hook for them. An allow-list of globals is therefore
not enough: a stream can push an allow-listed class, an enum member it got back from a call, or a shared
constant, and ``BUILD`` it: a ``__qualname__`` or ``__bases__`` changed for the whole process, an enum
member with another ``_value_``. Size fields are a second problem: ``LONG_BINPUT 0x3fffffff`` makes the
C unpickler allocate and clear a memo of gigabytes, ``BYTEARRAY8`` allocates its claimed length before
reading a byte of it.

:func:`guard_pickle` interprets the stream abstractly, as the unpickler will (same stack, marks and
memo), with a *tag* per stack entry instead of an object: which entries were created by this load
(fresh containers, instances a constructor made), which are anything else (globals, what an arbitrary
call returned, persistent objects, scalars). It refuses, before anything is built:

* a mutating opcode whose target was not created by this load;
* ``BUILD`` with state that could set dunder attributes or slots (``(dict, slotstate)`` pairs, dicts
  with ``__x__`` keys, dicts that a call built) on an instance whose class has no ``__setstate__`` of
  its own to interpret it;
* every length, memo index and frame that reaches past the end of the stream (so nothing is allocated
  for it), unknown opcodes, out-of-band buffers, and anything it cannot parse the way the C unpickler
  does (text pickles included): a stream is accepted only if the walk understood all of it.

A callable's result counts as created by this load only when the callable is a class whose instances
are new objects (not an ``Enum``, whose call returns a shared member, nor a class with a custom
metaclass ``__call__``) or ``copyreg._reconstructor``. Cost: ~0.2 us an opcode in pure Python, paid
once per ``.metadata`` or ``data.pkl`` decode (the per-record fast path,
:mod:`~dcp_storage.formats.dcp_native.record_pickle`, has no mutating opcodes at all).

Errors: :class:`pickle.UnpicklingError` for malformed or truncated streams (as the C unpickler would
raise; callers that read a stream in pieces rely on it),
:class:`~dcp_storage.errors.CorruptCheckpointError` for memo bombs,
:class:`~dcp_storage.errors.UnsafeCheckpointError` for mutations it refuses.
"""

from __future__ import annotations

import copyreg
import enum
import pickle
from collections.abc import Callable
from typing import Any

from .errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["MISSING", "guard_pickle"]

MISSING = object()  # what ``resolve`` returns for a global outside the allow-list

# -- tags. Fresh objects get unique tags >= _FRESH (even: no __setstate__ of their own, odd: one).
_OTHER, _FACTORY, _FACTORY_SETSTATE, _RECONSTRUCTOR, _NONE, _PAIR, _TRIPLE, _TRIPLE_SETSTATE = range(8)
_FRESH = 16
# Strings (candidates for STACK_GLOBAL): -1 - 2 * opcode position, minus 1 more for "__dunder__" ones.

# -- what each opcode does (the walk's dispatch codes)
(
    _BAD, _SKIP, _PUSH, _STR, _LINE_PUSH, _BYTES, _MARK, _STOP, _POP, _POP_MARK, _DUP, _PUT, _GET, _MEMOIZE,
    _EMPTY_FRESH, _DICT, _LIST, _TUPLE, _TUPLE1, _TUPLE2, _TUPLE3, _FROZENSET, _APPEND, _APPENDS, _SETITEM,
    _SETITEMS, _ADDITEMS, _BUILD, _REDUCE, _NEWOBJ, _NEWOBJ_EX, _OBJ, _INST, _GLOBAL, _STACK_GLOBAL, _PERSID,
    _BINPERSID, _PROTO, _FRAME, _BYTEARRAY,
) = range(40)


def _table() -> tuple[list[int], list[int]]:
    """Opcode -> (dispatch code, argument width): fixed bytes to skip, or the width of a length field."""
    code, width = [_BAD] * 256, [0] * 256

    def put(names: str, what: int, w: int = 0) -> None:
        for name in names.split():
            op = getattr(pickle, name)[0]
            code[op], width[op] = what, w

    put("NONE", _PUSH)
    put("NEWTRUE NEWFALSE EMPTY_TUPLE", _PUSH)
    put("BININT1", _PUSH, 1)
    put("BININT2", _PUSH, 2)
    put("BININT", _PUSH, 4)
    put("BINFLOAT", _PUSH, 8)
    put("EXT1", _PUSH, 1)  # the unpickler resolves extension codes through find_class: not created here
    put("EXT2", _PUSH, 2)
    put("EXT4", _PUSH, 4)
    put("SHORT_BINUNICODE", _STR, 1)
    put("BINUNICODE", _STR, 4)
    put("BINUNICODE8", _STR, 8)
    put("SHORT_BINBYTES SHORT_BINSTRING LONG1", _BYTES, 1)
    put("BINBYTES", _BYTES, 4)
    put("BINSTRING LONG4", _BYTES, -4)  # signed lengths
    put("BINBYTES8", _BYTES, 8)
    put("BYTEARRAY8", _BYTEARRAY, 8)
    put("INT LONG FLOAT STRING UNICODE", _LINE_PUSH)
    put("MARK", _MARK)
    put("STOP", _STOP)
    put("POP", _POP)
    put("POP_MARK", _POP_MARK)
    put("DUP", _DUP)
    put("PUT", _PUT)
    put("BINPUT", _PUT, 1)
    put("LONG_BINPUT", _PUT, 4)
    put("GET", _GET)
    put("BINGET", _GET, 1)
    put("LONG_BINGET", _GET, 4)
    put("MEMOIZE", _MEMOIZE)
    put("EMPTY_DICT EMPTY_LIST EMPTY_SET", _EMPTY_FRESH)
    put("DICT", _DICT)
    put("LIST", _LIST)
    put("TUPLE", _TUPLE)
    put("TUPLE1", _TUPLE1)
    put("TUPLE2", _TUPLE2)
    put("TUPLE3", _TUPLE3)
    put("FROZENSET", _FROZENSET)
    put("APPEND", _APPEND)
    put("APPENDS", _APPENDS)
    put("SETITEM", _SETITEM)
    put("SETITEMS", _SETITEMS)
    put("ADDITEMS", _ADDITEMS)
    put("BUILD", _BUILD)
    put("REDUCE", _REDUCE)
    put("NEWOBJ", _NEWOBJ)
    put("NEWOBJ_EX", _NEWOBJ_EX)
    put("OBJ", _OBJ)
    put("INST", _INST)
    put("GLOBAL", _GLOBAL)
    put("STACK_GLOBAL", _STACK_GLOBAL)
    put("PERSID", _PERSID)
    put("BINPERSID", _BINPERSID)
    put("PROTO", _PROTO, 1)
    put("FRAME", _FRAME, 8)
    return code, width  # NEXT_BUFFER, READONLY_BUFFER (out-of-band buffers) stay _BAD


_CODE, _WIDTH = _table()


def _kind(obj: Any) -> int:
    """The tag of an allow-listed global: may calling it yield a new object, and does that have a
    ``__setstate__`` of its own?"""
    if obj is copyreg._reconstructor:
        return _RECONSTRUCTOR
    if not isinstance(obj, type) or obj is type or issubclass(obj, (enum.Enum, type)):
        return _OTHER  # functions and stand-ins may return shared objects; Enum(value) returns a member
    if type(obj).__call__ is not type.__call__:
        return _OTHER  # a metaclass that decides what a call returns
    return _FACTORY_SETSTATE if getattr(obj, "__setstate__", None) is not None else _FACTORY


class _Refused(Exception):
    pass


def guard_pickle(data: bytes, start: int, path: str, resolve: Callable[[str, str], Any]) -> int:
    """Check the pickle that starts at ``data[start]``; return the position just after its ``STOP``.

    ``resolve(module, name)`` is the allow-list: the object the unpickler's ``find_class`` will return,
    or :data:`MISSING` (the unpickler then refuses it itself; here it is just not created by this load).
    """
    try:
        return _walk(data, start, path, resolve)
    except (UnsafeCheckpointError, CorruptCheckpointError, pickle.UnpicklingError):
        raise
    except _Refused as refused:
        raise UnsafeCheckpointError(path, str(refused), "the pickle would modify an object it did not create") from None
    except (IndexError, KeyError, ValueError, UnicodeDecodeError):
        raise pickle.UnpicklingError("malformed or truncated pickle") from None


def _walk(data: bytes, start: int, path: str, resolve: Callable[[str, str], Any]) -> int:  # noqa: C901 - one dispatch loop
    code_of, width_of = _CODE, _WIDTH
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    dicts: set[int] = set()  # fresh dicts built by DICT / EMPTY_DICT: their keys are all seen here
    dunder: set[int] = set()  # fresh objects that got a "__x__" key
    kinds: dict[tuple[str, str], int] = {}
    fence, fresh = 0, _FRESH
    end = len(data)
    limit = end - start  # no memo index, length or frame can exceed the stream
    pos = start
    from_bytes = int.from_bytes

    def line(at: int) -> int:
        nl = data.find(b"\n", at)
        if nl < 0:
            raise pickle.UnpicklingError("pickle data was truncated")
        return nl

    def kind(module: str, name: str) -> int:
        key = (module, name)
        found = kinds.get(key)
        if found is None:
            obj = resolve(module, name)
            found = kinds[key] = _OTHER if obj is MISSING else _kind(obj)
        return found

    def called(what: int, args: int) -> int:
        nonlocal fresh
        fresh += 2
        if what == _FACTORY:
            return fresh
        if what == _FACTORY_SETSTATE:
            return fresh + 1
        if what == _RECONSTRUCTOR:  # copyreg._reconstructor(cls, base, state): a new cls
            return fresh + 1 if args == _TRIPLE_SETSTATE else fresh
        return _OTHER

    def string(tag: int) -> str | None:
        if tag >= 0:
            return None
        at = (-1 - tag) >> 1
        w = width_of[data[at]]
        n = from_bytes(data[at + 1 : at + 1 + w], "little")
        return data[at + 1 + w : at + 1 + w + n].decode("utf-8", "surrogatepass")

    while True:
        if pos >= end:
            raise pickle.UnpicklingError("pickle data was truncated")
        op = data[pos]
        what = code_of[op]
        pos += 1
        if what == _MEMOIZE:
            if len(stack) <= fence:
                raise pickle.UnpicklingError("stack underflow")
            memo[len(memo)] = stack[-1]
        elif what == _STR:
            w = width_of[op]
            n = from_bytes(data[pos : pos + w], "little")
            s = pos + w
            pos = s + n
            if pos > end:
                raise pickle.UnpicklingError(f"a string of {n} bytes runs past the end of the stream")
            tag = -1 - 2 * (s - w - 1)
            if n >= 4 and data[s] == 95 == data[s + 1] == data[pos - 1] == data[pos - 2]:
                tag -= 1
            stack.append(tag)
        elif what == _GET:
            w = width_of[op]
            if w:
                index = from_bytes(data[pos : pos + w], "little")
                pos += w
            else:
                nl = line(pos)
                index = int(data[pos:nl])
                pos = nl + 1
            stack.append(memo[index])
        elif what == _PUSH:
            pos += width_of[op]
            stack.append(_NONE if op == 78 else _OTHER)  # 78: NONE
        elif what == _PUT:
            w = width_of[op]
            if w:
                index = from_bytes(data[pos : pos + w], "little")
                pos += w
            else:
                nl = line(pos)
                index = int(data[pos:nl])
                pos = nl + 1
            if index < 0 or index > limit:
                raise CorruptCheckpointError(
                    f"{path}: pickle memo index {index} at byte {pos - 1 - (w or 0)} exceeds the stream's {limit} bytes: "
                    "a hostile pickle (it would make the unpickler allocate gigabytes)"
                )
            if len(stack) <= fence:
                raise pickle.UnpicklingError("stack underflow")
            memo[index] = stack[-1]
        elif what == _MARK:
            marks.append(len(stack))
            fence = len(stack)
        elif what == _EMPTY_FRESH:
            fresh += 2
            stack.append(fresh)
            if op == 125:  # EMPTY_DICT
                dicts.add(fresh)
        elif what == _SETITEMS or what == _APPENDS or what == _ADDITEMS:
            k = marks.pop()
            fence = marks[-1] if marks else 0
            if k < 1 or k - 1 < fence:
                raise pickle.UnpicklingError("stack underflow")
            target = stack[k - 1]
            if target < _FRESH:
                raise _Refused(pickle_name(op))
            if what == _SETITEMS and any(key < 0 and not key & 1 for key in stack[k::2]):
                dunder.add(target)
            del stack[k:]
        elif what == _BUILD:
            if len(stack) - 2 < fence:
                raise pickle.UnpicklingError("stack underflow")
            state = stack.pop()
            target = stack[-1]
            if target < _FRESH:
                raise _Refused("BUILD")
            if not target & 1 and state != _NONE and (state not in dicts or state in dunder):
                raise _Refused("BUILD state")  # would set dunder attributes or slots: only a __setstate__ may
        elif what == _NEWOBJ:
            if len(stack) - 2 < fence:
                raise pickle.UnpicklingError("stack underflow")
            stack.pop()
            stack[-1] = called(stack[-1], _OTHER)
        elif what == _REDUCE:
            if len(stack) - 2 < fence:
                raise pickle.UnpicklingError("stack underflow")
            args = stack.pop()
            stack[-1] = called(stack[-1], args)
        elif what == _TUPLE1:
            if len(stack) <= fence:
                raise pickle.UnpicklingError("stack underflow")
            stack[-1] = _OTHER
        elif what == _TUPLE2:
            if len(stack) - 2 < fence:
                raise pickle.UnpicklingError("stack underflow")
            stack.pop()
            stack[-1] = _PAIR
        elif what == _TUPLE3:
            if len(stack) - 3 < fence:
                raise pickle.UnpicklingError("stack underflow")
            first = stack[-3]
            del stack[-2:]
            stack[-1] = _triple(first)
        elif what == _TUPLE:
            k = marks.pop()
            fence = marks[-1] if marks else 0
            n = len(stack) - k
            tag = _PAIR if n == 2 else _triple(stack[k]) if n == 3 else _OTHER
            del stack[k:]
            stack.append(tag)
        elif what == _STACK_GLOBAL:
            if len(stack) - 2 < fence:
                raise pickle.UnpicklingError("stack underflow")
            name, module = string(stack.pop()), string(stack[-1])
            stack[-1] = kind(module, name) if module is not None and name is not None else _OTHER
        elif what == _GLOBAL or what == _INST:
            first = line(pos)
            second = line(first + 1)
            tag = kind(data[pos:first].decode("utf-8"), data[first + 1 : second].decode("utf-8"))
            pos = second + 1
            if what == _INST:
                k = marks.pop()
                fence = marks[-1] if marks else 0
                del stack[k:]
                tag = called(tag, _OTHER)
            stack.append(tag)
        elif what == _DICT or what == _LIST or what == _FROZENSET:
            k = marks.pop()
            fence = marks[-1] if marks else 0
            if what == _DICT and (len(stack) - k) & 1:
                raise pickle.UnpicklingError("odd number of items for DICT")
            keyed = what == _DICT and any(key < 0 and not key & 1 for key in stack[k::2])
            del stack[k:]
            fresh += 2
            stack.append(_OTHER if what == _FROZENSET else fresh)
            if what == _DICT:
                dicts.add(fresh)
                if keyed:
                    dunder.add(fresh)
        elif what == _SETITEM:
            if len(stack) - 3 < fence:
                raise pickle.UnpicklingError("stack underflow")
            key = stack[-2]
            del stack[-2:]
            if stack[-1] < _FRESH:
                raise _Refused("SETITEM")
            if key < 0 and not key & 1:
                dunder.add(stack[-1])
        elif what == _APPEND:
            if len(stack) - 2 < fence:
                raise pickle.UnpicklingError("stack underflow")
            stack.pop()
            if stack[-1] < _FRESH:
                raise _Refused("APPEND")
        elif what == _BYTES or what == _BYTEARRAY:
            w = width_of[op]
            n = from_bytes(data[pos : pos + abs(w)], "little", signed=w < 0)
            pos += abs(w) + n
            if n < 0 or pos > end:
                raise pickle.UnpicklingError(f"a length of {n} bytes runs past the end of the stream")
            if what == _BYTEARRAY:
                fresh += 2
                stack.append(fresh)
            else:
                stack.append(_OTHER)
        elif what == _LINE_PUSH or what == _PERSID:
            pos = line(pos) + 1
            stack.append(_OTHER)
        elif what == _BINPERSID:
            if len(stack) <= fence:
                raise pickle.UnpicklingError("stack underflow")
            stack[-1] = _OTHER
        elif what == _POP:
            if len(stack) > fence:
                stack.pop()
            elif marks:
                marks.pop()
                fence = marks[-1] if marks else 0
            else:
                raise pickle.UnpicklingError("stack underflow")
        elif what == _POP_MARK:
            k = marks.pop()
            fence = marks[-1] if marks else 0
            del stack[k:]
        elif what == _DUP:
            if len(stack) <= fence:
                raise pickle.UnpicklingError("stack underflow")
            stack.append(stack[-1])
        elif what == _NEWOBJ_EX:
            if len(stack) - 3 < fence:
                raise pickle.UnpicklingError("stack underflow")
            del stack[-2:]
            stack[-1] = called(stack[-1], _OTHER)
        elif what == _OBJ:
            k = marks.pop()
            fence = marks[-1] if marks else 0
            cls = stack[k]
            del stack[k:]
            stack.append(called(cls, _OTHER))
        elif what == _PROTO:
            if data[pos] > pickle.HIGHEST_PROTOCOL:
                raise pickle.UnpicklingError(f"unsupported pickle protocol: {data[pos]}")
            pos += 1
        elif what == _FRAME:
            n = from_bytes(data[pos : pos + 8], "little")
            pos += 8
            if pos + n > end:
                raise pickle.UnpicklingError(f"a frame of {n} bytes runs past the end of the stream")
        elif what == _STOP:
            if len(stack) <= fence:
                raise pickle.UnpicklingError("stack underflow")
            return pos
        else:
            raise pickle.UnpicklingError(f"opcode {op:#04x} is not accepted")
        if pos > end:
            raise pickle.UnpicklingError("pickle data was truncated")


def _triple(first: int) -> int:
    """A 3-tuple: ``(cls, base, state)`` for ``copyreg._reconstructor`` when ``cls`` is a class."""
    if first == _FACTORY_SETSTATE:
        return _TRIPLE_SETSTATE
    return _TRIPLE if first == _FACTORY else _OTHER


def pickle_name(op: int) -> str:
    """The opcode's name, for messages."""
    for name in ("SETITEMS", "APPENDS", "ADDITEMS"):
        if getattr(pickle, name)[0] == op:
            return name
    return f"opcode {op:#04x}"
