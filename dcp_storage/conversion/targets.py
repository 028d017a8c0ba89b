"""Which format ``convert`` writes: the registry's formats that declare a ``convert_target``.

``to`` names a target (``"dcp"``, ``"safetensors"``, ``"torch"``, or a plugin format's) or one of its
aliases; without ``to`` the destination's name decides, through the formats' ``suffixes`` (``.safetensors``,
``.pt``...). Nothing here knows a format: a plugin's format that declares a target is one like the others.
"""

from __future__ import annotations

import os
import posixpath

from dcp_storage.errors import TargetError
from dcp_storage.formats.convert_target import ConvertTarget
from dcp_storage.formats.detection import registered_formats
from dcp_storage.formats.spec import FormatSpec

__all__ = ["convert_targets", "infer_target", "resolve_target", "target_names"]


def convert_targets() -> dict[str, tuple[FormatSpec, ConvertTarget]]:
    """``{target name or alias: (spec, target)}`` for every registered format ``convert`` can write."""
    out: dict[str, tuple[FormatSpec, ConvertTarget]] = {}
    for spec in registered_formats().values():
        target = spec.convert_target
        if isinstance(target, ConvertTarget):
            for name in (target.name, *target.aliases):
                out.setdefault(name.lower(), (spec, target))
    return out


def target_names() -> list[str]:
    """The target names ``to`` accepts (aliases left out), sorted."""
    return sorted({target.name for _spec, target in convert_targets().values()})


def _basename(url: str) -> str:
    return posixpath.basename(url.rstrip("/").replace(os.sep, "/"))


def infer_target(dst: str) -> str | None:
    """The target a destination's name implies (one format's ``suffixes``), or ``None``: a plain directory
    name, or a suffix that several formats claim."""
    name = _basename(dst).lower()
    claims = {
        target.name
        for spec, target in convert_targets().values()
        if any(name.endswith(suffix.lower()) for suffix in spec.suffixes)
    }
    return claims.pop() if len(claims) == 1 else None


def resolve_target(to: str | None, dst: str, check_suffix: bool = True) -> tuple[FormatSpec, ConvertTarget]:
    """The format to write ``dst`` in; :class:`TargetError` when it cannot be told or contradicts the name."""
    if _basename(dst).lower().endswith(".index.json"):
        raise TargetError(f"{dst!r}: pass the output directory; the index is named and written by the converter")
    targets = convert_targets()
    names = ", ".join(target_names())
    if to is None:
        guessed = infer_target(dst)
        if guessed is None:
            raise TargetError(f"cannot tell the output format from {dst!r}; pass to= one of {names} (--to)")
        return targets[guessed]
    found = targets.get(str(to).strip().lower())
    if found is None:
        raise TargetError(f"unknown output format {to!r}; choose one of {names}")
    implied = infer_target(dst)
    if check_suffix and implied is not None and implied != found[1].name:
        raise TargetError(
            f"{dst!r} names a {implied} file but the output format is {found[1].name}; rename it or drop --to"
        )
    return found
