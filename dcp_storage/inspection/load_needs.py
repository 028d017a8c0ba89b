"""What ``verify`` checks beyond a checkpoint's own files: what else a load of it needs.

* **Extension plugins.** An item written through a stream extension (compression, ...) records its
  descriptors (``stream.zstd_seekable/1``); a load without a plugin that provides one fails on every such
  item. ``verify`` resolves each distinct descriptor list once, as a load would, and reports a missing
  one as one problem naming the descriptor, the distribution to install and how many items need it.
* **The rest of a sharded set.** ``model-00001-of-00003.safetensors`` verified alone is a valid file, but
  only one part of a checkpoint: the report names the set's index and siblings and asks for the index to
  be verified. A set whose siblings or index are missing cannot be loaded as a whole (readers refuse
  shards without their index as an interrupted save), so that is a problem, not a note.
"""

from __future__ import annotations

import posixpath
from typing import Any

from ..errors import DcpStorageError
from ..formats.dcp_native.extensions import ExtensionResolver
from ..formats.paths import HF_SHARD_RE, INDEX_SUFFIX
from ..planners.errors import format_keys
from .report import VerifyReport

__all__ = ["check_extensions", "check_shard_set"]

_KEYS_NAMED = 5
_SIBLINGS_NAMED = 8


def _descriptors(info: Any) -> tuple[str, ...] | None:
    """An entry's transform descriptors; ``None`` when they are not a list of strings."""
    descs = getattr(info, "transform_descriptors", None)
    if descs is None:
        return ()
    if not isinstance(descs, (list, tuple)) or not all(isinstance(d, str) for d in descs):
        return None
    return tuple(descs)


def check_extensions(report: VerifyReport, transport: Any, root: str, storage: dict[Any, Any], where: str) -> None:
    """One problem per extension (descriptor list) that the items of ``storage`` need and nobody provides."""

    users: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for index, info in storage.items():
        descs = _descriptors(info)
        if descs is None:
            report.problems.append(f"{where}: entry for {index.fqn!r} has malformed transform descriptors")
        elif descs:
            users.setdefault(descs, []).append((index.fqn, str(getattr(info, "relative_path", ""))))
    if not users:
        return
    resolver = ExtensionResolver(transport, root)
    for descs, items in sorted(users.items()):
        keys = sorted({k for k, _f in items})
        files = sorted({f for _k, f in items})
        try:
            resolver.resolve(descs, transport.url(transport.join(root, files[0])), keys[0])
        except DcpStorageError as exc:  # UnknownExtensionError: the descriptor, the distribution to install
            report.problems.append(
                f"{exc}; a load would fail: {len(items)} item(s) in {len(files)} file(s) need it "
                f"({format_keys(keys, _KEYS_NAMED)})"
            )
    report.checked["extensions"] = len({d for descs in users for d in descs})


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SIBLINGS_NAMED])
    return shown + (f" and {len(names) - _SIBLINGS_NAMED} more" if len(names) > _SIBLINGS_NAMED else "")


def check_shard_set(report: VerifyReport, transport: Any, root: str, name: str) -> None:
    """Name the index and siblings of ``name`` (a file under ``root``) if it is one shard of an HF set."""
    shard = HF_SHARD_RE.match(name)
    if shard is None:
        return
    number, _, total = name[len(shard.group("prefix")) + 1 : -len(".safetensors")].partition("-of-")
    count = int(total)
    siblings = [f"{shard.group('prefix')}-{i:0{len(number)}d}-of-{total}.safetensors" for i in range(1, count + 1)]
    siblings = [s for s in siblings if s != name]
    index = shard.group("prefix") + INDEX_SUFFIX
    try:
        present = set(transport.listdir(root))
    except DcpStorageError as exc:  # an unlistable parent: say what to look for
        report.notes.append(f"{name} is one shard of a sharded set of {count}; its directory cannot be listed ({exc})")
        return
    missing = [s for s in [index, *siblings] if s not in present]
    where = transport.url(root)
    if missing:
        report.problems.append(
            f"{name} is shard {int(number)} of a sharded set of {count}, but {_listed(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing from {where}: the set cannot be loaded "
            f"(an interrupted save or download?)"
        )
        return
    report.notes.append(
        f"{name} is one shard of a sharded set: verify {posixpath.join(where, index)} to check the whole set "
        f"(siblings: {_listed(siblings)})"
    )
