"""What ``verify`` found: :class:`VerifyReport`, filled by every check (``checks``, ``leftovers``, ``load_needs``).

Its own module so the checks that fill it import it from here, not from the module that runs them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["VerifyReport"]


@dataclass
class VerifyReport:
    url: str
    format: str | None
    deep: bool
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}
