"""The collectives every reader and writer uses: a rank's place in its group, DCP call detection, and ``share_object``
(the one coordinator broadcast).

Where this process stands in a process group: rank, size, transfer device, or no group at all.

The one rule for the device a group's collectives use lives here (:func:`group_view`): every strategy and
writer that sends tensors over a group asks its :class:`GroupView` rather than the backend.

What the running ``dcp.load`` decided but tells no reader: whether it runs distributed, and its planner.

``dcp.load(..., no_dist=True)`` (and any load without an initialised process group) runs every step on
the calling process alone: the usual ``if rank == 0: dcp.load(..., no_dist=True)`` of export and eval
code, or every rank loading a full copy. A reader that runs a collective then (a metadata broadcast, slices
sent point to point) waits forever for ranks that are not loading, or that load on their own.

DCP does not say so in time. ``read_metadata()``, the first step and the one that shares metadata, gets
no arguments; ``set_up_storage_reader(metadata, is_coordinator)`` gets ``is_coordinator=True`` on every
rank under ``no_dist``, which on rank 0 looks exactly like a distributed load; ``prepare_global_plan``
sees one plan instead of one per rank, but runs only on the coordinator, after the metadata step. What
does say it is DCP's own ``_DistWrapper`` (``torch.distributed.checkpoint.utils``): ``_load_state_dict``
builds one per call, ``_DistWrapper(process_group, not no_dist, coordinator_rank)``, keeps it in its local
``distW`` and drives every reader step from there. :func:`dcp_storage._torch.current_call` (the one module
that reads torch's frames) finds it in the calling frames (only frames of ``torch.distributed.checkpoint``
modules are looked at), with the call's planner, whose
``set_up_planner`` has already run when the reader is set up (see :mod:`dcp_storage.planners.planner`).
torch has built its loads this way since DCP's first release; if a future torch stops doing so,
:func:`current_call` returns ``None`` and readers fall back to what they did before: a process group of
more than one rank means a distributed load.

:func:`working_alone` is the other signal: a strategy that calls the reader it wraps on one rank only
(:class:`~dcp_storage.strategies.Broadcasting`) runs those calls inside it, so the wrapped reader, which
sees the same distributed DCP call on the stack, does not start collectives of its own.

The call's process group matters too: a reader built without one (``process_group=None``) runs its
collectives on the group ``dcp.load`` was given (:func:`load_group`), not on the default group.

Compute something on one rank, give the result (or the error) to every rank.

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

import asyncio
import contextlib
import contextvars
import os
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage._torch import current_call, object_coll_device
from dcp_storage.errors import DcpStorageError, LocationMismatchError, RankMismatchError
from dcp_storage.registry import import_target

__all__ = [
    "RANK_FAILURES",
    "GroupView",
    "SOLO",
    "decode_error",
    "encode_error",
    "group_view",
    "load_group",
    "load_view",
    "reader_location",
    "running_planner",
    "share_object",
    "share_within_load",
    "working_alone",
    "works_alone",
]

#: What a rank reports to its peers before raising, so that none of them is left in a collective it skips:
#: every ``Exception``, and the ``BaseException``s raised for a failure (torch's ``CheckpointException``,
#: asyncio's ``CancelledError``). An interrupt or an exit is not caught: the job is ending.
RANK_FAILURES: tuple[type[BaseException], ...] = (Exception, CheckpointException, asyncio.CancelledError)


@dataclass(frozen=True)
class GroupView:
    """``rank``/``world`` are ranks *within* ``group``; ``distributed`` is False without a process group.

    ``device`` is where tensors sent over ``group`` must live: ``cpu`` for gloo, the current CUDA device
    for NCCL (the group's own choice, never assumed).
    """

    group: Any
    rank: int
    world: int
    device: torch.device
    distributed: bool

    def check_src(self, src: int, what: str) -> None:
        if not 0 <= src < self.world:
            raise ValueError(f"{what}={src} is not a rank of a process group of size {self.world}")


#: The view of a process that works alone: rank 0 of a group of one, no collectives.
SOLO = GroupView(None, 0, 1, torch.device("cpu"), False)


def group_view(group: Any = None) -> GroupView:
    """Describe ``group`` (``None``: the default group), or a single process when none is initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return SOLO
    kind = object_coll_device(group)
    if kind == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(kind)
    return GroupView(group, dist.get_rank(group), dist.get_world_size(group), device, True)


_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("dcp_storage_working_alone", default=False)


def running_planner() -> Any:
    """The planner of the running DCP call, or ``None``."""
    call = current_call()
    return None if call is None else call.planner


def works_alone() -> bool:
    """Whether this process must not run collectives now: ``no_dist``, or inside :func:`working_alone`."""
    if _ALONE.get():
        return True
    call = current_call()
    return call is not None and not call.distributed


def load_group(group: Any = None) -> Any:
    """``group``, or when it is ``None`` the running DCP call's process group (``None``: the default group).

    A reader built without a group serves the ``dcp.load(..., process_group=...)`` it is passed to: its
    collectives must run on that group, or ranks outside it wait for them forever.
    """
    if group is not None:
        return group
    call = current_call()
    return None if call is None else call.group


def load_view(group: Any = None) -> GroupView:
    """:func:`~.group.group_view` of :func:`load_group`, or :data:`SOLO` when this process works alone."""
    return SOLO if works_alone() else group_view(load_group(group))


@contextlib.contextmanager
def working_alone() -> Iterator[None]:
    """Readers called inside run no collectives (a strategy calling its wrapped reader on one rank)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


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
        except RANK_FAILURES as exc:  # every failure must reach the other ranks
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
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - an error whose __str__ fails must still reach the other ranks
        message = f"{cls.__qualname__} (its message could not be formed)"
    return {"module": cls.__module__, "qualname": cls.__qualname__, "message": message, "attrs": attrs, "rank": rank}


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
        obj = import_target(f"{module}:{qualname}")
    except (ImportError, AttributeError):
        return None
    if isinstance(obj, type) and issubclass(obj, DcpStorageError):
        return obj
    return None
