"""Allow-list unpickling: the only way this project turns pickle bytes into objects.

``pickle.load`` resolves any global the stream names and calls it, so a checkpoint could run code on the
machine that opens it. :class:`AllowListUnpickler` resolves only ``(module, name)`` pairs it was given and
raises :class:`~dcp_storage.errors.UnsafeCheckpointError` for anything else *before* resolving it: the
payload never runs.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pickle
import pickletools
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["AllowListUnpickler", "StandInRefusal", "safe_loads"]


class StandInRefusal(Exception):
    """Raised by an allow-listed stand-in (a restricted ``getattr``, say) for arguments it refuses.

    :class:`AllowListUnpickler` turns it into :class:`~dcp_storage.errors.UnsafeCheckpointError` naming
    the file, which the stand-in does not know.
    """

    def __init__(self, forbidden: str, detail: str) -> None:
        super().__init__(forbidden, detail)
        self.forbidden = forbidden
        self.detail = detail


class AllowListUnpickler(pickle.Unpickler):
    """An unpickler that resolves only allow-listed globals.

    ``allowed`` maps ``(module, name)`` to the object to return for it (the real class, or a stand-in).
    ``persistent_load`` may be given for formats that use persistent ids (torch.save's storages);
    without it a persistent id is refused.

    A stream could also use ``BUILD`` to set attributes on an allow-listed class or function itself
    (rewiring, say, ``PosixPath.__new__`` for the whole process). :meth:`load` snapshots the attributes
    of every allow-listed object that has any, and if the stream changed one, restores it and raises
    :class:`~dcp_storage.errors.UnsafeCheckpointError`. (The C unpickler cannot intercept ``BUILD``; the
    pure-Python one could, but is ~10x slower on large metadata.)
    """

    def __init__(
        self,
        file: io.BufferedIOBase | io.BytesIO,
        path: str,
        allowed: dict[tuple[str, str], Any],
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(file)
        self._stream = file
        self._path = path
        self._allowed = allowed
        self._persistent = persistent_load

    def load(self) -> Any:
        if isinstance(self._stream, io.BytesIO):
            _check_memo_indices(self._stream, self._path)
        snapshot = _snapshot(self._allowed.values())
        try:
            with _gc_paused():
                return super().load()
        except StandInRefusal as refusal:
            raise UnsafeCheckpointError(self._path, refusal.forbidden, refusal.detail) from None
        finally:
            changed = _restore(snapshot)
            if changed:
                raise UnsafeCheckpointError(self._path, changed, "the stream tried to modify it; it was restored")

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(self._path, f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafeCheckpointError(self._path, "persistent id", f"unexpected persistent id {pid!r}")
        return self._persistent(pid)


_FUNCTION_ATTRS = ("__defaults__", "__kwdefaults__", "__code__")
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _check_memo_indices(stream: io.BytesIO, path: str) -> None:
    """Refuse a pickle whose memo indices exceed its length, before the C unpickler sees them.

    ``LONG_BINPUT 0x3fffffff`` (6 bytes) makes CPython's unpickler grow its memo array to twice that
    index and clear every slot: gigabytes from a few bytes, and on a machine that overcommits memory the
    OOM killer ends the process instead of a ``MemoryError``. A real pickler numbers its memo from 0, so
    an index can never exceed the number of opcodes, hence the stream's length. Walks the opcodes only
    (``pickletools.genops``: nothing is resolved or built); a malformed stream is left to the unpickler,
    which reports it.
    """
    start = stream.tell()
    view = stream.getbuffer()
    try:
        data = bytes(view[start:])
    finally:
        view.release()
    limit = len(data)
    fast = _memo_puts_fast(data, limit)
    if fast is not None:
        if fast[0] >= 0:
            raise CorruptCheckpointError(
                f"{path}: pickle memo index {fast[1]} at byte {start + fast[0]} exceeds the stream's {limit} bytes: "
                "a hostile pickle (it would make the unpickler allocate gigabytes)"
            )
        return
    try:
        for opcode, arg, pos in pickletools.genops(data):
            if opcode.name in _MEMO_PUTS and isinstance(arg, int) and not 0 <= arg <= limit:
                raise CorruptCheckpointError(
                    f"{path}: pickle memo index {arg} at byte {start + pos} exceeds the stream's {limit} bytes: "
                    "a hostile pickle (it would make the unpickler allocate gigabytes)"
                )
    except CorruptCheckpointError:
        raise
    except Exception:  # noqa: BLE001 - malformed opcodes: the unpickler's own error names them
        return


def _ops(*names: str) -> list[int]:
    return [getattr(pickle, name)[0] for name in names]


# Opcode -> bytes of its fixed-size argument, for the binary opcodes real picklers (torch.save, DCP's
# metadata) emit; _COUNTED: opcode -> width of the little-endian length that precedes its bytes.
_FIXED: dict[int, int] = {
    **dict.fromkeys(
        _ops("MARK", "STOP", "POP", "POP_MARK", "DUP", "NONE", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "APPEND",
             "APPENDS", "BUILD", "DICT", "LIST", "TUPLE", "REDUCE", "SETITEM", "SETITEMS", "BINPERSID", "TUPLE1",
             "TUPLE2", "TUPLE3", "NEWTRUE", "NEWFALSE", "NEWOBJ", "NEWOBJ_EX", "EMPTY_SET", "ADDITEMS", "FROZENSET",
             "STACK_GLOBAL", "MEMOIZE", "OBJ", "NEXT_BUFFER", "READONLY_BUFFER"),
        0,
    ),
    **dict.fromkeys(_ops("BINGET", "BINPUT", "BININT1", "PROTO", "EXT1"), 1),
    **dict.fromkeys(_ops("BININT2", "EXT2"), 2),
    **dict.fromkeys(_ops("BININT", "LONG_BINGET", "EXT4"), 4),
    **dict.fromkeys(_ops("BINFLOAT", "FRAME"), 8),
}
_COUNTED: dict[int, int] = {
    **dict.fromkeys(_ops("SHORT_BINUNICODE", "SHORT_BINBYTES", "SHORT_BINSTRING", "LONG1"), 1),
    **dict.fromkeys(_ops("BINUNICODE", "BINSTRING", "BINBYTES", "LONG4"), 4),
    **dict.fromkeys(_ops("BINUNICODE8", "BINBYTES8", "BYTEARRAY8"), 8),
}
_STOP_STEP, _LONG_BINPUT_STEP, _GLOBAL_STEP, _UNKNOWN_STEP = -1, -2, -3, -4


def _steps() -> list[int]:
    """Opcode -> what the walk does: skip n >= 0 argument bytes, or one of the ``*_STEP`` actions, or
    ``-10 - width`` for an argument of ``width``-byte little-endian length plus that many bytes."""
    steps = [_UNKNOWN_STEP] * 256
    for op, size in _FIXED.items():
        steps[op] = size
    for op, width in _COUNTED.items():
        steps[op] = -10 - width
    steps[pickle.STOP[0]] = _STOP_STEP
    steps[pickle.LONG_BINPUT[0]] = _LONG_BINPUT_STEP
    steps[pickle.GLOBAL[0]] = _GLOBAL_STEP
    return steps


_STEPS = _steps()


def _memo_puts_fast(data: bytes, limit: int) -> tuple[int, int] | None:
    """Walk the binary opcodes of ``data``, checking every ``LONG_BINPUT`` index, without decoding arguments.

    About 40x faster than :func:`pickletools.genops` (~0.1 us an opcode: 4 ms for the 36k opcodes of a
    2 GiB checkpoint's ``.metadata``). Returns ``(-1, 0)`` when every index is fine, ``(pos, index)`` for
    the first index beyond ``limit``, and ``None`` on anything it does not know (text-protocol opcodes, a
    truncated argument): the caller then walks the stream with ``genops``.
    """
    steps = _STEPS
    pos, end = 0, len(data)
    while pos < end:
        step = steps[data[pos]]
        pos += 1
        if step >= 0:
            pos += step
        elif step <= -10:
            width = -10 - step
            if pos + width > end:
                return None
            length = int.from_bytes(data[pos : pos + width], "little", signed=True)
            if length < 0:
                return None
            pos += width + length
        elif step == _STOP_STEP:
            return (-1, 0)
        elif step == _LONG_BINPUT_STEP:
            if pos + 4 > end:
                return None
            index = int.from_bytes(data[pos : pos + 4], "little")
            if index > limit:
                return (pos - 1, index)
            pos += 4
        elif step == _GLOBAL_STEP:  # module and name, each ending in a newline
            first = data.find(b"\n", pos)
            second = data.find(b"\n", first + 1) if first >= 0 else -1
            if second < 0:
                return None
            pos = second + 1
        else:
            return None
    return None


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while unpickling.

    Unpickling ``.metadata`` allocates thousands of small objects, and each 700 allocations start a
    collection; in a process holding torch (~250k tracked objects) the full ones cost ~10 ms of the
    ~12 ms a 2 GiB checkpoint's metadata takes to decode (1.2 ms without). The pause is bounded by the
    input's size; nesting and an already disabled collector are respected.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: C types whose attributes cannot be set


def _snapshot(objects: Iterable[Any]) -> list[tuple[Any, dict[str, Any], tuple[Any, ...]]]:
    out = []
    seen: set[int] = set()
    for obj in objects:
        if id(obj) in seen or not hasattr(obj, "__dict__"):
            continue
        if isinstance(obj, type) and obj.__flags__ & _IMMUTABLE_TYPE:
            continue  # OrderedDict, set, tuple...: BUILD cannot change them, nothing to restore
        seen.add(id(obj))
        extra = tuple(getattr(obj, a, None) for a in _FUNCTION_ATTRS) if isinstance(obj, types.FunctionType) else ()
        out.append((obj, dict(vars(obj)), extra))
    return out


def _restore(snapshot: list[tuple[Any, dict[str, Any], tuple[Any, ...]]]) -> str | None:
    """Undo attribute changes on snapshotted objects; return the name of the first changed one."""
    changed = None
    for obj, before, extra in snapshot:
        now = vars(obj)
        same = now.keys() == before.keys() and all(now[k] is v for k, v in before.items())
        if extra:
            same = same and all(getattr(obj, a, None) is v for a, v in zip(_FUNCTION_ATTRS, extra))
        if same:
            continue
        changed = changed or getattr(obj, "__qualname__", type(obj).__name__)
        for key in [k for k in now if k not in before]:
            try:
                delattr(obj, key)
            except (AttributeError, TypeError):
                pass
        for key, value in before.items():
            if now.get(key) is not value:
                try:
                    setattr(obj, key, value)
                except (AttributeError, TypeError):
                    pass
        for attr, value in zip(_FUNCTION_ATTRS, extra):
            if getattr(obj, attr, None) is not value:
                setattr(obj, attr, value)
    return changed


def safe_loads(
    data: bytes | bytearray | memoryview,
    path: str,
    allowed: dict[tuple[str, str], Any],
    persistent_load: Callable[[Any], Any] | None = None,
    expected: type | tuple[type, ...] | None = None,
) -> Any:
    """Unpickle ``data`` (read from ``path``) with the allow-list; check the result's type.

    Garbage or truncated bytes raise :class:`CorruptCheckpointError` naming ``path``.
    """
    try:
        obj = AllowListUnpickler(io.BytesIO(data), path, allowed, persistent_load).load()
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{path}: not a valid pickle ({type(exc).__name__}: {exc})") from exc
    if expected is not None and not isinstance(obj, expected):
        raise CorruptCheckpointError(f"{path}: expected {expected}, unpickled a {type(obj).__name__}")
    return obj


def globals_of(module: Any, names: Iterable[str]) -> dict[tuple[str, str], Any]:
    """Allow-list entries for ``names`` of ``module`` (resolved to the real objects)."""
    return {(module.__name__, name): getattr(module, name) for name in names}
