"""Compute something on one rank, give the result (or the error) to every rank.

Readers whose metadata only one rank should read (a single file behind one host's credentials, or just to
cut request counts at scale) call :func:`share_object` in ``read_metadata``. The source rank runs the
function; the broadcast *always* happens, carrying either the value or the error, so a bad checkpoint
fails on every rank at once instead of leaving the other ranks waiting for a collective timeout.

Errors cross ranks as (class, message, simple attributes) rather than as pickled exception objects
(whose constructors often take other arguments than their message). On the other ranks a
:class:`~dcp_storage.errors.DcpStorageError` subclass of this package is rebuilt as the same class with
the same message; any other error becomes a :class:`~dcp_storage.errors.DcpStorageError` whose message
names the original class. The source rank re-raises its original exception.

A reader passes ``location``, the checkpoint it was given (:func:`reader_location`): the source rank sends
its own with the value, and a rank given another checkpoint raises
:class:`~dcp_storage.errors.LocationMismatchError` naming both, instead of reading its own checkpoint's data
through the coordinator's metadata (or, with a read strategy that exchanges slices, handing other ranks
bytes of another checkpoint): a silent mix of two checkpoints. DCP gathers that error to every rank.
"""

from __future__ import annotations

import importlib
import os
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from dcp_storage.errors import DcpStorageError, LocationMismatchError, RankMismatchError
from dcp_storage.strategies.dcp_call import current_call, load_group, works_alone
from dcp_storage.strategies.group import group_view

__all__ = ["decode_error", "encode_error", "reader_location", "share_object", "share_within_load"]

T = TypeVar("T")
_SIMPLE = (str, int, float, bool, type(None))


def share_object(
    fn: Callable[[], T], *, group: Any = None, src_rank: int = 0, location: str | None = None, kind: str | None = None
) -> T:
    """Run ``fn`` on ``src_rank`` (a rank of ``group``) and return its result on every rank.

    ``group=None``: the process group of the running ``dcp.load``, if any, else the default group.

    Collective: every rank of ``group`` must call it. Without a process group (or at world size 1), and
    while this process works alone (inside ``dcp.load(..., no_dist=True)``, see :mod:`.dcp_call`), it
    just calls ``fn``. If ``fn`` raises, every rank raises (see the module docstring for which class).
    The result must be picklable; if it is not, that too is raised on every rank. ``location``: the
    checkpoint this rank was given; a rank whose location differs from ``src_rank``'s raises
    :class:`~dcp_storage.errors.LocationMismatchError` (module docstring). ``kind``: the reader this rank
    reads through (its class name); a rank whose reader is of another kind than ``src_rank``'s raises
    :class:`~dcp_storage.errors.RankMismatchError` (the two would run different collectives from here on).
    """
    if works_alone():
        return fn()
    group = load_group(group)
    view = group_view(group)
    view.check_src(src_rank, "src_rank")
    if not view.distributed or view.world == 1:
        return fn()
    import torch.distributed as dist

    error: BaseException | None = None
    value: Any = None
    if view.rank == src_rank:
        try:
            value = fn()
            payload = pickle.dumps(("ok", (value, location, kind)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
            error = exc
            payload = pickle.dumps(("error", encode_error(exc, view.rank)), protocol=pickle.HIGHEST_PROTOCOL)
        box: list[Any] = [payload]
    else:
        box = [None]
    dist.broadcast_object_list(box, group=group, group_src=src_rank)
    if view.rank == src_rank:
        if error is not None:
            raise error
        return value
    status, body = pickle.loads(box[0])  # bytes from our own peer rank, not from storage
    if status == "error":
        raise decode_error(body)
    value, source_location, source_kind = body
    if kind is not None and source_kind is not None and source_kind != kind:
        raise RankMismatchError(
            f"the ranks of this load use different readers: rank {view.rank} reads through {kind}, but rank "
            f"{src_rank}, which reads the metadata for all ranks, through {source_kind}; the two would wait in "
            "different collectives: give every rank the same reader and read_strategy"
        )
    if location is not None and source_location is not None and source_location != location:
        raise LocationMismatchError(
            f"rank {view.rank} was given the checkpoint {location}, but rank {src_rank}, which reads the metadata "
            f"for all ranks, was given {source_location}: every rank of one dcp.load must load the same checkpoint "
            "(pass the same path or checkpoint_id on every rank)"
        )
    return value  # type: ignore[no-any-return]


def reader_location(reader: Any) -> str | None:
    """The checkpoint ``reader`` was given (its ``path`` or ``checkpoint_id``; a wrapped reader's, for one that
    wraps another as ``reader.reader``), in a form ranks can compare: a local path resolved (absolute, through
    symlinks: a link on one rank and the real path on another are one checkpoint), a URL without a trailing
    ``/``. ``None`` when the reader does not say (then nothing is compared)."""
    inner = getattr(reader, "reader", None)
    if inner is not None and inner is not reader:
        return reader_location(inner)
    given = getattr(reader, "path", None) or getattr(reader, "checkpoint_id", None)
    if not isinstance(given, (str, os.PathLike)):
        return None
    text = os.fspath(given)
    return text.rstrip("/") if "://" in text else os.path.realpath(text)


def share_within_load(
    fn: Callable[[], T], *, group: Any = None, src_rank: int = 0, location: str | None = None, kind: str | None = None
) -> T:
    """:func:`share_object` while a distributed ``dcp.load`` runs (every rank of its group calls the reader
    step that calls this); anywhere else ``fn()`` on this process alone.

    For readers whose metadata step is also called outside ``dcp.load`` (``reader.read_metadata()`` on one
    rank to look at keys, conversion, ``describe``): there no other rank is waiting, so a collective would
    hang. Without a recognisable DCP call on the stack (see :mod:`.dcp_call`) the reader reads alone: more
    requests, never a hang.
    """
    if current_call() is None:
        return fn()
    return share_object(fn, group=group, src_rank=src_rank, location=location, kind=kind)


def encode_error(exc: BaseException, rank: int) -> dict[str, Any]:
    """A plain-data description of ``exc`` for :func:`decode_error` on another rank."""
    cls = type(exc)
    attrs = {k: v for k, v in vars(exc).items() if _plain(v) and not k.startswith("_")}
    return {"module": cls.__module__, "qualname": cls.__qualname__, "message": str(exc), "attrs": attrs, "rank": rank}


def _plain(value: Any, depth: int = 0) -> bool:
    """Plain data (what ``__reduce__`` of our errors needs): scalars, and lists/tuples/dicts of them."""
    if isinstance(value, _SIMPLE):
        return True
    if depth > 3:
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _SIMPLE) and _plain(v, depth + 1) for k, v in value.items())
    return False


def decode_error(info: dict[str, Any]) -> DcpStorageError:
    """Rebuild an error described by :func:`encode_error`: same class if it is one of ours, else wrapped."""
    cls = _our_error_class(info["module"], info["qualname"])
    message = info["message"]
    if cls is None:
        exc: DcpStorageError = DcpStorageError(f"{info['qualname']} on rank {info['rank']}: {message}")
    else:
        try:
            exc = cls(message)
        except Exception:  # noqa: BLE001 - a constructor with other arguments: build it by hand
            exc = cls.__new__(cls)
            BaseException.__init__(exc, message)
        if str(exc) != message:  # a constructor that decorates its argument
            exc = cls.__new__(cls)
            BaseException.__init__(exc, message)
        for key, value in info["attrs"].items():
            try:
                setattr(exc, key, value)
            except AttributeError:
                pass
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised on rank {info['rank']} and shared with every rank)")
    return exc


def _our_error_class(module: str, qualname: str) -> type[DcpStorageError] | None:
    """The class, if it is a :class:`DcpStorageError` defined in this package (never imports others)."""
    if module != "dcp_storage" and not module.startswith("dcp_storage."):
        return None
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    if isinstance(obj, type) and issubclass(obj, DcpStorageError):
        return obj
    return None
