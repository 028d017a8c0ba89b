"""``convert``: any checkpoint format on any store to any format on any store, one tensor at a time.

Memory: the writer asks for each tensor just before it writes it (:class:`_Fetch`); the source reads
that tensor alone (:class:`~.source.TensorSource`), and it is dropped once written. Peak memory is about
one tensor, plus a staging copy when the read reshards or casts, plus the object store's upload part
buffer, whatever the checkpoint's size. Metadata, headers and ``data.pkl`` are built from shapes alone.

Drop-ins for ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` / ``torch_save_to_dcp``.

Same names, arguments and results (the ``torch.save`` file holds the nested state dict DCP saved,
non-tensor values included; the DCP checkpoint is what ``dcp.save`` writes for the file's state dict), with
three differences: both paths may be any fsspec URL (pass ``storage_options``), memory stays near one
tensor instead of the whole checkpoint, and ``torch_save_to_dcp`` never unpickles with ``weights_only=False``
(torch's does) unless told ``trust=True``: the file's ``data.pkl`` is decoded through an allow-list (plus
``torch.serialization.add_safe_globals``), so a file holding custom classes raises
:class:`~dcp_storage.errors.UnsafeCheckpointError` naming the class instead of running code. Like torch's,
both replace an existing output.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dcp_storage.conversion.plan import (
    Destination,
    OutTensor,
    OutValue,
    WrittenFile,
    infer_target,
    parse_dtype,
    refuse_overwriting_input,
    resolve_target,
    storage_target,
)
from dcp_storage.conversion.source import TensorSource, byte_batches
from dcp_storage.errors import StorageFullError, TargetError  # TargetError's old home: kept importable from here
from dcp_storage.formats.commit_claim import claim_location, lock_name
from dcp_storage.formats.safetensors.write_plan import parse_size
from dcp_storage.formats.spec import ConvertTarget, FormatSpec, WriteOptions
from dcp_storage.transports import open_transport
from dcp_storage.transports.access import make_output_root

__all__ = ["ConvertResult", "TargetError", "convert", "dcp_to_torch_save", "infer_target", "torch_save_to_dcp"]


_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
CASTABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})  # float8 stays quantized


@dataclass
class ConvertResult:
    """What a conversion read and wrote."""

    src: str
    src_format: str
    dst: str
    to: str
    output: str  # the URL to open the result with (a file, an index, or a directory)
    files: list[WrittenFile] = field(default_factory=list)
    tensors: int = 0
    tensor_bytes: int = 0
    values: int = 0
    dropped_values: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def same_location(
    a: str, a_opts: dict[str, Any] | None, b: str, b_opts: dict[str, Any] | None, *, inside: bool = False
) -> bool:
    """Whether URLs ``a`` and ``b`` name the same place (or, with ``inside``, ``b`` lies within ``a``)."""
    transport_a, path_a = open_transport(*storage_target(a, a_opts))
    transport_b, path_b = open_transport(*storage_target(b, b_opts))
    try:
        if type(transport_a) is not type(transport_b):
            return False
        norm_a, norm_b = transport_a.url(path_a).rstrip("/"), transport_b.url(path_b).rstrip("/")
        if transport_a.is_local:
            norm_a, norm_b = os.path.realpath(norm_a), os.path.realpath(norm_b)
        return norm_a == norm_b or (inside and norm_b.startswith(norm_a.rstrip("/") + "/"))
    finally:
        transport_a.close()
        transport_b.close()


class _Fetch:
    """Reads each tensor (cast on the way in) and value from the source when a writer asks."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source

    def tensor(self, out: OutTensor) -> torch.Tensor:
        return self.source.read_tensor(out.src, out.dtype)

    def tensors(self, outs: Sequence[OutTensor]) -> Iterator[tuple[OutTensor, torch.Tensor]]:
        for batch in byte_batches(outs):
            got = self.source.read_tensors([(out.src, out.dtype) for out in batch])
            for out in batch:
                yield out, got.pop(out.src)  # popped: the writer's ``del`` frees it

    def value_bytes(self, out: OutValue) -> bytes:
        return self.source.read_value_bytes(out.src)

    def value(self, out: OutValue) -> Any:
        return self.source.read_value(out.src)


def plan_outputs(
    source: TensorSource,
    *,
    dtype: torch.dtype | None = None,
    rename: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None,
) -> tuple[list[OutTensor], list[OutValue]]:
    """Output entries in source order: keys renamed through ``rename`` (a path map), floats cast to ``dtype``."""
    tensors, values, seen = [], [], {}
    order = {fqn: i for i, fqn in enumerate(source.metadata.state_dict_metadata)}
    for fqn, t in source.tensors.items():
        path = rename(t.path) if rename else t.path
        out_dtype = dtype if dtype is not None and t.dtype in CASTABLE else t.dtype
        tensors.append(OutTensor(".".join(map(str, path)), path, fqn, out_dtype, t.shape, order[fqn]))
    for fqn, v in source.values.items():
        path = rename(v.path) if rename else v.path
        values.append(OutValue(".".join(map(str, path)), path, fqn, order[fqn]))
    for entry in [*tensors, *values]:
        other = seen.setdefault(entry.key, entry.src)
        if other != entry.src:
            raise ValueError(f"{source.url}: keys {other!r} and {entry.src!r} would both be written as {entry.key!r}")
    return tensors, values


def write_outputs(
    dest: Destination,
    target: tuple[FormatSpec, ConvertTarget],
    tensors: Sequence[OutTensor],
    values: Sequence[OutValue],
    fetch: Any,
    *,
    max_shard_size: int | None,
    drop_non_tensors: bool,
    single_file: bool | None = None,
) -> tuple[str, list[str]]:
    """Write through the format's target; returns (path to open, dropped value keys).

    A directory output is claimed as a save claims its location (:mod:`dcp_storage.formats.commit_claim`: the
    lock ``.dcp_storage.lock``, created only if absent; ``overwrite=True`` takes any lock over), because a
    conversion writes the file names a save of its format writes: a conversion into a location another
    save holds is refused, and so is a save started while the conversion runs. The lock is removed when
    the conversion ends, also when it fails (nothing retries it; its leftovers read as an interrupted save).
    A single file is written by one atomic rename, and its directory is not claimed.
    """
    with storage_full_named(dest.url):
        return _write_outputs(dest, target, tensors, values, fetch, max_shard_size, drop_non_tensors, single_file)


def _write_outputs(
    dest: Destination,
    target: tuple[FormatSpec, ConvertTarget],
    tensors: Sequence[OutTensor],
    values: Sequence[OutValue],
    fetch: Any,
    max_shard_size: int | None,
    drop_non_tensors: bool,
    single_file: bool | None,
) -> tuple[str, list[str]]:
    spec, writer = target
    single = infer_target(dest.url) == writer.name if single_file is None else single_file
    options = WriteOptions(max_shard_size, drop_non_tensors, single and writer.single_file, spec.descriptor)
    if writer.refuse is not None:
        writer.refuse(tensors, values, options)
    if options.single_file:
        with _removed_on_failure(dest, single=True):
            return writer.write(dest, tensors, values, fetch, options)
    made_root = dest.transport.is_local and not os.path.isdir(dest.path)
    make_output_root(dest.transport, dest.path)  # a file in the way: WrongPathTypeError, before the lock
    try:
        claim = claim_location(
            dest.transport, dest.join(lock_name()), save_id=uuid.uuid4().hex, overwrite=dest.overwrite, markers=()
        )
    except BaseException:
        _remove_empty_root(dest, made_root)
        raise
    done = False
    try:
        with _removed_on_failure(dest, single=False):
            written = writer.write(dest, tensors, values, fetch, options)
        done = True
        return written
    finally:
        claim.release()
        if not done:
            _remove_empty_root(dest, made_root)  # after the lock is gone: empty if nothing else was there


@contextlib.contextmanager
def _removed_on_failure(dest: Destination, single: bool) -> Iterator[None]:
    """A conversion that fails or is interrupted (Ctrl-C, SIGTERM) leaves no output: the files it committed
    (``dest.written``: only this run's) are removed, so nothing half-written looks like a checkpoint."""
    try:
        yield
    except BaseException:
        for f in dest.written:
            with contextlib.suppress(Exception):
                dest.transport.remove(dest.path if single else dest.join(f.name))
        dest.written.clear()
        raise


@contextlib.contextmanager
def storage_full_named(url: str) -> Iterator[None]:
    """A full disk or quota (``ENOSPC``, ``EDQUOT``) anywhere in a failed write, however the writer wrapped
    it (torch's zip writer reports ``enforce fail ... unexpected pos``, the original ``OSError`` in its
    context), raised as :class:`~dcp_storage.errors.StorageFullError` naming the file (else the output).
    Runs after the output was removed, so the retry after space is freed finds nothing in its way."""
    try:
        yield
    except StorageFullError:
        raise
    except Exception as exc:
        full = _full_disk_error(exc)
        if full is None:
            raise
        if isinstance(full, StorageFullError):
            raise full from None
        path = full.filename if isinstance(full.filename, str) else url
        raise StorageFullError(path, errno_=full.errno, detail=f"writing the output {url} (it was removed)") from exc


def _full_disk_error(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, StorageFullError) or (isinstance(e, OSError) and e.errno in _FULL):
            return e  # type: ignore[return-value]
        todo += [e.__cause__, e.__context__]
    return None


def _remove_empty_root(dest: Destination, made_root: bool) -> None:
    if made_root:
        with contextlib.suppress(OSError):
            os.rmdir(dest.path)  # only if empty: a directory this run created, nothing else in it


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    src_format: str | None = None,
    max_shard_size: int | str | None = None,
    dtype: str | torch.dtype | None = None,
    storage_options: dict[str, Any] | None = None,
    src_storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    drop_non_tensors: bool = False,
    single_file: bool | None = None,
    progress: Callable[[int], None] | None = None,
    on_start: Callable[[TensorSource, int], None] | None = None,
    trust: bool = False,
    create_bucket: bool = False,
) -> ConvertResult:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst``, streaming tensor by tensor.

    Args:
        src: any checkpoint :func:`dcp_storage.open_reader` reads (DCP directory, safetensors file, directory
            or index, ``torch.save`` file, a plugin's format), local or any fsspec URL.
        dst: output URL. ``to="dcp"``: a directory. ``"safetensors"``/``"torch"``: a file when ``dst`` ends
            in ``.safetensors`` / ``.pt``, ``.pth``, ``.bin``, ``.ckpt`` (one file, no sharding), otherwise a
            directory with Hugging Face names (``model.safetensors`` / ``pytorch_model.bin``, sharded with an
            index above ``max_shard_size``).
        to: a registered format's convert target: ``"dcp"``, ``"safetensors"``, ``"torch"``, or a plugin's
            (:func:`~dcp_storage.conversion.plan.target_names`); inferred from ``dst``'s suffix when omitted.
        src_format: force the source format (a registry name) instead of detecting it.
        max_shard_size: bytes per output file (int, or ``"5GB"``, ``"500MiB"``). Sharded safetensors/torch
            outputs default to 5GB; DCP output is one data file unless given.
        dtype: cast float16/bfloat16/float32/float64 tensors (``"bf16"``, ``"fp16"``, ``"fp32"``, or a
            ``torch.dtype``); integer, bool, complex and float8 tensors keep their dtype.
        storage_options / src_storage_options / dst_storage_options: fsspec options for both sides, then
            per side (merged over the shared ones).
        overwrite: replace an existing output (``CheckpointExistsError`` otherwise).
        drop_non_tensors: leave non-tensor values out of formats that hold only tensors (safetensors,
            sharded torch output) instead of raising ``NonTensorStateError``.
        single_file: ``True`` writes safetensors/torch output as exactly the file ``dst`` whatever its name;
            ``False`` as a directory; ``None`` decides by ``dst``'s suffix.
        progress: called with the byte count of each tensor once it is written.
        on_start: called once with the opened source and the total tensor bytes, before writing.
        trust: an explicit opt-in for a source you trust: decode it as ``torch.load(weights_only=False)``
            would (a ``torch.save`` file holding an ``argparse.Namespace`` or a config object; non-tensor items
            of DCP and safetensors checkpoints), which may run code from it. Without it, globals outside the
            allow-list (and what ``torch.serialization.add_safe_globals`` registered) raise
            ``UnsafeCheckpointError`` naming them.
        create_bucket: create ``dst``'s bucket (Azure: container) if it does not exist; otherwise a missing
            one raises :class:`~dcp_storage.errors.BucketNotFoundError` before anything is written.
    """
    started = time.monotonic()
    src, dst = os.fspath(src), os.fspath(dst)
    target = resolve_target(to, dst, check_suffix=single_file is None)
    cast = parse_dtype(dtype)
    shard = parse_size(max_shard_size) if max_shard_size is not None else None
    src_opts = {**(storage_options or {}), **(src_storage_options or {})} or None
    dst_opts = {**(storage_options or {}), **(dst_storage_options or {})} or None
    if same_location(src, src_opts, dst, dst_opts):
        raise TargetError(f"{dst!r} is the input itself; convert to another location")
    refuse_overwriting_input(src, src_opts, dst, dst_opts)
    with TensorSource.open(src, src_opts, src_format, trust=trust) as source:
        tensors, values = plan_outputs(source, dtype=cast)
        return _run(
            source,
            dst,
            dst_opts,
            target,
            tensors,
            values,
            shard,
            overwrite,
            drop_non_tensors,
            progress,
            on_start,
            started,
            single_file=single_file,
            create_bucket=create_bucket,
        )


def _run(
    source: TensorSource,
    dst: str,
    dst_opts: dict[str, Any] | None,
    target: tuple[FormatSpec, ConvertTarget],
    tensors: list[OutTensor],
    values: list[OutValue],
    shard: int | None,
    overwrite: bool,
    drop_non_tensors: bool,
    progress: Callable[[int], None] | None,
    on_start: Callable[[TensorSource, int], None] | None,
    started: float,
    create_bucket: bool = False,
    **options: Any,
) -> ConvertResult:
    dest = Destination.of(dst, dst_opts, overwrite, create_bucket)
    dest.progress = progress
    try:
        total = sum(t.nbytes for t in tensors)
        if on_start is not None:
            on_start(source, total)
        output, dropped = write_outputs(
            dest,
            target,
            tensors,
            values,
            _Fetch(source),
            max_shard_size=shard,
            drop_non_tensors=drop_non_tensors,
            **options,
        )
    finally:
        dest.transport.close()
    return ConvertResult(
        src=source.url,
        src_format=source.spec.descriptor,
        dst=dst,
        to=target[1].name,
        output=dest.url_of(output),
        files=list(dest.written),
        tensors=len(tensors),
        tensor_bytes=total,
        values=len(values) - len(dropped),
        dropped_values=dropped,
        seconds=round(time.monotonic() - started, 3),
    )


def dcp_to_torch_save(
    dcp_checkpoint_dir: str | os.PathLike[str],
    torch_save_path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    trust: bool = False,
) -> ConvertResult:
    """Convert the DCP checkpoint in ``dcp_checkpoint_dir`` into one ``torch.save`` file.

    ``trust``: non-tensor items holding other objects than plain data are decoded with
    ``weights_only=False`` (only for a checkpoint you trust; see :func:`convert`).
    """
    return convert(
        dcp_checkpoint_dir,
        torch_save_path,
        to="torch",
        src_format="dcp",
        single_file=True,
        storage_options=storage_options,
        overwrite=True,
        trust=trust,
    )


def torch_save_to_dcp(
    torch_save_path: str | os.PathLike[str],
    dcp_checkpoint_dir: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    trust: bool = False,
) -> ConvertResult:
    """Convert the ``torch.save`` file at ``torch_save_path`` into a DCP checkpoint directory.

    ``trust``: decode the file as ``torch.load(weights_only=False)`` would, as torch's function does (only
    for a file you trust: it may run code); without it, ``data.pkl`` goes through the allow-list.
    """
    return convert(
        torch_save_path,
        dcp_checkpoint_dir,
        to="dcp",
        src_format="torch_save",
        single_file=False,
        storage_options=storage_options,
        overwrite=True,
        trust=trust,
    )
