"""Which registered format a probed location holds: the one sniffer shared by ``open_reader`` and the readers.

:func:`dcp_storage.open_reader` asks it to pick a reader; a reader that finds no checkpoint of its own
format asks it (on that error path only) whether another format is there, to name it and the reader to use
(:mod:`.misdirected`). Both see the same scores, so the hint never disagrees with what ``open_reader``
would do.
"""

from __future__ import annotations

from dcp_storage import registry
from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.spec import FormatSpec, Probe

__all__ = ["registered_formats", "score_formats", "best_formats"]


def registered_formats() -> dict[str, FormatSpec]:
    """Every format of the registry (built-in and plugins), by name."""
    return {name: spec for name, spec in registry.load_all("formats").items() if isinstance(spec, FormatSpec)}


def score_formats(probe: Probe, specs: dict[str, FormatSpec]) -> tuple[dict[str, int], list[str]]:
    """Each format's sniffer score for ``probe`` (formats that do not match are left out), and the errors
    sniffers raised (``"name: message"``)."""
    scores: dict[str, int] = {}
    failures: list[str] = []
    for name, spec in specs.items():
        try:
            score = spec.sniff(probe)
        except DcpStorageError as exc:
            failures.append(f"{name}: {exc}")
            continue
        if score is not None:
            scores[name] = score
    return scores, failures


def best_formats(scores: dict[str, int]) -> list[str]:
    """The names with the best score, sorted (one name: detected; more: ambiguous; none: unknown)."""
    if not scores:
        return []
    best = max(scores.values())
    return sorted(n for n, s in scores.items() if s == best)
