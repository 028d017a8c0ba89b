"""What a load matched: :class:`LoadResult` (``planner.result``) and the key-map hint for strict errors."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["LoadResult", "suggest_key_map", "warn_nothing_matched"]

# Bounds on the hint's search: it runs only when a strict load is about to fail.
_HINT_MAX_KEYS = 20_000
_HINT_MAX_DROP = 3  # longest run of key components a prefix may have


@dataclass(frozen=True)
class LoadResult:
    """The outcome of matching a state dict with a checkpoint, set on the planner by ``create_local_plan``.

    ``missing_keys`` and ``unexpected_keys`` mean what they mean for ``nn.Module.load_state_dict``:
    state-dict keys the checkpoint lacks (left untouched), and checkpoint keys that no state-dict key
    loads from (state-dict order and checkpoint-metadata order respectively). ``renamed`` maps each
    state-dict key that loads from a differently named checkpoint key to that key; ``casts`` maps each
    state-dict key whose stored dtype differs from its destination's to ``(stored, destination)``.
    """

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = field(default_factory=dict)


def suggest_key_map(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """A hint such as ``KeyMap.add_prefix('module.') would match 12 of the missing keys``, or ``""``.

    Looks for one run of up to three dot-separated components that, dropped from (added to) the
    checkpoint's unexpected keys, gives the state dict's missing keys.
    """
    if not missing or not unexpected or len(missing) > _HINT_MAX_KEYS or len(unexpected) > _HINT_MAX_KEYS:
        return ""
    votes: Counter[tuple[str, str, str]] = Counter()  # (factory, scope, prefix)
    for longer, shorter, factory in (
        (unexpected, set(missing), "add_prefix"),
        (missing, set(unexpected), "strip_prefix"),
    ):
        for key in longer:
            parts = key.split(".")
            for i in range(len(parts) - 1):
                for j in range(i + 1, min(i + _HINT_MAX_DROP, len(parts) - 1) + 1):
                    if ".".join(parts[:i] + parts[j:]) in shorter:
                        scope = "".join(p + "." for p in parts[:i])
                        prefix = "".join(p + "." for p in parts[i:j])
                        votes[(factory, scope, prefix)] += 1
    if not votes:
        return ""
    (factory, scope, prefix), count = votes.most_common(1)[0]
    text = f"KeyMap.{factory}({prefix!r})"
    if scope:
        text = f"KeyMap.within({scope!r}, {text})"
    return f"key_map={text} would match {count} of the missing keys"


def warn_nothing_matched(who: str, state_dict_keys: int, checkpoint_keys: int, hint: str) -> None:
    """Warn that a partial load matched no key at all: it will load nothing (``who`` names the planner)."""
    warnings.warn(
        f"{who}: none of the {state_dict_keys} state-dict keys is among the checkpoint's {checkpoint_keys} keys, "
        "so this partial load loads nothing"
        + (f"; {hint}" if hint else "; check the key map and the checkpoint's keys (dcp-storage inspect)"),
        stacklevel=4,
    )
