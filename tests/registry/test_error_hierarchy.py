"""Every exception class dcp-storage defines derives from :class:`~dcp_storage.errors.DcpStorageError`.

Walks every module of the library and checks each ``Exception`` subclass defined there, so that
``except DcpStorageError`` catches whatever the library raises. Two kinds are named, each with its reason:

* control-flow signals (:data:`SIGNALS`): raised and caught inside the library ("fetch more bytes",
  "take the slow path", "retry this read"), never raised to a caller. Making them ``DcpStorageError``s
  would let the library's own ``except DcpStorageError`` clauses between raise and catch swallow them,
  and the transport's retry layer classifies the two read signals as transient ``OSError``s;
* ``dcp_storage_testing``: the test harness (server fixtures, rank launchers), whose errors carry
  multi-line logs and tracebacks that ``DcpStorageError`` would escape onto one line.

Also: the classes moved into ``errors.py`` keep their old import paths, and the version has one source.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import dcp_storage
from dcp_storage.errors import DcpStorageError

SIGNALS = {
    "NeedMoreTail": "a seekable transform asks for more of the item's tail (framed_items catches it)",
    "NeedMoreBytes": "a tensor record parser asks for more bytes (item_loader, framed_items)",
    "LegacyNeedsMoreBytes": "the legacy torch.save scanner asks for more bytes (torch_save/archive)",
    "UnsupportedRecord": "a record the fast parser does not handle: the loader falls back to the full one",
    "StandInRefusal": "an allow-listed stand-in refuses; the unpickler raises UnsafeCheckpointError naming the file",
    "TruncatedReadError": "a short body, retried by the transport (an OSError to the retry classifier)",
    "RangeMismatchError": "an answer for another range, retried by the transport (as above)",
    "StaleManifestWarning": "a warning, not an error: a manifest that belongs to another .metadata is ignored "
    "(said once, naming both files) and the load goes on (integrity/manifest.py)",
    "_Mismatch": "a new state that does not fit the kept staging buffers; caught at once, the state is staged "
    "afresh (manager/retention.py)",
    "VersionConditionFailed": "a store refused a read conditioned on the pinned version (412); the transport "
    "raises ObjectChangedError naming the URL in its place (transports/guards.py)",
    "AttemptTimeoutError": "a request still running at its operation's deadline, cancelled; the retry layer "
    "gives up with a TransportError naming the URL (raised only inside an operation's deadline)",
    "_Prepared": "carries a request botocore built and signed out of its before-send event, unsent; caught at "
    "once by the caller that asked for it (transports/s3.py, direct reads)",
    "DecodesTooLarge": "a seek table claims more decoded bytes than allowed: the extension resolver raises "
    "CorruptCheckpointError naming the item (framed_items.decode_whole to extensions.untransform)",
    "_NotCanonical": "a record pickle that is not torch's canonical layout: the generic unpickler takes it",
    "_DuplicateKey": "a duplicate JSON key, turned into CorruptCheckpointError naming the file by the header parser",
    "_PayloadPending": "a slice whose payload has not arrived yet: the delivery loop keeps draining",
    "_Refused": "the pickle guard's walk refuses a state change; guard_pickle raises UnsafeCheckpointError naming it",
}
HARNESS = "dcp_storage_testing"


def _modules() -> list[str]:
    names = [dcp_storage.__name__]
    for info in pkgutil.walk_packages(dcp_storage.__path__, prefix="dcp_storage."):
        if info.name != HARNESS and not info.name.startswith(HARNESS + "."):
            names.append(info.name)
    return names


def exception_classes() -> dict[str, type[BaseException]]:
    """``module.Class`` -> class, for every exception class defined (not imported) in a dcp_storage module."""
    found = {}
    for name in _modules():
        if name.endswith("__main__"):
            continue  # running it would start the CLI
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name:
                found[f"{name}.{attr}"] = value
    return found


def test_every_error_class_is_a_dcp_storage_error() -> None:
    classes = exception_classes()
    assert len(classes) > 20, sorted(classes)  # the walk found the package's errors
    outside = sorted(
        name for name, cls in classes.items() if not issubclass(cls, DcpStorageError) and cls.__name__ not in SIGNALS
    )
    assert outside == []


def test_every_named_signal_exists_and_stays_internal() -> None:
    """The list above cannot rot, nor hide a public error: each name is defined, and none is exported."""
    defined = {cls.__name__ for cls in exception_classes().values()}
    assert set(SIGNALS) <= defined, sorted(set(SIGNALS) - defined)
    assert not set(SIGNALS) & set(dcp_storage.__all__)


def test_moved_errors_keep_their_old_import_paths() -> None:
    from dcp_storage.conversion.engine import TargetError as old_target
    from dcp_storage.errors import TargetError, UnknownFormatError
    from dcp_storage.opening import UnknownFormatError as old_unknown
    from dcp_storage.opening import UnknownFormatError as top

    assert top is old_unknown is UnknownFormatError
    assert old_target is TargetError and issubclass(TargetError, (DcpStorageError, ValueError))


def test_the_version_has_one_source() -> None:
    from dcp_storage import _version

    assert dcp_storage.__version__ == _version.__version__
    provenance = importlib.import_module("dcp_storage.integrity.manifest")
    assert _version.__version__ in provenance.writer_descriptor()
