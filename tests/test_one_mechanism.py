"""One mechanism per concern: each of these jobs has one home in ``dcp_storage``, and these tests keep it so.

* the coordinator broadcast: :func:`dcp_storage.strategies.share_object` (error on every rank, no hang);
* the coordinator reads and sends: :class:`dcp_storage.strategies.coordinator_served.CoordinatorServedReader`
  (``Broadcasting``, ``BroadcastingTorchSaveReader``), on one sender that finishes or tells every waiting rank
  the error (:func:`dcp_storage.strategies.slice_delivery.sending`);
* a reader's read-strategy wiring: :class:`dcp_storage.strategies.read_strategy.StrategyReading`;
* a load's and a save's set-up: :class:`dcp_storage.formats.location.LoadingLocation` and ``SavingLocation``;
* the device a group's collectives use: :class:`dcp_storage.strategies.collectives.GroupView`, which asks
  torch's rule through :func:`dcp_storage._torch.object_coll_device` (the one module naming it);
* the byte runs of a row-major slice: :func:`dcp_storage.formats.slices.row_major_runs`;
* the checkpoint's file names: :mod:`dcp_storage.formats.paths`;
* reading a store error (its code, status, causes): :mod:`dcp_storage.transports.retry`;
* reading the manifest file: :func:`dcp_storage.integrity.manifest.manifest_bytes`;
* importing by name (registry entries, lazily exported names, error classes rebuilt from their names):
  :func:`dcp_storage.registry.import_target`, with :func:`dcp_storage.registry.lazy_exports`.

All but the run calculator's read the package's source (a second copy is a source fact); the third checks
the calculator's every consumer against brute force.
"""

from __future__ import annotations

import ast
import functools
import random
from pathlib import Path

import pytest
import torch

import dcp_storage
from dcp_storage.formats import paths
from dcp_storage.formats.slices import count_runs, row_major_runs, slice_runs

PACKAGE = Path(dcp_storage.__file__).parent
FILE_NAMES = {
    paths.METADATA_FILE,
    paths.DATA_SUFFIX,
    paths.MANIFEST_FILE,
    paths.LOCK_FILE,
    paths.SAFETENSORS_SUFFIX,
    paths.INDEX_SUFFIX,
    paths.INDEX_FILE,
    paths.EXTRA_STATE_FILE,
}


@functools.cache  # parsed once per session: the source does not change while the tests run
def _modules() -> dict[str, ast.Module]:
    return {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text(encoding="utf-8")) for p in PACKAGE.rglob("*.py")}


def _where_named(names: set[str]) -> dict[str, list[int]]:
    """Modules (and lines) that name any of ``names`` as an attribute, an imported name or a variable."""
    found: dict[str, list[int]] = {}
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.alias):
                name = node.name.rpartition(".")[2]
            if name in names:
                found.setdefault(module, []).append(getattr(node, "lineno", 0))
    return found


def test_one_coordinator_broadcast() -> None:
    assert set(_where_named({"broadcast_object_list"})) == {"strategies/collectives.py"}


def _calls(name: str) -> set[str]:
    """Modules that call ``name(...)`` (as a plain name or an attribute)."""
    found = set()
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = (
                    func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                )
                if called == name:
                    found.add(module)
    return found


def _subclasses_of(base: str) -> set[str]:
    """Modules defining a class with ``base`` among its bases."""
    found = set()
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                (b.id if isinstance(b, ast.Name) else getattr(b, "attr", None)) == base for b in node.bases
            ):
                found.add(module)
    return found


def _strings_with(text: str) -> set[str]:
    """Modules holding a string constant (an f-string's literal parts too) that contains ``text``."""
    found = set()
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and text in node.value:
                found.add(module)
    return found


def test_one_coordinator_reads_and_sends() -> None:
    """One rank reading for the others is one serving step, on one sender that always finishes or aborts."""
    assert _subclasses_of("CoordinatorServedReader") == {"strategies/broadcasting.py", "formats/torch_save/reader.py"}
    assert _calls("SliceSender") == {"strategies/slice_delivery.py"}  # built only by ``sending``
    assert _calls("sending") == {"strategies/coordinator_served.py", "fsdp/scatter.py"}
    assert _calls("receive_items") == {"strategies/coordinator_served.py", "fsdp/scatter.py"}
    # a destination is checked against a slice another rank read in one place (sent, staged, or exchanged)
    shape_checks = {m for m in _strings_with("destination has shape") if m.startswith("strategies/")}
    assert shape_checks == {"strategies/slice_delivery.py"}


def test_one_read_strategy_wiring() -> None:
    """Every format's reader composes the same read-strategy wiring; none chooses a strategy itself."""
    assert _calls("choose_read_strategy") == {"strategies/read_strategy.py"}
    assert set(_where_named({"READ_STRATEGY_OPTION"})) == {"transports/__init__.py", "strategies/read_strategy.py"}
    assert _calls("StrategyReading") == {
        "formats/dcp_native/reader.py",
        "formats/safetensors/reader.py",
        "formats/raw_reader.py",
    }


def _defines(name: str) -> set[str]:
    """Modules defining a function or method called ``name``."""
    found = set()
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found.add(module)
    return found


def test_one_load_and_save_set_up() -> None:
    """Readers start each load, and writers each save, through formats/location.py (the torch.save reader,
    which binds its transport lazily, pins objects itself)."""
    assert _calls("begin_load") == {"formats/location.py", "formats/torch_save/reader.py"}
    assert _defines("set_up_storage_writer") == {"formats/location.py"}
    assert _defines("storage_meta") == {"formats/location.py"}


def test_one_group_device_rule() -> None:
    rules = {"_get_object_coll_device", "_get_pg_default_device", "get_backend"}
    assert set(_where_named(rules)) == {"_torch.py"}
    assert set(_where_named({"object_coll_device"})) == {"strategies/collectives.py"}  # its one caller


def test_checkpoint_file_names_are_defined_once() -> None:
    defined: dict[str, list[str]] = {}
    for module, tree in _modules().items():
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
                if node.value.value in FILE_NAMES:
                    defined.setdefault(module, []).append(node.value.value)
    assert set(defined) == {"formats/paths.py"}, defined
    assert sorted(defined["formats/paths.py"]) == sorted(FILE_NAMES - {paths.INDEX_FILE})  # INDEX_FILE is built


def _brute_force(
    shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...], itemsize: int
) -> list[int]:
    """Every byte of the box, in its row-major order, as offsets into the full tensor's bytes."""
    ids = torch.arange(int(torch.Size(shape).numel()), dtype=torch.int64).reshape(shape)
    box = ids[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    return [int(e) * itemsize + b for e in box.reshape(-1).tolist() for b in range(itemsize)]


def test_every_view_of_the_run_calculator_agrees_with_brute_force() -> None:
    rng = random.Random(11)
    for _ in range(400):
        ndim = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 5) for _ in range(ndim))
        offsets = tuple(rng.randint(0, s - 1) for s in shape)
        lengths = tuple(rng.randint(0, s - o) for s, o in zip(shape, offsets))
        itemsize, base = rng.choice([1, 2, 4, 8]), rng.randint(0, 1000)
        expected = _brute_force(shape, offsets, lengths, itemsize)
        runs = row_major_runs(shape, offsets, lengths, itemsize)
        starts, length = slice_runs(shape, offsets, lengths, itemsize, base)
        where = (shape, offsets, lengths, itemsize)
        assert [o + b for o in runs.offsets() for b in range(runs.length)] == expected, where
        assert [s - base + b for s in starts for b in range(length)] == expected, where
        assert count_runs(shape, offsets, lengths) == len(starts) == runs.count, where
        assert runs.nbytes == len(expected), where


@pytest.mark.parametrize(
    ("offsets", "lengths"), [((2, 0), (3, 4)), ((0, -1), (4, 2)), ((0,), (4,)), ((0, 0, 0), (1, 1, 1))]
)
def test_the_run_calculator_refuses_boxes_outside_the_tensor(
    offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> None:
    for ask in (
        lambda: row_major_runs((4, 4), offsets, lengths, 4),
        lambda: slice_runs((4, 4), offsets, lengths, 4),
        lambda: count_runs((4, 4), offsets, lengths),
    ):
        with pytest.raises(ValueError, match=r"shape \(4, 4\)"):
            ask()


def _get_calls_with(key: str) -> set[str]:
    """Modules that call ``.get(key, ...)``: reading a field of a store's error response."""
    found = set()
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == key
            ):
                found.add(module)
    return found


def test_one_reading_of_store_errors() -> None:
    """A store error's code is read in one place (``transports.retry.error_code``); ``access`` reads only the
    message from the same field to word its errors."""
    assert _get_calls_with("Error") == {"transports/retry.py", "transports/access.py"}


def test_one_read_of_the_manifest_file() -> None:
    """The manifest's size limit (``paths.MANIFEST``) is used by the one function that reads the file."""
    assert set(_where_named({"MANIFEST"})) == {"formats/paths.py", "integrity/manifest.py"}


def test_one_import_by_name() -> None:
    """``importlib.import_module`` is called in ``registry.py`` only: the package and ``plugin_api`` export
    lazily through ``registry.lazy_exports``, the collectives rebuild error classes through ``import_target``."""
    callers = {
        module
        for module, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "import_module"
    }
    assert callers == {"registry.py"}, callers
    lazy = {
        module
        for module, tree in _modules().items()
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    }
    assert lazy == set(), f"module-level __getattr__ written by hand (use registry.lazy_exports): {lazy}"
