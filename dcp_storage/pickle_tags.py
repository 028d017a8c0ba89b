"""The vocabulary of :mod:`dcp_storage.pickle_guard`'s abstract interpreter: stack tags and the opcode table.

Private to the guard (its one user): the tags it gives stack entries (which objects this load created, and
how they may be mutated), the marks of strings that could name dunders or container methods, and the
dispatch table of opcode kinds and argument widths that the walk's hot loop indexes.
"""

from __future__ import annotations

import codecs
import collections
import copyreg
import enum
import pickle
from typing import Any

# -- tags. Fresh objects get unique tags >= _FRESH, multiples of 4 plus: 0 (no __setstate__ of their own),
# 1 (one), 2 (a container subclass without one: its instances inherit methods a plain key could hide).
(
    _OTHER,
    _FACTORY,
    _FACTORY_SETSTATE,
    _RECONSTRUCTOR,
    _NONE,
    _PAIR,
    _TRIPLE,
    _TRIPLE_SETSTATE,
    _FACTORY_CONTAINER,
    _TRIPLE_CONTAINER,
) = range(10)
_FRESH = 16
# What calling a tag's object returns: a fresh object tagged ``fresh + offset``; any other callable, _OTHER.
_CALL_OFFSET = {_FACTORY: 0, _FACTORY_SETSTATE: 1, _FACTORY_CONTAINER: 2}
# Strings (candidates for STACK_GLOBAL) are negative: -1 - opcode position; "__dunder__" ones a further
# _DUNDER lower and names of container methods (_SHADOW_NAMES) a further _SHADOW lower, so "is any key a
# dunder" (or a method name) is one C-speed min() over the keys, and a key that is neither costs one compare.
_DUNDER = 1 << 62
_SHADOW = 1 << 61
_CONTAINERS = (dict, list, set, collections.deque)
_SHADOW_NAMES = frozenset(
    name.encode()
    for cls in (*_CONTAINERS, collections.OrderedDict, collections.Counter, collections.defaultdict)
    for name in dir(cls)
    if not name.startswith("__")
)
# Last byte -> lengths of the method names ending in it: most strings (key names, file names) are told apart
# by one index and one small-set lookup, without slicing them. The last byte always exists (for an empty
# string it is the length field's), so the test needs no bounds check.
_SHADOW_ENDS = tuple(frozenset(len(n) for n in _SHADOW_NAMES if n[-1] == byte) for byte in range(256))

# -- dispatch codes, roughly in order of frequency in real pickles (the loop tests them in this order)
(
    _MEMOIZE,
    _BINGET,
    _STR,
    _PUSH,
    _BINPUT,
    _MARK,
    _EMPTY,
    _NEWOBJ,
    _BUILD,
    _SETITEMS,
    _REDUCE,
    _TUPLE1,
    _TUPLE2,
    _STACK_GLOBAL,
    _LONG_BINPUT,
    _APPENDS,
    _TUPLE,
    _TUPLE3,
    _EMPTY_DICT,
    _BYTES,
    _SETITEM,
    _APPEND,
    _ADDITEMS,
    _DICT,
    _LIST,
    _FROZENSET,
    _GLOBAL,
    _INST,
    _OBJ,
    _NEWOBJ_EX,
    _LINE,
    _PERSID,
    _BINPERSID,
    _PUT,
    _GET,
    _POP,
    _POP_MARK,
    _DUP,
    _PROTO,
    _FRAME,
    _BYTEARRAY,
    _STOP,
    _BAD,
) = range(43)

_OPS: dict[int, tuple[str, int]] = {  # dispatch code -> "OPCODE NAMES", argument width
    _MEMOIZE: ("MEMOIZE", 0),
    _BINGET: ("BINGET LONG_BINGET", 0),
    _GET: ("GET", 0),
    _BINPUT: ("BINPUT", 1),
    _LONG_BINPUT: ("LONG_BINPUT", 4),
    _PUT: ("PUT", 0),
    _MARK: ("MARK", 0),
    _EMPTY: ("EMPTY_LIST EMPTY_SET", 0),
    _EMPTY_DICT: ("EMPTY_DICT", 0),
    _NEWOBJ: ("NEWOBJ", 0),
    _BUILD: ("BUILD", 0),
    _SETITEMS: ("SETITEMS", 0),
    _REDUCE: ("REDUCE", 0),
    _TUPLE1: ("TUPLE1", 0),
    _TUPLE2: ("TUPLE2", 0),
    _TUPLE3: ("TUPLE3", 0),
    _TUPLE: ("TUPLE", 0),
    _STACK_GLOBAL: ("STACK_GLOBAL", 0),
    _APPENDS: ("APPENDS", 0),
    _SETITEM: ("SETITEM", 0),
    _APPEND: ("APPEND", 0),
    _ADDITEMS: ("ADDITEMS", 0),
    _DICT: ("DICT", 0),
    _LIST: ("LIST", 0),
    _FROZENSET: ("FROZENSET", 0),
    _GLOBAL: ("GLOBAL", 0),
    _INST: ("INST", 0),
    _OBJ: ("OBJ", 0),
    _NEWOBJ_EX: ("NEWOBJ_EX", 0),
    _PERSID: ("PERSID", 0),
    _LINE: ("INT LONG FLOAT STRING UNICODE", 0),
    _BINPERSID: ("BINPERSID", 0),
    _POP: ("POP", 0),
    _POP_MARK: ("POP_MARK", 0),
    _DUP: ("DUP", 0),
    _PROTO: ("PROTO", 1),
    _FRAME: ("FRAME", 8),
    _STOP: ("STOP", 0),
}


def _table() -> tuple[list[int], list[int]]:
    """Opcode -> (dispatch code, argument width: fixed bytes, or the bytes of a length; negative: signed)."""
    code, width = [_BAD] * 256, [0] * 256  # NEXT_BUFFER, READONLY_BUFFER (out-of-band buffers) stay _BAD
    rows = [(c, names, w) for c, (names, w) in _OPS.items()] + [
        (_PUSH, "NONE NEWTRUE NEWFALSE EMPTY_TUPLE", 0),
        (_PUSH, "BININT1 EXT1", 1),
        (_PUSH, "BININT2 EXT2", 2),
        (_PUSH, "BININT EXT4", 4),
        (_PUSH, "BINFLOAT", 8),
        (_STR, "SHORT_BINUNICODE", 1),
        (_STR, "BINUNICODE", 4),
        (_STR, "BINUNICODE8", 8),
        (_BYTES, "SHORT_BINBYTES SHORT_BINSTRING LONG1", 1),
        (_BYTES, "BINBYTES", 4),
        (_BYTES, "BINSTRING LONG4", -4),
        (_BYTES, "BINBYTES8", 8),
        (_BYTEARRAY, "BYTEARRAY8", 8),
    ]  # EXT codes resolve through find_class: like any global, not created by this load
    for what, names, w in rows:
        for name in names.split():
            op = getattr(pickle, name)[0]
            code[op], width[op] = what, w
    return code, width


_CODE, _WIDTH = _table()
_TEXT_STRINGS = frozenset((pickle.STRING[0], pickle.UNICODE[0]))
_BINSTRINGS = frozenset((pickle.SHORT_BINSTRING[0], pickle.BINSTRING[0]))  # str under the default encoding


def _text_mark(op: int, raw: bytes) -> int:
    """:data:`_DUNDER` if a STRING (quoted, escaped) or UNICODE (raw-unicode-escape) line decodes to
    ``"__x__"``, :data:`_SHADOW` if to a container method's name, else 0."""
    try:
        if op == pickle.UNICODE[0]:
            text = raw.decode("raw_unicode_escape")
        else:
            text = codecs.escape_decode(raw.strip()[1:-1])[0].decode("latin-1")  # type: ignore[attr-defined]
    except (UnicodeDecodeError, ValueError):
        return _DUNDER  # the unpickler refuses it anyway; judging it a dunder is the safe side
    if len(text) >= 4 and text.startswith("__") and text.endswith("__"):
        return _DUNDER
    return _SHADOW if text.encode("utf-8", "surrogatepass") in _SHADOW_NAMES else 0


def _kind(obj: Any) -> int:
    """The tag of an allow-listed global: may calling it yield a new object, and does that have a
    ``__setstate__`` of its own?"""
    if obj is copyreg._reconstructor:
        return _RECONSTRUCTOR
    if not isinstance(obj, type) or obj is type or issubclass(obj, (enum.Enum, type)):
        return _OTHER  # functions and stand-ins may return shared objects; Enum(value) returns a member
    if type(obj).__call__ is not type.__call__:
        return _OTHER  # a metaclass that decides what a call returns
    if getattr(obj, "__setstate__", None) is not None:
        return _FACTORY_SETSTATE
    return _FACTORY_CONTAINER if issubclass(obj, _CONTAINERS) and obj not in _CONTAINERS else _FACTORY


def _triple(first: int, second: int) -> int:
    """A 3-tuple: ``(cls, base, state)`` for ``copyreg._reconstructor`` when ``cls`` and ``base`` are plain
    classes (whose ``__new__`` makes a new object; an enum class's returns an existing member)."""
    if second not in (_FACTORY, _FACTORY_SETSTATE, _FACTORY_CONTAINER):
        return _OTHER
    if first == _FACTORY_SETSTATE:
        return _TRIPLE_SETSTATE
    return _TRIPLE if first == _FACTORY else _TRIPLE_CONTAINER if first == _FACTORY_CONTAINER else _OTHER


def pickle_name(op: int) -> str:
    """The opcode's name, for messages."""
    return next(name for name in ("SETITEMS", "APPENDS", "ADDITEMS") if getattr(pickle, name)[0] == op)
