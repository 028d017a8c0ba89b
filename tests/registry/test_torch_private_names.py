"""Private torch names, and the interpreter's private stack functions, are used in one module only.

torch keeps much of what DCP storage needs under private names (``torch.distributed.checkpoint._extension``,
``filesystem._StorageInfo``, ``distributed_c10d._get_object_coll_device``, ...), and the DCP call detection
reads torch's frames through ``sys._getframe``. Every such name lives in :mod:`dcp_storage._torch`, behind
an alias or a small function, so a torch release that renames one breaks that module only. This test
parses (never imports) every module of ``dcp_storage``, ``dcp_storage_testing`` and the in-tree plugins'
package code (their tests and test support excluded, as in ``test_plugin_imports``; the scaffold's
non-test templates included) and finds, per module:

* imports of a ``torch`` or ``sys`` path with a private component (``from torch.x._y import z``,
  ``from torch.x import _y``, ``import torch._dynamo``);
* attribute paths rooted at such an import (``torch._C.X``, ``dist.distributed_c10d._f``, ``sys._getframe``),
  and ``getattr``/``hasattr`` of a private name on one (``getattr(torch, "_C")``);
* strings that are such a dotted path (``sys.modules.get("torch._dynamo.eval_frame")``), except the
  module half of a ``(module, name)`` pair: those are the global names ``torch.save`` writes into its
  pickles, which our decoders match as data and never import or call;
* attributes named like a private leaf of :data:`dcp_storage._torch.PRIVATE_NAMES` on any object
  (``module._modules``, ``model._orig_mod``): torch internals reached through an instance.

Only ``dcp_storage/_torch.py`` may have any, and what it has must be exactly its ``PRIVATE_NAMES``.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

from dcp_storage import _torch

REPO = Path(__file__).resolve().parents[2]
HOME = REPO / "dcp_storage" / "_torch.py"
ROOTS = ("torch", "sys")
TEST_SUPPORT = {"testing.py", "_rank_checks.py", "conftest.py"}
_DOTTED = re.compile(r"(?:torch|sys)(?:\.\w+)+")


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in dotted.split("."))


def _private_leaves() -> set[str]:
    return {n.rpartition(".")[2] for n in _torch.PRIVATE_NAMES if _private(n.rpartition(".")[2])}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the ``torch``/``sys`` path it is bound to by an import (anywhere in the module)."""
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ROOTS:
                    found[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in ROOTS:
                for a in node.names:
                    found[a.asname or a.name] = f"{node.module}.{a.name}"
    return found


def _resolve(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The dotted path of ``a.b.c`` when ``a`` is bound to a ``torch``/``sys`` import, else ``None``."""
    chain: list[str] = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(chain)])
    return None


def private_uses(source: str, leaves: set[str] | frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """``(line, name)`` of every private ``torch``/``sys`` name ``source`` uses (module docstring), and of
    every attribute named one of ``leaves``."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    uses: list[tuple[int, str]] = []
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    listing = {  # the strings of a ``PRIVATE_NAMES = (...)`` assignment: the list, not a use
        id(c)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        and any(
            isinstance(t, ast.Name) and t.id == "PRIVATE_NAMES"
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        )
        for c in ast.walk(n)
    }
    pickle_modules = {
        id(n.elts[0])
        for n in ast.walk(tree)
        if isinstance(n, ast.Tuple)
        and len(n.elts) == 2
        and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in n.elts)
    }
    for node in ast.walk(tree):
        name: str | None = None
        if isinstance(node, ast.Import):
            uses += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in ROOTS and _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in ROOTS:
                uses += [
                    (node.lineno, f"{node.module}.{a.name}") for a in node.names if _private(f"{node.module}.{a.name}")
                ]
        elif isinstance(node, ast.Attribute):
            path = _resolve(node, aliases)
            if path is None and node.attr in leaves:
                name = f"<object>.{node.attr}"
            elif id(node) not in inner:  # the outermost attribute of a chain names the whole path
                name = path
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                base = _resolve(node.args[0], aliases)
                name = None if base is None else f"{base}.{node.args[1].value}"
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pickle_modules | listing
        ):
            if _DOTTED.fullmatch(node.value):
                name = node.value
        if name is not None and (_private(name) or name.startswith("<object>.")):
            uses.append((getattr(node, "lineno", 0), name))
    return sorted(set(uses))


def _is_test_support(path: Path) -> bool:
    return "tests" in path.parts or path.name.startswith("test_") or path.name in TEST_SUPPORT


def _sources() -> list[Path]:
    files = sorted((REPO / "dcp_storage").rglob("*.py")) + sorted((REPO / "dcp_storage_testing").rglob("*.py"))
    for plugin in sorted(p for p in (REPO / "plugins").iterdir() if (p / "pyproject.toml").is_file()):
        files += [f for f in sorted(plugin.rglob("*.py")) if not _is_test_support(f.relative_to(plugin))]
    templates = sorted((REPO / "dcp_storage" / "plugin_template").glob("*.py.tmpl"))
    return files + [t for t in templates if not t.name.startswith("test_")]


def _read(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".tmpl":  # string.Template placeholders ($name) -> identifiers
        text = re.sub(r"\$(\w+)", r"tmpl_\1", text)
    return text


def test_the_sources_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in _sources()}
    assert "dcp_storage/_torch.py" in names
    assert "dcp_storage/strategies/collectives.py" in names
    assert "dcp_storage_testing/conformance/mixin.py" in names
    assert "plugins/dcp-storage-zstd/dcp_storage_zstd/extension.py" in names
    assert "plugins/dcp-storage-zstd/dcp_storage_zstd/testing.py" not in names  # test support


def test_private_torch_names_are_used_in_one_module_only() -> None:
    leaves = _private_leaves()
    bad = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in _sources()
        if path != HOME
        for line, name in private_uses(_read(path), leaves)
    ]
    assert bad == [], (
        "private torch (or sys) names outside dcp_storage/_torch.py; give each an alias or accessor there "
        "(listed in PRIVATE_NAMES, saying why and in which torch versions it was checked) and import that:\n"
        + "\n".join(bad)
    )


def test_the_one_module_lists_exactly_what_it_uses() -> None:
    listed = _torch.PRIVATE_NAMES
    print("\n".join(listed))
    assert list(listed) == sorted(set(listed)), "PRIVATE_NAMES: keep it sorted, each name once"
    source = HOME.read_text(encoding="utf-8")
    # here every private attribute counts, listed or not: a torch internal reached through an object
    every_private_attribute = {
        n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute) and _private(n.attr)
    }
    uses = private_uses(source, every_private_attribute)
    resolved = {name for _, name in uses if not name.startswith("<object>.")}
    on_objects = {name.partition(".")[2] for _, name in uses if name.startswith("<object>.")}
    unlisted = sorted(resolved - set(listed)) + sorted(on_objects - _private_leaves())
    assert unlisted == [], f"dcp_storage/_torch.py uses private names its PRIVATE_NAMES does not list: {unlisted}"
    unused = [n for n in listed if n not in resolved and n.rpartition(".")[2] not in on_objects]
    assert unused == [], f"PRIVATE_NAMES lists names dcp_storage/_torch.py does not use: {unused}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "from torch.distributed.checkpoint.filesystem import _StorageInfo",
            "torch.distributed.checkpoint.filesystem._StorageInfo",
        ),
        ("from torch.distributed.checkpoint import _version", "torch.distributed.checkpoint._version"),
        (
            "from torch.distributed.checkpoint._extension import ExtensionRegistry",
            "torch.distributed.checkpoint._extension.ExtensionRegistry",
        ),
        ("import torch._dynamo", "torch._dynamo"),
        (
            "import torch.distributed as dist\ndist.distributed_c10d._get_pg_default_device(None).type",
            "torch.distributed.distributed_c10d._get_pg_default_device",
        ),
        ("import torch\ntorch._C.PyTorchFileWriter(f)", "torch._C.PyTorchFileWriter"),
        ("def f():\n    import sys\n    return sys._getframe(1)", "sys._getframe"),
        ("import sys\nsys.modules.get('torch._dynamo.eval_frame')", "torch._dynamo.eval_frame"),
        ("import torch\ngetattr(torch, '_utils')", "torch._utils"),
        ("def f(module):\n    return module._modules", "<object>._modules"),
        ("def f(model):\n    return model._orig_mod", "<object>._orig_mod"),
    ],
)
def test_each_kind_of_use_is_found(source: str, expected: str) -> None:
    assert expected in [name for _, name in private_uses(textwrap.dedent(source), _private_leaves())]


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.__version__",
        "import torch.distributed.checkpoint as dcp\ndcp.FileSystemReader",
        "TABLE = {('torch._utils', '_rebuild_tensor_v2'): None}",  # a pickle's global name: data, not a use
        '"""Docstrings may say ``torch._utils._rebuild_tensor_v2``."""',
        "def f(self):\n    return self._cache",
        "from dcp_storage._torch import StorageInfo\nStorageInfo('f', 0, 1)",
    ],
)
def test_what_is_not_a_use(source: str) -> None:
    assert private_uses(source, _private_leaves()) == []
