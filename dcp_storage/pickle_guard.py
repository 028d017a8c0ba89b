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
* ``BUILD`` on an instance of a container subclass (``OrderedDict``) with a key that names a method of
  the builtin containers (``items``, ``keys``, ``get``, ...): an instance attribute hides the method, so
  ``d.items()`` returns what the stream chose while ``d[key]`` still sees the real entries (a
  ``.metadata`` whose maps hide ``items`` passes every check that iterates them);
* every length, memo index and frame that reaches past the end of the stream (so nothing is allocated
  for it), unknown opcodes, out-of-band buffers, and anything it cannot parse the way the C unpickler
  does (text pickles included): a stream is accepted only if the walk understood all of it.

A callable's result counts as created by this load only when the callable is a class whose instances
are new objects (not an ``Enum``, whose call returns a shared member, nor a class with a custom
metaclass ``__call__``) or ``copyreg._reconstructor``. Cost: ~0.2 us an opcode in pure Python, paid
once per ``.metadata`` or ``data.pkl`` decode (the per-record fast path,
:mod:`~dcp_storage.formats.dcp_native.records`, has no mutating opcodes at all).

Errors: :class:`pickle.UnpicklingError` for malformed or truncated streams (as the C unpickler would
raise; callers that read a stream in pieces rely on it),
:class:`~dcp_storage.errors.CorruptCheckpointError` for memo bombs,
:class:`~dcp_storage.errors.UnsafeCheckpointError` for mutations it refuses.

The walk is a single hot loop (kept in one function for speed); its vocabulary, the stack tags and the
opcode dispatch table, is in :mod:`dcp_storage.pickle_tags`, private to it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from dcp_storage.errors import CorruptCheckpointError, UnsafeCheckpointError
from dcp_storage.pickle_tags import (  # noqa: F401 (the walk's vocabulary)
    _ADDITEMS,
    _APPEND,
    _APPENDS,
    _BINGET,
    _BINPERSID,
    _BINPUT,
    _BINSTRINGS,
    _BUILD,
    _BYTEARRAY,
    _BYTES,
    _CALL_OFFSET,
    _CODE,
    _DICT,
    _DUNDER,
    _DUP,
    _EMPTY,
    _EMPTY_DICT,
    _FRAME,
    _FRESH,
    _FROZENSET,
    _GET,
    _GLOBAL,
    _INST,
    _LINE,
    _LIST,
    _LONG_BINPUT,
    _MARK,
    _MEMOIZE,
    _NEWOBJ,
    _NEWOBJ_EX,
    _NONE,
    _OBJ,
    _OTHER,
    _PAIR,
    _PERSID,
    _POP,
    _POP_MARK,
    _PROTO,
    _PUSH,
    _PUT,
    _RECONSTRUCTOR,
    _REDUCE,
    _SETITEM,
    _SETITEMS,
    _SHADOW,
    _SHADOW_ENDS,
    _SHADOW_NAMES,
    _STACK_GLOBAL,
    _STOP,
    _STR,
    _TEXT_STRINGS,
    _TRIPLE,
    _TRIPLE_CONTAINER,
    _TRIPLE_SETSTATE,
    _TUPLE,
    _TUPLE1,
    _TUPLE2,
    _TUPLE3,
    _WIDTH,
    _kind,
    _text_mark,
    _triple,
    pickle_name,
)

__all__ = ["MISSING", "guard_pickle"]

MISSING = object()  # what ``resolve`` returns for a global outside the allow-list


class _Refused(Exception):
    pass


def guard_pickle(
    data: bytes, start: int, path: str, resolve: Callable[[str, str], Any], *, check_state: bool = True
) -> int:
    """Check the pickle that starts at ``data[start]``; return the position just after its ``STOP``.

    ``resolve(module, name)`` is the allow-list: the object the unpickler's ``find_class`` will return,
    or :data:`MISSING` (then not created by this load), or it raises the unpickler's own refusal.
    ``check_state=False`` checks sizes and parsing only, for streams the user chose to trust with any
    global (state on what a trusted function returned is then theirs to judge).
    """
    try:
        return _walk(data, start, path, resolve, check_state)
    except (UnsafeCheckpointError, CorruptCheckpointError, pickle.UnpicklingError):
        raise
    except _Refused as refused:
        raise UnsafeCheckpointError(
            path,
            str(refused),
            "a pickle may set state only on objects it created, dunder or slot state only through __setstate__, "
            "and no attribute that hides a container's method",
        ) from None
    except (IndexError, KeyError, ValueError, UnicodeDecodeError):
        raise pickle.UnpicklingError("malformed or truncated pickle") from None


def _walk(data: bytes, start: int, path: str, resolve: Callable[[str, str], Any], strict: bool) -> int:
    """The abstract interpretation. Stack underflows are not checked: the C unpickler raises at that
    same opcode, so nothing after it runs, and every opcode before it was checked on the same stack."""
    code_of, width_of, from_bytes = _CODE, _WIDTH, int.from_bytes
    shadow, shadow_ends, shadow_names = -_SHADOW, _SHADOW_ENDS, _SHADOW_NAMES  # locals: read per string
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    dicts: set[int] = set()  # fresh dicts built by DICT / EMPTY_DICT: every key they get is seen here
    dunder: set[int] = set()  # fresh objects that got a "__x__" key
    shadowy: set[int] = set()  # fresh objects that got a key naming a container method
    kinds: dict[tuple[str, str], int] = {}
    fresh = _FRESH
    call_offset = _CALL_OFFSET.get
    end = len(data)
    limit = end - start  # no memo index, length or frame can exceed the stream
    pos = start

    def kind(module: str, name: str) -> int:
        key = (module, name)
        found = kinds.get(key)
        if found is None:
            obj = resolve(module, name)
            found = kinds[key] = _OTHER if obj is MISSING else _kind(obj)
        return found

    def called(what: int) -> int:  # what a call of ``what`` returns (INST, OBJ, NEWOBJ_EX: rare)
        nonlocal fresh
        fresh += 4
        offset = call_offset(what)
        return _OTHER if offset is None else fresh + offset

    def marked(m: int, target: int) -> None:  # a key of mark ``m`` (a tag) was added to ``target``
        if m <= -_DUNDER:
            dunder.add(target)
        elif m <= -_SHADOW:
            shadowy.add(target)

    def string(tag: int) -> str | None:
        if tag >= 0:
            return None
        at = -1 - (tag if tag > -_SHADOW else tag + _SHADOW if tag > -_DUNDER else tag + _DUNDER)
        w = width_of[data[at]]
        n = from_bytes(data[at + 1 : at + 1 + w], "little")
        return data[at + 1 + w : at + 1 + w + n].decode("utf-8", "surrogatepass")

    def put(index: int, at: int) -> None:
        if index < 0 or index > limit:
            raise CorruptCheckpointError(
                f"{path}: pickle memo index {index} at byte {at} exceeds the stream's {limit} bytes: "
                "a hostile pickle (it would make the unpickler allocate gigabytes)"
            )
        memo[index] = stack[-1]

    def line(at: int) -> int:
        nl = data.find(b"\n", at)
        if nl < 0:
            raise pickle.UnpicklingError("pickle data was truncated")
        return nl

    while pos < end:
        op = data[pos]
        what = code_of[op]
        pos += 1
        if what == _MEMOIZE:
            memo[len(memo)] = stack[-1]
        elif what == _BINGET:
            if op == 104:  # BINGET
                stack.append(memo[data[pos]])
                pos += 1
            else:
                stack.append(memo[from_bytes(data[pos : pos + 4], "little")])
                pos += 4
        elif what == _PUSH:
            pos += width_of[op]
            stack.append(_NONE if op == 78 else _OTHER)  # 78: NONE
        elif what == _MARK:
            marks.append(len(stack))
        elif what == _NEWOBJ:
            del stack[-1]
            fresh += 4  # called(), inline: a call per object costs ~5% of the walk
            offset = call_offset(stack[-1])
            stack[-1] = _OTHER if offset is None else fresh + offset
        elif what == _BUILD:
            state = stack.pop()
            target = stack[-1]
            if target < _FRESH and strict:
                raise _Refused("BUILD on an object the stream did not create")
            if strict and not target & 1 and state != _NONE:
                if state not in dicts or state in dunder:
                    raise _Refused("BUILD with dunder or slot state")  # only a class's own __setstate__ may
                if target & 2 and state in shadowy:
                    raise _Refused("BUILD with state that hides a method of a container")
        elif what == _SETITEMS or what == _APPENDS or what == _ADDITEMS:
            k = marks.pop()
            target = stack[k - 1] if k else _OTHER
            if target < _FRESH and strict:
                raise _Refused(f"{pickle_name(op)} on an object the stream did not create")
            if what == _SETITEMS and len(stack) > k:
                key = min(stack[k::2])
                if key <= shadow:
                    marked(key, target)
            del stack[k:]
        elif what == _EMPTY or what == _EMPTY_DICT:
            fresh += 4
            stack.append(fresh)
            if what == _EMPTY_DICT:
                dicts.add(fresh)
        elif what == _TUPLE1:
            stack[-1] = _OTHER
        elif what == _REDUCE:
            args = stack.pop()
            func = stack[-1]
            if func == _RECONSTRUCTOR:  # copyreg._reconstructor(cls, base, state): base.__new__(cls, state)
                # new only when cls and base are plain classes: Enum.__new__ returns the shared member
                fresh += 4
                tag = fresh + 1 if args == _TRIPLE_SETSTATE else fresh if args == _TRIPLE else _OTHER
                stack[-1] = fresh + 2 if args == _TRIPLE_CONTAINER else tag
            else:  # called(), inline
                fresh += 4
                offset = call_offset(func)
                stack[-1] = _OTHER if offset is None else fresh + offset
        elif what == _TUPLE2:
            del stack[-1]
            stack[-1] = _PAIR
        elif what == _STR:
            w = width_of[op]
            n = from_bytes(data[pos : pos + w], "little")
            s = pos + w
            pos = s + n
            if pos > end:
                raise pickle.UnpicklingError(f"a string of {n} bytes runs past the end of the stream")
            if n >= 4 and data[s] == 95 == data[s + 1] == data[pos - 1] == data[pos - 2]:  # "__x__"
                stack.append(-_DUNDER - s + w)
            elif n in shadow_ends[data[pos - 1]] and data[s:pos] in shadow_names:
                stack.append(shadow - s + w)
            else:
                stack.append(-s + w)
        elif what == _BINPUT:
            put(data[pos], pos - 1)
            pos += 1
        elif what == _STACK_GLOBAL:
            name, module = string(stack.pop()), string(stack[-1])
            stack[-1] = kind(module, name) if module is not None and name is not None else _OTHER
        elif what == _GET:
            nl = line(pos)
            stack.append(memo[int(data[pos:nl])])
            pos = nl + 1
        elif what == _LONG_BINPUT or what == _PUT:
            if what == _PUT:
                nl = line(pos)
                put(int(data[pos:nl]), pos - 1)
                pos = nl + 1
            else:
                put(from_bytes(data[pos : pos + 4], "little"), pos - 1)
                pos += 4
        elif what == _TUPLE or what == _TUPLE3:
            k = marks.pop() if what == _TUPLE else len(stack) - 3
            n = len(stack) - k
            tag = _PAIR if n == 2 else _triple(stack[k], stack[k + 1]) if n == 3 else _OTHER
            del stack[k:]
            stack.append(tag)
        elif what == _BYTES or what == _BYTEARRAY:
            w = width_of[op]
            n = from_bytes(data[pos : pos + abs(w)], "little", signed=w < 0)
            pos += abs(w) + n
            if n < 0 or pos > end:
                raise pickle.UnpicklingError(f"a length of {n} bytes runs past the end of the stream")
            fresh += 4
            if op not in _BINSTRINGS:
                stack.append(fresh if what == _BYTEARRAY else _OTHER)
            elif n >= 4 and data[pos - n : pos - n + 2] == b"__" == data[pos - 2 : pos]:
                stack.append(-_DUNDER - pos)  # str on Python 3: a possible "__x__" key (never a global name)
            elif n in shadow_ends[data[pos - 1]] and data[pos - n : pos] in shadow_names:
                stack.append(shadow - pos)
            else:
                stack.append(_OTHER)
        elif what == _SETITEM:
            key = stack[-2]
            del stack[-2:]
            if stack[-1] < _FRESH and strict:
                raise _Refused("SETITEM on an object the stream did not create")
            if key <= shadow:
                marked(key, stack[-1])
        elif what == _APPEND:
            del stack[-1]
            if stack[-1] < _FRESH and strict:
                raise _Refused("APPEND on an object the stream did not create")
        elif what == _DICT or what == _LIST or what == _FROZENSET:
            k = marks.pop()
            if what == _DICT and (len(stack) - k) & 1:
                raise pickle.UnpicklingError("odd number of items for DICT")
            key = min(stack[k::2]) if what == _DICT and len(stack) > k else 0
            del stack[k:]
            fresh += 4
            stack.append(_OTHER if what == _FROZENSET else fresh)
            if what == _DICT:
                dicts.add(fresh)
                if key <= shadow:
                    marked(key, fresh)
        elif what == _GLOBAL or what == _INST:
            first = line(pos)
            second = line(first + 1)
            tag = kind(data[pos:first].decode("utf-8"), data[first + 1 : second].decode("utf-8"))
            pos = second + 1
            if what == _INST:
                del stack[marks.pop() :]
                tag = called(tag)
            stack.append(tag)
        elif what == _OBJ:
            k = marks.pop()
            cls = stack[k]
            del stack[k:]
            stack.append(called(cls))
        elif what == _NEWOBJ_EX:
            del stack[-2:]
            stack[-1] = called(stack[-1])
        elif what == _LINE or what == _PERSID:
            nl = line(pos)
            mark = _text_mark(op, data[pos:nl]) if op in _TEXT_STRINGS else 0
            pos = nl + 1
            stack.append(-mark - pos if mark else _OTHER)  # text strings can be "__x__" or method-name keys too
        elif what == _BINPERSID:
            stack[-1] = _OTHER
        elif what == _POP:
            if len(stack) > (marks[-1] if marks else 0):
                del stack[-1]
            else:
                marks.pop()
        elif what == _POP_MARK:
            del stack[marks.pop() :]
        elif what == _DUP:
            stack.append(stack[-1])
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
            if not stack:
                raise pickle.UnpicklingError("STOP with an empty stack")
            return pos
        else:
            raise pickle.UnpicklingError(f"opcode {op:#04x} is not accepted")
    raise pickle.UnpicklingError("pickle data was truncated")
