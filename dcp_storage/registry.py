"""The plugin registry: named transports, formats, strategies, planners and extensions.

Third-party distributions add entries through entry points, exactly as dcp-storage registers its own
built-ins (see ``[project.entry-points]`` in pyproject.toml)::

    [project.entry-points."dcp_storage.formats"]
    myformat = "my_package.formats:FORMAT"

Targets are ``module:attr`` import strings, imported on first use. A plugin that fails to import is
reported (its distribution name and the error) by :func:`list` and :func:`get`; it never breaks the core
or other plugins.

Conflicts: when two distributions claim the same ``(kind, name)``, dcp-storage's own entry wins over a
third party's, and between third parties the distribution whose name sorts first wins; a warning names
both. :func:`register` (programmatic, e.g. in tests) replaces an entry only with ``replace=True``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any

from dcp_storage.errors import DcpStorageError
from dcp_storage.runtime import fork_safe

__all__ = [
    "KINDS",
    "PluginError",
    "PluginImportError",
    "PluginInfo",
    "PluginNotFoundError",
    "distribution_of",
    "get",
    "import_target",
    "instance",
    "lazy_exports",
    "list",
    "register",
    "registered",
    "reload",
    "unregister",
]

KINDS: tuple[str, ...] = ("transports", "formats", "strategies", "planners", "extensions")
OWN_DISTRIBUTION = "dcp-storage"
PROGRAMMATIC = "<register()>"


class PluginError(DcpStorageError):
    """Base class of registry errors."""


class PluginNotFoundError(PluginError, KeyError):
    """No plugin of that kind has that name; the message lists the names that exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class PluginImportError(PluginError, ImportError):
    """A plugin's target could not be imported; names the distribution and the error."""


@dataclass
class PluginInfo:
    """One registry entry, as :func:`list` reports it."""

    kind: str
    name: str
    target: str | object
    distribution: str
    status: str = "not loaded"  # "not loaded", "loaded" or "failed"
    error: str | None = None
    _value: Any = field(default=None, repr=False)

    @property
    def target_name(self) -> str:
        return self.target if isinstance(self.target, str) else f"{type(self.target).__name__} object"


class _Registry:
    def __init__(self) -> None:
        self._lock = fork_safe(threading.RLock())
        self._entries: dict[str, dict[str, PluginInfo]] | None = None

    # ------------------------------------------------------------------ discovery
    def _discover(self) -> dict[str, dict[str, PluginInfo]]:
        with self._lock:
            if self._entries is None:
                entries: dict[str, dict[str, PluginInfo]] = {kind: {} for kind in KINDS}
                # One scan of the installed distributions for every group, and each distribution's name read
                # once: a group at a time read every distribution's entry points five times, and each entry's
                # METADATA again (54 ms of a fresh process's first save or load here, against 7 ms now).
                found = importlib_metadata.entry_points()
                names: dict[int, str] = {}
                for kind in KINDS:
                    for ep in found.select(group=f"dcp_storage.{kind}"):
                        dist = "<unknown>"
                        if ep.dist is not None:
                            if id(ep.dist) not in names:  # ``found`` keeps each one alive: ids stay unique
                                names[id(ep.dist)] = ep.dist.name
                            dist = names[id(ep.dist)]
                        self._add(entries[kind], PluginInfo(kind, ep.name, ep.value, dist))
                self._entries = entries
            return self._entries

    @staticmethod
    def _rank(info: PluginInfo) -> tuple[int, int, str]:
        """Who keeps a name two distributions claim: this package's own entry point (the one its installed
        distribution declares, under that distribution's exact name), then a distribution of its name in
        another spelling, then the first by name. A distribution that only calls itself ``DCP-Storage``
        no longer ties with this package (and :meth:`distribution_of` answers as discovery does)."""
        own = _own_entry_points()
        if own is not None and info.distribution == own[1] and info.name in own[0].get(info.kind, ()):
            return (0, 0, "")
        return (
            1,
            0 if info.distribution.replace("_", "-").lower() == OWN_DISTRIBUTION else 1,
            info.distribution.lower(),
        )

    def _add(self, table: dict[str, PluginInfo], info: PluginInfo) -> None:
        old = table.get(info.name)
        if old is None:
            table[info.name] = info
            return
        if old.distribution == info.distribution and old.target == info.target:
            return  # the same distribution seen twice on sys.path
        keep, drop = (old, info) if self._rank(old) <= self._rank(info) else (info, old)
        warnings.warn(
            f"dcp-storage: {info.kind} plugin {info.name!r} is claimed by {old.distribution!r} ({old.target_name}) "
            f"and {info.distribution!r} ({info.target_name}); using {keep.distribution!r}",
            RuntimeWarning,
            stacklevel=4,
        )
        table[info.name] = keep
        del drop

    # ------------------------------------------------------------------ API
    def list(self, kind: str | None = None) -> list[PluginInfo]:
        entries = self._discover()
        kinds = [_check_kind(kind)] if kind is not None else [*KINDS]
        return [entries[k][n] for k in kinds for n in sorted(entries[k])]

    def distribution_of(self, kind: str, name: str) -> str | None:
        """The distribution whose entry point ``name`` of ``kind`` is in force (``None``: no entry point).

        Before anything needed the whole registry, a name this package registers itself is answered from
        its own entry points alone: this package wins every clash (:meth:`_rank`) and nothing was
        registered or removed by hand yet. Why: a save records its format's distribution in the manifest,
        and a fresh process spent 12 ms of its first save scanning every installed distribution for it.
        """
        _check_kind(kind)
        with self._lock:
            if self._entries is None:
                own = _own_entry_points()
                if own is not None and name in own[0].get(kind, ()):
                    return own[1]
        info = self._discover()[kind].get(name)
        return None if info is None or info.distribution.startswith("<") else info.distribution

    def get(self, kind: str, name: str) -> Any:
        table = self._discover()[_check_kind(kind)]
        with self._lock:
            info = table.get(name)
            if info is None:
                known = ", ".join(sorted(table)) or "none"
                raise PluginNotFoundError(f"no {kind} plugin named {name!r} (installed: {known})")
            if info.status == "loaded":
                return info._value
            if not isinstance(info.target, str):
                info._value, info.status = info.target, "loaded"
                return info._value
            try:
                value = import_target(info.target)
            except Exception as exc:  # noqa: BLE001 - reported, never propagated raw
                info.status, info.error = "failed", f"{type(exc).__name__}: {exc}"
                raise PluginImportError(
                    f"{kind} plugin {name!r} from distribution {info.distribution!r} failed to import "
                    f"({info.target}): {info.error}"
                ) from exc
            info._value, info.status, info.error = value, "loaded", None
            return value

    def load_all(self, kind: str) -> dict[str, Any]:
        """Every plugin of ``kind`` that imports; failures stay recorded in :func:`list`."""
        out = {}
        for info in self.list(kind):
            try:
                out[info.name] = self.get(kind, info.name)
            except PluginImportError:
                continue
        return out

    def register(self, kind: str, name: str, target: str | object, *, replace: bool = False) -> None:
        table = self._discover()[_check_kind(kind)]
        with self._lock:
            if name in table and not replace:
                raise PluginError(
                    f"{kind} plugin {name!r} already registered by {table[name].distribution!r}; pass replace=True"
                )
            table[name] = PluginInfo(kind, name, target, PROGRAMMATIC)

    def unregister(self, kind: str, name: str) -> None:
        with self._lock:
            self._discover()[_check_kind(kind)].pop(name, None)

    def reload(self) -> None:
        with self._lock:
            self._entries = None
            _own_entry_points.cache_clear()


@functools.cache
def _own_entry_points() -> tuple[dict[str, frozenset[str]], str] | None:
    """This package's registered names by kind, and its distribution's name (``None``: not installed)."""
    try:
        dist = importlib_metadata.distribution(OWN_DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError:
        return None
    found = dist.entry_points
    names = {kind: frozenset(ep.name for ep in found.select(group=f"dcp_storage.{kind}")) for kind in KINDS}
    return names, dist.name


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise PluginError(f"unknown plugin kind {kind!r}; kinds are {', '.join(KINDS)}")
    return kind


def import_target(target: str) -> Any:
    """The object a ``module:attr.path`` import string names (``module`` alone: the module).

    The package's one lazy import: registry entries, the lazily exported names of ``dcp_storage`` and
    ``plugin_api`` (:func:`lazy_exports`) and error classes rebuilt from their names all resolve here."""
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def lazy_exports(
    module_name: str, table: Mapping[str, str], *, submodules: bool = False
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A PEP 562 ``__getattr__`` and ``__dir__`` for ``module_name``, whose public names (``table``: name ->
    defining module) are imported on first use, so importing the module imports neither torch nor a format.

    Each name is looked up once and then set on the module (later lookups skip ``__getattr__``). With
    ``submodules``, any other public name that is a submodule is imported as its attribute."""
    module = sys.modules[module_name]

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            if submodules and not name.startswith("_") and importlib.util.find_spec(f"{module_name}.{name}"):
                return importlib.import_module(f"{module_name}.{name}")
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = import_target(f"{where}:{name}")
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *getattr(module, "__all__", ())})

    return __getattr__, __dir__


_REGISTRY = _Registry()


def list(kind: str | None = None) -> list[PluginInfo]:  # noqa: A001 - the documented name
    """Every known entry (of ``kind``, or of all kinds), with its import status."""
    return _REGISTRY.list(kind)


def get(kind: str, name: str) -> Any:
    """The object a plugin names, imported on first use."""
    return _REGISTRY.get(kind, name)


def distribution_of(kind: str, name: str) -> str | None:
    """The distribution that registers plugin ``name`` of ``kind`` (``None``: none, or registered by hand)."""
    return _REGISTRY.distribution_of(kind, name)


def instance(kind: str, value: Any, accepts: Callable[[Any], bool], what: str) -> Any:
    """``value`` when ``accepts`` it, else the plugin of ``kind`` named by the string ``value``; a registered
    class or factory is called with no arguments. Anything else is refused with ``TypeError``: ``what`` (what
    the parameter must be), the type found and the registered name. How every API that takes a strategy or planner "object or
    name" (``prefix_strategy=``, ``read_strategy=``, ``planner=``) resolves it."""
    found = get(kind, value) if isinstance(value, str) else value
    if isinstance(found, type) or (not accepts(found) and callable(found)):
        found = found()
    if not accepts(found):
        registered = f" (registered as {value!r})" if isinstance(value, str) else ""
        raise TypeError(f"{what}, got {type(found).__name__}{registered}")
    return found


def load_all(kind: str) -> dict[str, Any]:
    """``{name: object}`` for every plugin of ``kind`` that imports."""
    return _REGISTRY.load_all(kind)


def register(kind: str, name: str, target: str | object, *, replace: bool = False) -> None:
    """Add an entry programmatically (an import string or the object itself)."""
    _REGISTRY.register(kind, name, target, replace=replace)


def unregister(kind: str, name: str) -> None:
    _REGISTRY.unregister(kind, name)


def reload() -> None:
    """Forget everything and rediscover entry points on next use (after installing a plugin)."""
    _REGISTRY.reload()


@contextmanager
def registered(kind: str, name: str, target: str | object) -> Iterator[None]:
    """Register for the duration of a ``with`` block (tests); restores what was there before."""
    table = _REGISTRY._discover()[_check_kind(kind)]
    previous = table.get(name)
    register(kind, name, target, replace=True)
    try:
        yield
    finally:
        with _REGISTRY._lock:
            if previous is None:
                table.pop(name, None)
            else:
                table[name] = previous
