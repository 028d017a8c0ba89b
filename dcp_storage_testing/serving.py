"""One way for test fixtures to run a local server: start it, or skip (fail on CI) naming why; stop it after.

Every server a test needs (moto, fake-gcs-server, azurite) is started by a fixture. Where it cannot start
(a missing binary, a port race), a developer's run skips those tests, but CI (``CI=true``) fails them:
a skipped storage test on CI would hide a broken install step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

from dcp_storage_testing._server_process import StartStop

__all__ = ["in_ci", "serving"]

S = TypeVar("S", bound=StartStop)


def in_ci() -> bool:
    """Whether this run is CI's (``CI`` set to 1, true or yes)."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@contextlib.contextmanager
def serving(name: str, make: Callable[[], S], errors: tuple[type[BaseException], ...]) -> Iterator[S]:
    """``make()``, started, and stopped on exit. If making or starting it raises one of ``errors``, the
    current test is skipped, or failed on CI, with ``"<name> unavailable: <error>"``."""
    import pytest

    try:
        server = make()
        server.start()
    except errors as exc:
        message = f"{name} unavailable: {exc}"
        if in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    try:
        yield server
    finally:
        server.stop()
