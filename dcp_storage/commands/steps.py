"""``dcp-storage ls ROOT`` and ``dcp-storage gc ROOT``: the step folders a checkpoint manager keeps.

``ls`` lists every ``step-<N>`` folder under ROOT: complete (its commit marker is there) or torn (a killed
save's leftovers), its size, age and metrics. ``gc`` applies the manager's rules from the command line:
torn folders go unless a live save holds them, complete steps go as ``--keep-last`` / ``--keep-every``
say, the newest complete step never goes, and a step's commit marker is deleted before its data.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from typing import Any

from dcp_storage.commands import _common
from dcp_storage.text import printable as shown


def add_parsers(sub: Any) -> None:
    p = _common.add_command(
        sub,
        "ls",
        help="list the steps of a checkpoint manager's root: complete or torn, size, age, metrics",
        description="List every step-<N> folder under ROOT (what dcp_storage.CheckpointManager writes): whether it is "
        "complete (its commit marker is there) or torn (the leftovers of a save that did not finish), its size, its "
        "age and the metrics it was saved with. The commit markers are the truth; the manager's index is not used.",
        examples=["dcp-storage ls ./run", "dcp-storage ls s3://bucket/run --json -o profile=ml"],
    )
    p.add_argument("root", metavar="ROOT", help="the manager's root directory or URL")
    _common.add_storage_options(p)
    _common.add_json(p)
    _common.add_common(p)
    p.set_defaults(func=run_ls)

    g = _common.add_command(
        sub,
        "gc",
        help="delete old steps and torn folders under a checkpoint manager's root, by the manager's rules",
        description="Delete the complete steps under ROOT that --keep-last/--keep-every do not keep, and the torn "
        "folders of saves that did not finish, except those a live save holds (its lock names a running process, "
        "or a host that cannot be asked). The newest complete step is never deleted, and each step's commit "
        "marker goes first, so an interrupted gc leaves a torn folder, never a step that looks complete.",
        examples=[
            "dcp-storage gc ./run --keep-last 3 --dry-run",
            "dcp-storage gc s3://bucket/run --keep-last 2 --keep-every 1000",
        ],
    )
    g.add_argument("root", metavar="ROOT", help="the manager's root directory or URL")
    g.add_argument("--keep-last", metavar="K", type=_positive, required=True, help="keep the last K complete steps")
    g.add_argument("--keep-every", metavar="N", type=_positive, help="also keep every step divisible by N")
    g.add_argument("--dry-run", action="store_true", help="say what would be deleted; delete nothing")
    _common.add_storage_options(g)
    _common.add_json(g)
    _common.add_common(g)
    g.set_defaults(func=run_gc)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _open(args: argparse.Namespace) -> Any:
    from dcp_storage.manager.steps import StepRoot  # imports the manager's layer: only when the command runs
    from dcp_storage.transports import open_transport

    transport, path = open_transport(args.root, _common.storage_options(args))
    return StepRoot(transport, path)


def _size(transport: Any, folder: str, names: tuple[str, ...]) -> int | None:
    total = 0
    for name in names:
        try:
            total += transport.size(transport.join(folder, name))
        except Exception:  # noqa: BLE001 - a subfolder (prefix strategies) or a file gone meanwhile
            return None
    return total


def _saved_at(transport: Any, folder: str, step: Any) -> float | None:
    if step.saved_at is not None:
        return step.saved_at
    if getattr(transport, "is_local", False):
        try:
            return os.path.getmtime(folder)
        except OSError:
            return None
    return None


def run_ls(args: argparse.Namespace) -> int:
    store = _open(args)
    rows = []
    now = time.time()
    for step in store.scan():
        folder = store.transport.join(store.root, step.name)
        saved = _saved_at(store.transport, folder, step)
        rows.append(
            {
                "step": step.step,
                "name": step.name,
                "state": "complete" if step.complete else ("empty" if step.empty else "torn"),
                "bytes": _size(store.transport, folder, step.names),
                "files": len(step.names),
                "saved_at": None
                if saved is None
                else datetime.datetime.fromtimestamp(saved, datetime.timezone.utc).isoformat(),
                "age_s": None if saved is None else round(now - saved, 1),
                "metrics": step.metrics,
                "locked": bool(step.locks),
            }
        )
    if args.json:
        complete = [r["step"] for r in rows if r["state"] == "complete"]
        _common.emit_json(
            {"root": store.transport.url(store.root), "latest": max(complete, default=None), "steps": rows}
        )
        return 0
    print(f"root: {shown(store.transport.url(store.root))}")
    if not rows:
        print("no step folders")
        return 0
    print(f"{'step':>12}  {'state':<9} {'size':>10}  {'age':>9}  metrics")
    for r in rows:
        metrics = " ".join(f"{k}={v:g}" for k, v in sorted(r["metrics"].items()))
        state = r["state"] + ("*" if r["locked"] and r["state"] != "complete" else "")
        print(
            f"{r['step']:>12}  {state:<9} {_common.human_bytes(r['bytes']):>10}  {_age(r['age_s']):>9}  {shown(metrics)}"
        )
    if any(r["locked"] and r["state"] != "complete" for r in rows):
        print("* holds a save's lock: a save still running, or one that was killed")
    return 0


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def run_gc(args: argparse.Namespace) -> int:
    from dcp_storage.manager import KeepPolicy  # imports torch: only when the command runs

    store = _open(args)
    policy = KeepPolicy(last=args.keep_last, every=args.keep_every)
    report = store.recover(dry_run=args.dry_run)
    ours = store.apply(policy, dry_run=args.dry_run)
    deleted = sorted({*report.deleted, *ours})  # recover ran the retention of a save killed after its commit
    kept = sorted(store.index.steps) if not args.dry_run else sorted(set(store.index.steps) - set(deleted))
    if args.json:
        _common.emit_json(
            {
                "root": store.transport.url(store.root),
                "dry_run": args.dry_run,
                "deleted": deleted,
                "torn_removed": report.torn_removed,
                "held": report.held,
                "foreign": report.foreign,
                "kept": kept,
            }
        )
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(f"root: {shown(store.transport.url(store.root))}")
    print(f"{verb} steps: {', '.join(map(str, deleted)) or 'none'}")
    print(f"{verb} torn folders: {', '.join(map(str, report.torn_removed)) or 'none'}")
    if report.held:
        print(f"left in place (a live save holds them): {', '.join(map(str, report.held))}")
    if report.foreign:
        print(f"left in place (they hold files no save leaves): {', '.join(map(str, report.foreign))}")
    print(f"kept steps: {', '.join(map(str, kept)) or 'none'}")
    return 0
