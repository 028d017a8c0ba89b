"""The nested paths of a checkpoint's ``planner_data``, checked as one tree before any container is built.

DCP records each key's place in the nested state dict (``("model", "layers", 0, "w")``) in the
metadata's ``planner_data``, and the writers of ``convert`` rebuild the tree from those paths with torch's
``set_element``, which grows a list up to the index it is given. The paths come from the checkpoint, so
they are checked together first, each key named:

- a list index is a non-negative ``int``; the root and a dict hold ``str`` keys, and one container holds
  keys of one kind (a list index mixed with a key raised a bare ``TypeError``);
- a key is a leaf or a container, never both (a tensor under another tensor's key);
- the holes of all lists together (indices no key uses; torch's flattening leaves one only for an empty
  container it dropped) number at most the keys plus :data:`LIST_HOLE_SLACK`: a 910-byte ``.metadata``
  naming index ``2**40`` sent ``convert`` into an unbounded allocation. So the lists built hold no more
  slots than the checkpoint has keys, plus the slack.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dcp_storage.errors import CorruptCheckpointError

__all__ = ["LIST_HOLE_SLACK", "check_tree_paths"]

LIST_HOLE_SLACK = 1024  # list slots no key uses, beyond one per key (empty containers torch dropped)

Path = tuple[Any, ...]


class _Node:
    __slots__ = ("children", "fqn")

    def __init__(self) -> None:
        self.children: dict[Any, _Node] = {}
        self.fqn: str | None = None  # set on a leaf


def _where(url: str, fqn: str) -> str:
    return f"{url}: key {fqn!r} in .metadata's planner_data"


def check_tree_paths(url: str, paths: Mapping[str, Path]) -> None:
    """Raise :class:`CorruptCheckpointError` naming the key when ``paths`` cannot form one nested state dict."""
    root = _Node()
    for fqn, path in paths.items():
        node = root
        for depth, part in enumerate(path):
            if type(part) is int:
                if depth == 0:
                    raise CorruptCheckpointError(
                        f"{_where(url, fqn)} starts with the list index {part}; a state dict's top level holds "
                        "names: the metadata is damaged or was not written by DCP"
                    )
                if part < 0:
                    raise CorruptCheckpointError(
                        f"{_where(url, fqn)} has the negative list index {part}: the metadata is damaged"
                    )
            elif type(part) is not str:
                raise CorruptCheckpointError(f"{_where(url, fqn)} has a {type(part).__name__} in its path")
            if node.fqn is not None:
                raise CorruptCheckpointError(
                    f"{_where(url, fqn)} lies under {node.fqn!r}, which is itself a stored value: the metadata "
                    "is damaged"
                )
            if node.children and type(next(iter(node.children))) is not type(part):
                other = next(iter(node.children))
                raise CorruptCheckpointError(
                    f"{_where(url, fqn)} uses {part!r} where another key uses {other!r}: one container cannot "
                    "be both a list and a dict; the metadata is damaged"
                )
            node = node.children.setdefault(part, _Node())
        if node.children or node.fqn is not None:
            raise CorruptCheckpointError(
                f"{_where(url, fqn)} names a place that also holds other keys: the metadata is damaged"
            )
        node.fqn = fqn
    _check_holes(url, root, len(paths))


def _check_holes(url: str, root: _Node, keys: int) -> None:
    allowed = keys + LIST_HOLE_SLACK
    holes = 0
    todo = [root]
    while todo:
        node = todo.pop()
        todo.extend(node.children.values())
        if node is root or not node.children or type(next(iter(node.children))) is not int:
            continue
        top = max(node.children)
        holes += top + 1 - len(node.children)
        if holes > allowed:
            leaf = node.children[top]
            while leaf.fqn is None:
                leaf = next(iter(leaf.children.values()))
            raise CorruptCheckpointError(
                f"{_where(url, leaf.fqn)} has the list index {top}, but the checkpoint has only {keys} keys: the "
                f"lists would hold more than {allowed} empty slots (one per key plus {LIST_HOLE_SLACK}); the "
                "metadata is damaged or hostile"
            )
