"""A snapshot of everything an allow-listed global could be made to change, and an unguarded unpickler.

:func:`snapshot` records, for every object of every allow-list the project's unpicklers use (and every
member of an allow-listed enum), what a ``BUILD`` could rewrite: names, qualnames, modules, bases, MRO,
``__dict__`` keys and the identity of their values, enum values, a function's defaults, code and
``__dict__``, and the attributes of slotted stand-ins. Two snapshots compare equal when nothing changed.

:func:`unguarded_loads` unpickles with the same allow-list but without :mod:`dcp_storage.pickle_guard`
(the C unpickler and ``find_class`` only): what the allow-list alone promised. The live-payload checks
run it in a subprocess to show that each process-state attack does change the process when unguarded.
"""

from __future__ import annotations

import enum
import io
import pickle
import types
from typing import Any

__all__ = ["allow_lists", "snapshot", "unguarded_loads"]


def allow_lists() -> dict[str, dict[tuple[str, str], Any]]:
    """Every allow-list the project's unpicklers use, by name."""
    from dcp_storage.formats.dcp_native import torch_record
    from dcp_storage.formats.dcp_native.native import metadata_allow_list
    from dcp_storage.formats.torch_save.pickle_tree import _Decoder

    first, second = _Decoder("snapshot").allowed, _Decoder("snapshot").allowed
    return {
        "metadata": metadata_allow_list(),
        "record": torch_record._ALLOWED,
        # what every data.pkl decoder shares (the rest, bound methods and storage stand-ins, is per load)
        "data_pkl": {key: obj for key, obj in first.items() if second[key] is obj},
    }


def _objects() -> list[Any]:
    out: dict[int, Any] = {}
    for table in allow_lists().values():
        for obj in table.values():
            out.setdefault(id(obj), obj)
            if isinstance(obj, type) and issubclass(obj, enum.Enum):
                for member in obj:
                    out.setdefault(id(member), member)
    return list(out.values())


def _state(obj: Any) -> tuple[Any, ...]:
    fields: list[Any] = [type(obj)]
    if isinstance(obj, type):
        fields += [obj.__name__, obj.__qualname__, obj.__module__, obj.__bases__, obj.__mro__]
        fields += [tuple(sorted((k, id(v)) for k, v in vars(obj).items()))]
    elif isinstance(obj, types.FunctionType):
        fields += [obj.__name__, obj.__qualname__, obj.__module__, obj.__defaults__, obj.__kwdefaults__, obj.__code__]
        fields += [tuple(sorted((k, id(v)) for k, v in vars(obj).items()))]
    elif isinstance(obj, enum.Enum):
        fields += [obj._value_, obj._name_, tuple(sorted((k, repr(v)) for k, v in vars(obj).items()))]
    else:
        if hasattr(obj, "__dict__"):
            fields += [tuple(sorted((k, repr(v)) for k, v in vars(obj).items()))]
        for slot in getattr(type(obj), "__slots__", ()):
            fields += [(slot, repr(getattr(obj, slot, None)))]
        fields += [repr(obj)]
    return tuple(fields)


def snapshot() -> dict[int, tuple[Any, ...]]:
    """``id(object) -> state`` for every allow-listed object (and enum member)."""
    return {id(obj): _state(obj) for obj in _objects()}


def changed(before: dict[int, tuple[Any, ...]], after: dict[int, tuple[Any, ...]]) -> list[str]:
    """What differs, as readable lines (empty: nothing changed)."""
    out = []
    for key in before.keys() | after.keys():
        if before.get(key) != after.get(key):
            a, b = before.get(key), after.get(key)
            out.append(f"{a[:3] if a else None} -> {b[:3] if b else None}")
    return out


def unguarded_loads(data: bytes, table: str) -> Any:
    """Unpickle ``data`` with allow-list ``table`` and nothing else (no guard walk): the old promise."""
    allowed = allow_lists()[table]

    class _AllowListOnly(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return allowed[(module, name)]

        def persistent_load(self, pid: Any) -> Any:
            raise pickle.UnpicklingError("no persistent ids here")

    return _AllowListOnly(io.BytesIO(data)).load()
