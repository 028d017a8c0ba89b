"""Running one hostile case through one public entry point, and judging the outcome.

An :class:`Outcome` is plain data (it crosses process boundaries from ``run_ranks``). The rule for every
entry point that loads or describes: an exception of our hierarchy
(:class:`~dcp_storage.errors.DcpStorageError`), found inside DCP's ``CheckpointException`` when ``dcp.load``
wrapped it, whose message names the culprit file, within seconds, with no marker file created. ``verify``
returns a report instead of raising: it must be "not ok", name the culprit, and contain no problem that
came from a foreign exception (``verify`` prints those as ``TypeName: message``).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from .corpus import Case, dest_state_dict

__all__ = ["ENTRY_POINTS", "EXTRA_ENTRY_POINTS", "Outcome", "judge", "our_error_names", "run_entry"]

ENTRY_POINTS = ("open_reader", "reader_class", "describe", "verify")
EXTRA_ENTRY_POINTS = ("broadcasting",)  # run_entry takes these too; the tests choose the cases
MAX_SECONDS = 10.0  # "within seconds": generous for a loaded 2-core CI box; typical cases take < 0.1 s


@dataclass
class Outcome:
    case: str
    entry: str
    raised: str | None  # the innermost relevant exception's class name (None: returned normally)
    ours: bool  # a DcpStorageError
    message: str
    seconds: float
    marker: bool  # the case's marker file exists afterwards
    problems: list[str] = field(default_factory=list)  # verify only
    chain: list[str] = field(default_factory=list)  # class names along __cause__/__context__


def our_error_names() -> set[str]:
    """Names of every DcpStorageError subclass (CLI output carries names, not classes)."""
    import dcp_storage.formats.torch_save
    import dcp_storage.opening  # noqa: F401 - UnknownFormatError
    from dcp_storage.errors import DcpStorageError

    names, todo = set(), [DcpStorageError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _inner(exc: BaseException) -> BaseException:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, MetadataReadFailed):
        return exc.error
    while isinstance(exc, CheckpointException):
        failures = list(exc.failures.values())
        if not failures:
            return exc
        inner = failures[0]
        exc = inner[0] if isinstance(inner, tuple) else inner
    return exc


def _chain(exc: BaseException) -> list[str]:
    out, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(type(cur).__name__)
        cur = cur.__cause__ or cur.__context__
    return out


def _load(case: Case, reader: Any, planner: Any = None, process_group: Any = None) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_storage import DynamicMetaLoadPlanner

    dest = dest_state_dict(case, tensors_only=isinstance(planner, DynamicMetaLoadPlanner))
    no_dist = not (dist.is_available() and dist.is_initialized())
    dcp.load(dest, storage_reader=reader, planner=planner, no_dist=no_dist, process_group=process_group)


class MetadataReadFailed(Exception):
    """``dcp.load`` reported a failed ``read_metadata`` as torch's AssertionError; ``error`` is the reader's own."""

    def __init__(self, error: BaseException, torch_message: str) -> None:
        super().__init__(torch_message)
        self.error = error


def _load_reporting_metadata_errors(case: Case, make: Any) -> None:
    """``dcp.load`` through a reader from ``make()``; a metadata failure is re-raised as the reader's error.

    torch's ``dcp.load`` catches whatever ``read_metadata`` raises, tries the rank-local fallback, and raises
    ``AssertionError("metadata is None; global metadata read failed: <message>; ...")``: the class is lost,
    the message kept. To check the class, the same read is repeated on a fresh reader; its error must be
    ours and its message the one torch quoted.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = make()
    try:
        _load(case, reader, planner)
    except CheckpointException as exc:
        inner = _inner(exc)
        text = str(inner)
        if not (isinstance(inner, AssertionError) and text.startswith("metadata is None")):
            raise
        again, _planner = make()
        try:
            again.read_metadata()
        except Exception as direct:
            if f"global metadata read failed: {direct}" not in text:
                raise AssertionError(f"torch quoted another error than read_metadata raises: {text}") from direct
            raise MetadataReadFailed(direct, text) from direct
        raise AssertionError(f"read_metadata failed in dcp.load but not when repeated: {text}") from exc


def _reader_class(case: Case) -> tuple[Any, Any]:
    from dcp_storage import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner, FsspecReader, SafetensorsReader

    if case.family == "dcp":
        return FsspecReader(case.url), None
    if case.family in ("dcp_st", "st", "hf"):
        return SafetensorsReader(case.url), None
    return BroadcastingTorchSaveReader(case.url), DynamicMetaLoadPlanner()


def run_entry(case: Case, entry: str) -> Outcome:
    """Run ``case`` through ``entry`` (one of :data:`ENTRY_POINTS`) in this process."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_storage.errors import DcpStorageError

    start = time.monotonic()
    problems: list[str] = []
    error: BaseException | None = None
    try:
        if entry == "open_reader":
            from dcp_storage import open_reader

            _load_reporting_metadata_errors(case, lambda: (open_reader(case.url), None))
        elif entry == "reader_class":
            _load_reporting_metadata_errors(case, lambda: _reader_class(case))
        elif entry == "broadcasting":  # only the coordinator reads; the others get what it vetted
            from dcp_storage import Broadcasting, open_reader

            _load_reporting_metadata_errors(case, lambda: (Broadcasting(open_reader(case.url)), None))
        elif entry == "describe":
            from dcp_storage.inspection import describe

            describe(case.url)
        elif entry == "verify":
            from dcp_storage.inspection import verify

            problems = list(verify(case.url, deep=True).problems)
        else:
            raise ValueError(f"unknown entry point {entry!r}")
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - judged below (CheckpointException is a BaseException)
        error = exc
    seconds = time.monotonic() - start
    marker = bool(case.marker) and os.path.exists(case.marker)  # type: ignore[arg-type]
    if error is None:
        return Outcome(case.name, entry, None, False, "", seconds, marker, problems)
    inner = _inner(error)
    return Outcome(
        case.name,
        entry,
        type(inner).__name__,
        isinstance(inner, DcpStorageError),
        str(inner),
        seconds,
        marker,
        problems,
        _chain(inner),
    )


_FOREIGN_PROBLEM = re.compile(r"^(?:(?:tensor|value) '[^']*': |cannot open for reading: )?([A-Z]\w*): ")


def judge(case: Case, out: Outcome) -> str | None:
    """Why ``out`` breaks the rules, or ``None`` if it keeps them."""
    if out.marker:
        return "the payload ran: marker file exists"
    if out.seconds > MAX_SECONDS:
        return f"took {out.seconds:.1f}s"
    raw = sorted({repr(ch) for ch in out.message + "".join(out.problems) if not ch.isprintable()})
    if raw:  # names from a checkpoint are escaped in every message (dcp_storage.text.printable)
        return f"raw characters {', '.join(raw)} in the message"
    if out.entry == "verify" and out.raised is None:
        if not out.problems:
            return "verify reported no problem"
        ours = our_error_names()
        foreign = [p for p in out.problems if (m := _FOREIGN_PROBLEM.match(p)) and m.group(1) not in ours]
        if foreign:
            return f"verify problem from a foreign exception: {foreign[0][:300]}"
        if not any(case.culprit in p for p in out.problems):
            return f"no verify problem names {case.culprit!r}: {out.problems[:3]}"
        return None
    if out.raised is None:
        if out.entry == "describe" and not case.in_metadata:
            return None  # describe reads no tensor data: damage only there is not its to find
        return "accepted: no error"
    if not out.ours:
        return f"{out.raised} is not a DcpStorageError: {out.message[:300]}"
    if case.culprit not in out.message:
        return f"{out.raised} does not name {case.culprit!r}: {out.message[:300]}"
    return None
