"""The ``Future`` a reader's ``read_data`` returns, of whichever kind.

torch's ``StorageReader.read_data`` is typed to return a ``torch.futures.Future`` and ``dcp.load`` calls its
``wait()``. A plugin's reader that returns a ``concurrent.futures.Future`` (what an executor's ``submit``
gives) failed late, inside torch, with ``AttributeError: 'Future' object has no attribute 'wait'``. Here:

* :func:`wait_for` (what the core calls on any reader's result): waits on a torch future, a
  ``concurrent.futures.Future`` or anything with ``wait()``, and raises :class:`FutureTypeError` naming the
  reader and the type to return for anything else;
* :func:`as_torch_future` (exported by the plugin API): a ``concurrent.futures.Future`` as the torch future
  ``dcp.load`` waits on, so a reader can ``return as_torch_future(pool.submit(...))``.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from dcp_storage.errors import DcpStorageError

__all__ = ["FutureTypeError", "as_torch_future", "wait_for"]

_USE = "return a torch.futures.Future (or wrap a concurrent.futures.Future with plugin_api.as_torch_future)"


class FutureTypeError(DcpStorageError, TypeError):
    """A reader's ``read_data`` returned something that is not a future; the message names the reader."""


def wait_for(result: Any, reader: object) -> Any:
    """Wait for what ``reader.read_data`` returned, whichever future type it is; its value."""
    if isinstance(result, concurrent.futures.Future):
        return result.result()
    wait = getattr(result, "wait", None)
    if callable(wait):
        return wait()
    raise FutureTypeError(f"{type(reader).__name__}.read_data returned a {type(result).__name__}: {_USE}")


def as_torch_future(future: concurrent.futures.Future[Any]) -> Any:
    """A ``torch.futures.Future`` completed with ``future``'s result or error, for ``dcp.load`` to wait on."""
    import torch.futures  # torch only when a reader asks: this module sits below every torch import

    out: torch.futures.Future[Any] = torch.futures.Future()

    def done(f: concurrent.futures.Future[Any]) -> None:
        error = f.exception()
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(f.result())

    future.add_done_callback(done)
    return out
