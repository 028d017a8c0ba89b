"""torch_checkpointing's ``Storage.rename`` table, exactly, on a local disk and on object stores.

============  ====================  =========================================
``src``       ``dst``               behaviour
============  ====================  =========================================
directory     absent                commit: the contents land AT ``dst``
directory     empty directory       commit: replace it
directory     populated directory   ``CheckpointExistsError`` (an ``OSError``)
directory     file                  ``WrongPathTypeError`` (an ``OSError``)
file          absent                commit
file          existing file         replace it
file          directory             ``WrongPathTypeError`` (empty or not)
============  ====================  =========================================

Nothing is ever merged into, nested under or deleted from an occupied destination; a refused rename
leaves both sides as they were.

**Local disk**: ``os.rename`` (directories) and ``os.replace`` (files), atomic; across file systems a
vetted copy. **Object stores** have no rename: a directory is a key prefix, so each object is copied
*inside the store* (S3 ``CopyObject``, multipart ``UploadPartCopy`` above 5 GiB; GCS ``rewrite``): no byte
of the checkpoint passes through this process, and a commit costs one request per file, not the
checkpoint's size in traffic (``benchmarks/bench_torch_checkpointing.py`` measures it). torch_checkpointing's
metadata file is copied last, so a reader that finds it finds every file it lists; the source is deleted
afterwards. An empty directory does not exist on an object store, so its row is the "absent" row there.
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil
import threading

from dcp_storage.plugin_api import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    Transport,
    WrongPathTypeError,
    call_with_retry,
)

from dcp_storage_torch_checkpointing import _unstable

__all__ = ["COPY_CHUNK", "rename_local", "rename_remote"]

COPY_CHUNK = 32 << 20  # a copy streamed through this process (no server-side copy) holds this much at once


def _occupied(src: str, dst: str, why: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"refusing to rename {src} onto {dst}: {why}; a rename commits onto unoccupied space and never "
        "merges into or deletes what is there: remove it yourself if it is meant to be replaced"
    )


def _wrong_type(src: str, dst: str, why: str) -> WrongPathTypeError:
    return WrongPathTypeError(f"refusing to rename {src} onto {dst}: {why}; nothing was changed")


# ------------------------------------------------------------------------------------------- local
def rename_local(src: str, dst: str) -> None:
    """The table on a local disk: ``os.rename``/``os.replace``, atomic on one file system."""
    if not os.path.lexists(src):
        raise CheckpointNotFoundError(f"{src}: nothing to rename")
    src_is_dir = os.path.isdir(src)
    if not src_is_dir and os.path.isdir(dst):
        raise _wrong_type(src, dst, "a file cannot replace a directory")
    try:
        (os.rename if src_is_dir else os.replace)(src, dst)
        return
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise _occupied(src, dst, "the destination directory is not empty") from exc
        if exc.errno in (errno.ENOTDIR, errno.EISDIR):
            raise _wrong_type(src, dst, "a directory cannot replace a file") from exc
        if exc.errno != errno.EXDEV:
            raise
    # Another file system: copy, having vetted the destination first (copytree would merge into it).
    if src_is_dir:
        if os.path.isfile(dst):
            raise _wrong_type(src, dst, "a directory cannot replace a file")
        if os.path.isdir(dst) and os.listdir(dst):
            raise _occupied(src, dst, "the destination directory is not empty")
        shutil.copytree(src, dst, dirs_exist_ok=True)
        shutil.rmtree(src)
    else:
        shutil.copy2(src, dst)
        os.remove(src)


# ------------------------------------------------------------------------------------------- remote
def _retry(transport: Transport, fn, what: str) -> None:  # type: ignore[no-untyped-def]
    call_with_retry(fn, transport.config.retry, lambda: what)


def copy_object(src_t: Transport, src: str, dst_t: Transport, dst: str) -> str:
    """Copy one file; ``"server"`` if the store copied it, ``"streamed"`` if its bytes came through here."""
    what = f"copy {src_t.url(src)} to {dst_t.url(dst)}"
    if src_t is dst_t and _unstable.filesystem(src_t) is not None:
        try:
            _retry(src_t, lambda: _unstable.server_copy(src_t, src, dst), what)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{src_t.url(src)}: no such file (during {what})") from exc
        return "server"
    size = src_t.size(src)
    with dst_t.open_atomic(dst) as out:
        for start in range(0, size, COPY_CHUNK):
            out.write(src_t.read_range(src, start, min(size, start + COPY_CHUNK)))
    return "streamed"


def _copy_tree(src_t: Transport, src: str, dst_t: Transport, dst: str) -> None:
    files = _unstable.walk_files(src_t, src)
    marker = [f for f in files if posixpath.basename(f) == _unstable.METADATA_FILE_NAME]
    data = [f for f in files if f not in marker]
    pool = src_t.executor()
    for batch in (data, marker):  # the commit marker after every data file
        futures = [
            pool.submit(copy_object, src_t, src_t.join(src, rel), dst_t, dst_t.join(dst, *rel.split("/")))
            for rel in batch
        ]
        for future in futures:
            future.result()


def rename_remote(src_t: Transport, src: str, dst_t: Transport, dst: str, *, background_cleanup: bool = False) -> None:
    """The table on an object store (or between two stores): copy inside the store, then delete the source."""
    src_kind = _unstable.kind(src_t, src)
    if src_kind is None:
        raise CheckpointNotFoundError(f"{src_t.url(src)}: nothing to rename")
    dst_kind = _unstable.kind(dst_t, dst)
    src_url, dst_url = src_t.url(src), dst_t.url(dst)
    if src_kind == "file":
        if dst_kind == "dir":
            raise _wrong_type(src_url, dst_url, "a file cannot replace a directory")
        copy_object(src_t, src, dst_t, dst)
        src_t.remove(src)
        return
    if dst_kind == "file":
        raise _wrong_type(src_url, dst_url, "a directory cannot replace a file")
    if dst_kind == "dir":
        if _unstable.walk_files(dst_t, dst):
            raise _occupied(src_url, dst_url, "the destination directory is not empty")
        dst_t.remove_tree(dst)  # an empty directory (memory:// keeps them): replaced
    _copy_tree(src_t, src, dst_t, dst)
    if background_cleanup:
        threading.Thread(target=src_t.remove_tree, args=(src,), name="dcp-storage-rename-cleanup").start()
    else:
        src_t.remove_tree(src)
