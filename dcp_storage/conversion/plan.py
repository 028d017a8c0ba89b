"""What ``convert`` writes and where: output entries, the target format, input protection, memory given back.

Giving freed tensor memory back to the OS between tensors.

Streaming allocates and frees one tensor-sized block per tensor. glibc raises its mmap threshold after the
first large block is freed (up to 32 MiB), so later tensors come from the heap, and freed heap blocks are not
always reused or returned: resident memory can then grow by a tensor per tensor written. ``malloc_trim(0)``
returns free heap pages to the OS; :class:`MemoryReleaser` calls it after every large tensor (or every
``every_bytes`` of small ones). A no-op where there is no glibc.

What a conversion writes: output entries, where they go, and the knobs every writer shares.

Pure data plus small helpers; no tensor bytes move here. The engine (:mod:`.engine`) turns a
:class:`~.source.TensorSource` into :class:`OutTensor`/:class:`OutValue` entries (renamed, cast), and the
target format's writer (its spec's ``convert_target``, :mod:`dcp_storage.formats.spec`) streams
them to a :class:`Destination`, asking a :class:`Fetch` for each tensor just before it writes it.

Which format ``convert`` writes: the registry's formats that declare a ``convert_target``.

``to`` names a target (``"dcp"``, ``"safetensors"``, ``"torch"``, or a plugin format's) or one of its
aliases; without ``to`` the destination's name decides, through the formats' ``suffixes`` (``.safetensors``,
``.pt``...). Nothing here knows a format: a plugin's format that declares a target is one like the others.

No tool replaces or deletes its input: the input's files, and the output's place, compared by identity.

A conversion's writer owns its output location: it writes that format's file names there and, with
``overwrite=True``, retires the files an earlier run left (an old index, stale shards, an old
``.metadata``). An output in the directory that holds the input therefore replaced an fp32
``model.safetensors`` with its bf16 copy, or deleted a sharded input's shards and index, and exited 0.
So, before anything is read or written (and whatever ``overwrite`` says), :func:`refuse_overwriting_input`
refuses an output that is one of the input's files or a directory holding one.

Identity, not spelling: local paths are compared resolved (``os.path.realpath``, so through symlinks) and
by ``(st_dev, st_ino)`` (so through hard links); object-store paths by their normalised URL. The input's
files are the file given, every file under a directory given, and for an index (``*.index.json``) every
file beside it (its shards).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import posixpath
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dcp_storage.errors import TargetError
from dcp_storage.formats.spec import (
    ConvertTarget,
    Fetch,
    FormatSpec,
    OutTensor,
    OutValue,
    WrittenFile,
    registered_formats,
)
from dcp_storage.transports import Transport, open_transport
from dcp_storage.transports.access import require_bucket

__all__ = [
    "Destination",
    "Fetch",
    "InputFiles",
    "MemoryReleaser",
    "OutTensor",
    "OutValue",
    "WrittenFile",
    "convert_targets",
    "infer_target",
    "malloc_trim",
    "parse_dtype",
    "refuse_overwriting_input",
    "resolve_target",
    "target_names",
]


MiB = 1024 * 1024


def _load_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _load_trim()


def malloc_trim() -> bool:
    """Return free heap memory to the OS (glibc); ``False`` where unavailable."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class MemoryReleaser:
    """Call :meth:`freed` with each tensor's size once it is dropped; trims after large frees."""

    def __init__(self, large_bytes: int = 4 * MiB, every_bytes: int = 64 * MiB) -> None:
        self.large_bytes = large_bytes
        self.every_bytes = every_bytes
        self._pending = 0

    def freed(self, nbytes: int) -> None:
        self._pending += nbytes
        if nbytes >= self.large_bytes or self._pending >= self.every_bytes:
            self._pending = 0
            malloc_trim()


@dataclass
class Destination:
    """Where output goes: a transport and a path on it (a directory, or a file for single-file outputs).

    What a format's writer sees of it is :class:`~dcp_storage.formats.spec.WriteDestination`.
    """

    url: str
    transport: Transport
    path: str
    overwrite: bool = False
    progress: Callable[[int], None] | None = None
    written: list[WrittenFile] = field(default_factory=list)
    releaser: MemoryReleaser = field(default_factory=MemoryReleaser)

    @classmethod
    def of(
        cls,
        url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None,
        overwrite: bool,
        create_bucket: bool = False,
    ) -> Destination:
        """Open the output location; its bucket must exist (or is created with ``create_bucket``)."""
        url = os.fspath(url)
        transport, path = open_transport(url, storage_options)
        try:
            require_bucket(transport, path, create=create_bucket)
        except BaseException:
            transport.close()
            raise
        return cls(url, transport, path.rstrip("/") if path not in ("/", "") else path, overwrite)

    def join(self, name: str) -> str:
        return self.transport.join(self.path, name)

    def parent_and_name(self) -> tuple[str, str]:
        if self.transport.is_local:
            return os.path.dirname(self.path) or ".", os.path.basename(self.path)
        head, _, tail = self.path.rpartition("/")
        return head, tail

    def record(self, name: str, size: int) -> None:
        self.written.append(WrittenFile(name, size))

    def advance(self, nbytes: int) -> None:
        """A tensor of ``nbytes`` was written and dropped: report progress, give its memory back."""
        self.releaser.freed(nbytes)
        if self.progress is not None and nbytes:
            self.progress(nbytes)

    def url_of(self, path: str) -> str:
        return self.transport.url(path)


_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "f64": torch.float64,
    "double": torch.float64,
    "float64": torch.float64,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _DTYPE_NAMES[_name] = getattr(torch, _name)


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``, ``"fp16"``, ``"fp32"``, ``"torch.bfloat16"``... or a ``torch.dtype`` (floating point only)."""
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    else:
        text = str(value).strip().lower().removeprefix("torch.")
        dtype = _DTYPE_NAMES.get(text)
        if dtype is None:
            raise ValueError(f"unknown dtype {value!r}; use one of {', '.join(sorted(_DTYPE_NAMES))}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is not a floating-point dtype; only floating-point tensors are cast")
    return dtype


def convert_targets() -> dict[str, tuple[FormatSpec, ConvertTarget]]:
    """``{target name or alias: (spec, target)}`` for every registered format ``convert`` can write."""
    out: dict[str, tuple[FormatSpec, ConvertTarget]] = {}
    for spec in registered_formats().values():
        target = spec.convert_target
        if isinstance(target, ConvertTarget):
            for name in (target.name, *target.aliases):
                out.setdefault(name.lower(), (spec, target))
    return out


def target_names() -> list[str]:
    """The target names ``to`` accepts (aliases left out), sorted."""
    return sorted({target.name for _spec, target in convert_targets().values()})


def _basename(url: str) -> str:
    return posixpath.basename(url.rstrip("/").replace(os.sep, "/"))


def infer_target(dst: str) -> str | None:
    """The target a destination's name implies (one format's ``suffixes``), or ``None``: a plain directory
    name, or a suffix that several formats claim."""
    name = _basename(dst).lower()
    claims = {
        target.name
        for spec, target in convert_targets().values()
        if any(name.endswith(suffix.lower()) for suffix in spec.suffixes)
    }
    return claims.pop() if len(claims) == 1 else None


def resolve_target(to: str | None, dst: str, check_suffix: bool = True) -> tuple[FormatSpec, ConvertTarget]:
    """The format to write ``dst`` in; :class:`TargetError` when it cannot be told or contradicts the name."""
    if _basename(dst).lower().endswith(".index.json"):
        raise TargetError(f"{dst!r}: pass the output directory; the index is named and written by the converter")
    targets = convert_targets()
    names = ", ".join(target_names())
    if to is None:
        guessed = infer_target(dst)
        if guessed is None:
            raise TargetError(f"cannot tell the output format from {dst!r}; pass to= one of {names} (--to)")
        return targets[guessed]
    found = targets.get(str(to).strip().lower())
    if found is None:
        raise TargetError(f"unknown output format {to!r}; choose one of {names}")
    implied = infer_target(dst)
    if check_suffix and implied is not None and implied != found[1].name:
        raise TargetError(
            f"{dst!r} names a {implied} file but the output format is {found[1].name}; rename it or drop --to"
        )
    return found


MAX_LISTED = 100_000  # files of an input looked at (a checkpoint with more is compared by its first ones)


class InputFiles:
    """The identities of a checkpoint's files: resolved paths and inodes (local), or URLs (object stores)."""

    def __init__(self, transport: Transport, root: str) -> None:
        self.local = transport.is_local
        self.keys: set[Any] = set()
        for path in _files_of(transport, root):
            self.keys.update(_identities(transport, path))

    def holds(self, transport: Transport, path: str) -> bool:
        """Whether ``path`` on ``transport`` is one of the input's files (by any of its identities)."""
        if transport.is_local != self.local:
            return False
        return any(key in self.keys for key in _identities(transport, path))


def _identities(transport: Transport, path: str) -> list[Any]:
    if not transport.is_local:
        return [("url", transport.url(path).rstrip("/"))]
    keys: list[Any] = [("path", os.path.realpath(path))]
    try:
        st = os.stat(path)
    except OSError:
        return keys
    return [*keys, ("inode", st.st_dev, st.st_ino)]


def _is_dir(transport: Transport, path: str) -> bool:
    """Local: a directory. Object stores have no directories: any path may prefix objects, so list it."""
    return os.path.isdir(path) if transport.is_local else True


def _files_of(transport: Transport, root: str) -> Iterator[str]:
    """The input's files: ``root`` itself, what lies under a directory, the shards beside an index."""
    count = 0
    if transport.is_local:
        if os.path.isdir(root):
            for here, _dirs, names in os.walk(root):
                for name in names:
                    count += 1
                    if count > MAX_LISTED:
                        return
                    yield os.path.join(here, name)
            return
        yield root
        if root.endswith(".index.json"):
            parent = os.path.dirname(root) or "."
            for name in os.listdir(parent):
                if os.path.isfile(os.path.join(parent, name)):
                    yield os.path.join(parent, name)
        return
    yield root
    parent = root.rpartition("/")[0] if root.endswith(".index.json") else root
    try:
        names = transport.listdir(parent)
    except (OSError, ValueError):
        return
    for name in names[:MAX_LISTED]:
        yield transport.join(parent, name)


def storage_target(url: str, options: dict[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
    """The storage a URL's bytes live on: the last link of an fsspec chain (``simplecache::file:///d`` is
    ``file:///d``, with the options given under its protocol), else the URL itself. The input and output
    guards compare these, so a cache layered over the input is still the input."""
    if "::" not in url:
        return url, options
    inner = url.rsplit("::", 1)[1]
    protocol = inner.split("://", 1)[0] if "://" in inner else "file"
    nested = (options or {}).get(protocol)
    return inner, nested if isinstance(nested, dict) else None


def refuse_overwriting_input(
    src: str, src_opts: dict[str, Any] | None, dst: str, dst_opts: dict[str, Any] | None, *, tool: str = "convert"
) -> None:
    """:class:`TargetError` when ``dst`` is one of ``src``'s files, or a directory that holds one.

    Called before the output is opened, whatever ``overwrite`` says: a writer replaces and retires files in
    its output location, and no tool may replace or delete its input (module docstring).
    """
    src_transport, src_root = open_transport(*storage_target(src, src_opts))
    dst_transport, dst_root = open_transport(*storage_target(dst, dst_opts))
    try:
        if type(src_transport) is not type(dst_transport):
            return
        given = InputFiles(src_transport, src_root)
        if given.holds(dst_transport, dst_root):
            raise TargetError(
                f"{dst!r} is a file of the input {src!r}; {tool} would replace it (even with overwrite, which "
                "replaces only earlier outputs): write the output to another location"
            )
        if _is_dir(dst_transport, dst_root):
            try:
                names = dst_transport.listdir(dst_root)[:MAX_LISTED]
            except (OSError, ValueError):
                names = []
            for name in names:
                if given.holds(dst_transport, dst_transport.join(dst_root, name)):
                    raise TargetError(
                        f"the output directory {dst!r} holds {name!r}, a file of the input {src!r}; {tool} writes "
                        "its format's files there and retires stale ones, so it could replace or delete the "
                        "input (even with overwrite): write the output to another directory"
                    )
    finally:
        src_transport.close()
        dst_transport.close()
