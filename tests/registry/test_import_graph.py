"""The package's import graph: no cycle, and dependencies point down the layers only.

Every module of ``dcp_storage/`` is parsed (not imported), and every ``import`` statement counts: at module
level, inside functions and under ``if TYPE_CHECKING:``, because a cycle hidden in a function body or a type
annotation is still two modules that cannot be understood, tested or moved one without the other. For
``from a.b import c`` the edge goes to ``a.b.c`` when that is a module, else to ``a.b``; relative imports are
resolved against the importing module's package.

The layers, lowest first (:data:`LAYERS`; a module takes the layer of its longest listed prefix, and every
module must have one, so a new top-level module is a decision, not an accident):

1. ``base``: what every layer may use and that knows no checkpoint: the error hierarchy, message text and
   redaction, the version, the plugin registry, tensor byte views, pausing the collector,
   the pickle guard and safe unpickler, and ``_torch`` (every private torch name, the DCP call detection).
2. ``transports``: bytes only (``transports/``).
3. ``formats``: layout <-> DCP ``Metadata`` (``formats/``), with ``integrity/``, which the readers and
   writers of every format run while they move records (checksum algorithms, the manifest, provenance
   descriptors, checking records on read, carrying checksums to ``finish``, the manifest's format check
   that detection asks first) and whose whole-checkpoint checks use only formats and transports.
4. ``storage``: who reads and how the state dict maps onto the checkpoint: ``planners/``, ``strategies/``,
   the DCP ``StorageReader``/``StorageWriter`` classes (``storage/``, which also registers the built-in
   formats with their reader and writer factories), and ``opening`` (``open_reader``/``open_writer``).
5. ``tools``: what works on whole checkpoints: ``inspection/``, ``conversion/``, ``fsdp/`` loading, the
   plugin scaffold.
6. ``api``: the public surface: the package ``__init__``, ``plugin_api``, and ``testing/`` (the conformance
   suite and fixtures that plugin tests import the way users do, through ``dcp_storage``).
7. ``app``: the command line (``cli``, ``__main__``, ``commands/``) and ``demo``, which drives ``testing``'s
   embedded servers and rank launcher.

A module may import its own layer or a lower one; within a layer only the no-cycle rule applies.

Function-level imports of ``dcp_storage`` modules are a smell (they are how the old cycles hid), so each one
left says why on its line or the line above (a ``#`` comment): a heavy or optional dependency (torch for
``dcp-storage --help``), or test support that must not load with the package.
"""

from __future__ import annotations

import ast
import graphlib
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "dcp_storage"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

BASE, TRANSPORTS, FORMATS, STORAGE, TOOLS, API, APP = range(7)
LAYER_NAMES = ("base", "transports", "formats", "storage", "tools", "api", "app")
# module prefix -> layer; the longest matching prefix wins (see the module docstring for what each layer is)
LAYERS: dict[str, int] = {
    "_version": BASE,
    "_torch": BASE,  # every private torch name, and the DCP call read from the stack
    "errors": BASE,
    "runtime": BASE,
    "text": BASE,
    "registry": BASE,
    "pickle_guard": BASE,
    "pickle_tags": BASE,
    "safe_unpickle": BASE,
    "transports": TRANSPORTS,
    "formats": FORMATS,
    # the DCP StorageReader/StorageWriter classes, each in its format's folder, compose formats with strategies
    "formats.builtin": STORAGE,
    "formats.dcp_native.reader": STORAGE,
    "formats.dcp_native.writer": STORAGE,
    "formats.safetensors.chunk_exchange": STORAGE,
    "formats.safetensors.reader": STORAGE,
    "formats.safetensors.writer": STORAGE,
    "formats.torch_save.reader": STORAGE,
    "formats.raw_reader": STORAGE,  # the reader format plugins get: raw tensors at known offsets, any strategy
    "integrity": FORMATS,
    "planners": STORAGE,
    "strategies": STORAGE,
    "opening": STORAGE,
    "inspection": TOOLS,
    "conversion": TOOLS,
    "fsdp": TOOLS,
    "manager": TOOLS,
    "": API,  # the package __init__
    "plugin_api": API,
    "cli": APP,
    "__main__": APP,
    "commands": APP,
}


@dataclass(frozen=True)
class Import:
    """One import statement's edge: where it is and whether it runs only when a function is called."""

    source: str
    target: str
    where: str  # file:line, relative to the package's parent directory
    line: int
    in_function: bool
    says_why: bool  # a ``#`` comment on its run of import statements or the line above (:func:`_commented`)


def modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """``dotted.name -> file`` for every module under ``root`` (a package directory)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _nearest_module(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _in_functions(tree: ast.Module) -> set[int]:
    """``id`` of every import node inside a function body (at any depth)."""
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def _commented(tree: ast.Module, lines: list[str]) -> set[int]:
    """``id`` of every import node that says why: a ``#`` comment on the line above a run of consecutive
    import statements, or on one of the run's lines, covers the whole run."""
    covered = set()
    for node in ast.walk(tree):
        for body in (getattr(node, name, None) for name in ("body", "orelse", "finalbody")):
            if not isinstance(body, list):
                continue
            run: list[ast.stmt] = []
            for stmt in [*body, None]:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    run.append(stmt)
                    continue
                if run:
                    first, last = run[0].lineno, run[-1].end_lineno or run[-1].lineno
                    above = lines[first - 2].strip() if first > 1 else ""
                    if above.startswith("#") or any("#" in line for line in lines[first - 1 : last]):
                        covered.update(id(s) for s in run)
                run = []
    return covered


def imports(root: Path, package: str = PACKAGE) -> list[Import]:
    """Every import of a module of ``package`` made by a module under ``root``, as edges between modules."""
    known = modules(root, package)
    # C extensions (``x.c`` built as module ``x``) import nothing of ours: an import of one is no edge.
    compiled = {".".join([package, *p.relative_to(root).with_suffix("").parts]) for p in root.rglob("*.c")}
    edges = []
    for source, path in known.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, str(path))
        own_package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        in_functions = _in_functions(tree)
        commented = _commented(tree, lines)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = own_package.split(".")[: len(own_package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            says_why = id(node) in commented
            for name in targets:
                if name in compiled or name.rpartition(".")[0] in compiled:
                    continue
                target = _nearest_module(name, known) if name == package or name.startswith(package + ".") else None
                if target is not None and target != source:
                    where = f"{path.relative_to(root.parent)}:{node.lineno}"
                    edges.append(Import(source, target, where, node.lineno, id(node) in in_functions, says_why))
    return edges


def layer_of(module: str, package: str = PACKAGE) -> int | None:
    rest = module[len(package) + 1 :] if module != package else ""
    best = None
    for prefix in LAYERS:
        if rest == prefix or rest.startswith(prefix + ".") or prefix == "":
            if best is None or len(prefix) > len(best):
                best = prefix
    if best == "" and rest:
        return None  # only the package __init__ itself takes the "" entry
    return None if best is None else LAYERS[best]


def cycle(edges: list[Import]) -> list[Import]:
    """One import cycle as its edges (empty when there is none)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        nodes = exc.args[1][::-1]  # graphlib gives [a, b, ..., a] with each imported by the next: reverse it
        by_pair = {(e.source, e.target): e for e in edges}
        return [by_pair[(nodes[i], nodes[i + 1])] for i in range(len(nodes) - 1)]
    return []


def _describe(edges: list[Import]) -> str:
    shown = dict.fromkeys(f"  {e.source} -> {e.target}  ({e.where})" for e in edges)  # one line per statement
    return "\n".join(shown)


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(name for name in modules(ROOT) if layer_of(name) is None)
    assert unplaced == [], f"add these modules to LAYERS: {unplaced}"


def test_no_import_cycle_even_through_function_level_imports() -> None:
    edges = imports(ROOT)
    assert len(edges) > 500, len(edges)  # the walk saw the package's imports
    found = cycle(edges)
    assert found == [], "import cycle:\n" + _describe(found)


def test_imports_point_down_the_layers() -> None:
    upward = [e for e in imports(ROOT) if (layer_of(e.source) or 0) < (layer_of(e.target) or 0)]
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(
        f"  {e.source} ({LAYER_NAMES[layer_of(e.source) or 0]}) -> {e.target} "
        f"({LAYER_NAMES[layer_of(e.target) or 0]})  ({e.where})"
        for e in upward
    )


FORMAT_FOLDERS = ("formats.dcp_native", "formats.safetensors", "formats.torch_save")


def test_planners_and_strategies_depend_on_no_format_folder() -> None:
    """The planner and strategy axes see every format through the format core (``formats/*.py``: the
    ``Metadata`` column view, slices, reading), never one format's folder: otherwise a format plugin's
    checkpoint would plan or read differently from a built-in one."""
    axes = tuple(f"{PACKAGE}.{axis}" for axis in ("planners", "strategies"))
    folders = tuple(f"{PACKAGE}.{folder}" for folder in FORMAT_FOLDERS)
    crossing = [e for e in imports(ROOT) if e.source.startswith(axes) and e.target.startswith(folders)]
    assert crossing == [], "a planner or strategy imports one format's internals:\n" + _describe(crossing)


def test_function_level_imports_say_why() -> None:
    silent = [e for e in imports(ROOT) if e.in_function and not e.says_why]
    assert silent == [], "function-level imports with no comment saying why (move them to the top):\n" + _describe(
        silent
    )


# --------------------------------------------------------------------------- the checker checks


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_checker_finds_a_cycle_closed_inside_a_function(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a/__init__.py": "from .one import X\n",
            "a/one.py": "from ..b import two\nX = 1\n",
            "b/__init__.py": "",
            "b/two.py": "def f():\n    from pkg.a import X  # lazy\n    return X\n",
        },
    )
    edges = imports(root, "pkg")
    found = cycle(edges)
    assert {(e.source, e.target) for e in found} == {
        ("pkg.a", "pkg.a.one"),
        ("pkg.a.one", "pkg.b.two"),
        ("pkg.b.two", "pkg.a"),
    }, _describe(found)
    lazy = [e for e in edges if e.in_function]
    assert [(e.source, e.target, e.line, e.says_why) for e in lazy] == [("pkg.b.two", "pkg.a", 2, True)]


def test_the_checker_resolves_names_and_sees_type_only_and_silent_imports(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import H\n",
            "high.py": "import pkg.low\nfrom . import low as L\nimport os\n",
            "sub/__init__.py": "",
            "sub/deep.py": "def g():\n    from ..high import H\n    from .. import low\n",
            "sub/why.py": """\
                def h():
                    # heavy: the comment covers the run of imports below it
                    from ..high import H
                    from .. import low
                    x = 1
                    from ..sub import deep
            """,
        },
    )
    edges = {(e.source, e.target, e.in_function, e.says_why) for e in imports(root, "pkg")}
    assert edges == {
        ("pkg.low", "pkg.high", False, False),
        ("pkg.high", "pkg.low", False, False),
        ("pkg.sub.deep", "pkg.high", True, False),
        ("pkg.sub.deep", "pkg.low", True, False),
        ("pkg.sub.why", "pkg.high", True, True),
        ("pkg.sub.why", "pkg.low", True, True),
        ("pkg.sub.why", "pkg.sub.deep", True, False),
    }


@pytest.mark.parametrize(
    ("module", "layer"),
    [
        ("dcp_storage", API),
        ("dcp_storage.errors", BASE),
        ("dcp_storage.formats.dcp_native.spec", FORMATS),
        ("dcp_storage.integrity.checksums", FORMATS),
        ("dcp_storage.inspection.checks", TOOLS),
        ("dcp_storage.formats.dcp_native.reader", STORAGE),
        ("dcp_storage.commands.convert", APP),
        ("dcp_storage.nonexistent_module", None),
    ],
)
def test_layers_take_the_longest_prefix(module: str, layer: int | None) -> None:
    assert layer_of(module) == layer
