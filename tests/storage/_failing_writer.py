"""A writer whose ``write_data`` fails while ``fail_writes`` is set: importable by name, because PROCESS-mode
``async_save`` pickles it into torch's checkpoint process (``test_async_save.py``)."""

from __future__ import annotations

from typing import Any

from dcp_storage import FsspecWriter


class FailingFsspecWriter(FsspecWriter):
    fail_writes = True

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.fail_writes:
            raise OSError("injected write failure, after the claim")
        return super().write_data(plan, planner)
