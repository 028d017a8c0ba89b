"""``merge_fsdp_weights``: accelerate's FSDP checkpoint merge, streaming and on any store.

accelerate saves a ``SHARDED_STATE_DICT`` model with DCP as ``{"model": model.state_dict()}`` under
``<output_dir>/pytorch_model_fsdp_0/`` (``optimizer_0/`` for the optimizer). Its ``merge_fsdp_weights``
loads the whole checkpoint into memory (``dcp_to_torch_save``'s loader), unwraps a state dict with a single
top-level key (``{"model": {...}}`` -> ``{...}``, so keys lose their ``model.`` prefix), and saves
``<output_path>/model.safetensors`` (or ``pytorch_model.bin`` without safe serialization).

This one does the same, one tensor in memory at a time, and shards the output like ``save_pretrained``
(``model-00001-of-00002.safetensors`` + ``model.safetensors.index.json``) above ``max_shard_size``
(accelerate always writes one file). With ``remove_checkpoint_dir=True`` the input is removed only after
the output has been written and re-read: every file's size and every header/index checked against what
was written; a checkpoint directory that is a symbolic link is refused up front with that option (nothing
is deleted through a link). The output never lies in, or is, the input (:mod:`.input_guard`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from dcp_storage.conversion.engine import ConvertResult, _run, plan_outputs, same_location
from dcp_storage.conversion.plan import OutTensor, convert_targets, refuse_overwriting_input
from dcp_storage.conversion.source import TensorSource
from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError, TargetError
from dcp_storage.formats.dcp_native.native import METADATA_FILE
from dcp_storage.formats.safetensors.write_plan import parse_size
from dcp_storage.transports import Transport, open_transport

__all__ = ["FSDP_MODEL_DIR", "merge_fsdp_weights"]

FSDP_MODEL_DIR = "pytorch_model_fsdp_0"
OPTIMIZER_DIR = "optimizer_0"


def _unwrap_single_top_level(paths: list[tuple[Any, ...]]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]] | None:
    """accelerate's ``if len(state_dict.keys()) == 1: state_dict = state_dict[list(state_dict)[0]]`` on paths."""
    tops = {p[0] for p in paths}
    if len(tops) == 1 and paths and all(len(p) >= 2 for p in paths):
        return lambda p: p[1:]
    return None


def _check_input(transport: Transport, root: str) -> None:
    if transport.exists(transport.join(root, METADATA_FILE)):
        return
    url = transport.url(root)
    model = transport.exists(transport.join(root, FSDP_MODEL_DIR, METADATA_FILE))
    optim = transport.exists(transport.join(root, OPTIMIZER_DIR, METADATA_FILE))
    msg = f"{url}: no {METADATA_FILE} here, so this is not a DCP checkpoint directory"
    if model and optim:
        msg += f"; it holds a model and an optimizer checkpoint: pass {url}/{FSDP_MODEL_DIR} or {url}/{OPTIMIZER_DIR}"
    elif model:
        msg += f"; it holds a model checkpoint: pass {url}/{FSDP_MODEL_DIR}"
    elif optim:
        msg += f"; it holds an optimizer checkpoint: pass {url}/{OPTIMIZER_DIR}"
    raise CheckpointNotFoundError(msg)


def verify_output(result: ConvertResult, tensors: list[OutTensor], storage_options: dict[str, Any] | None) -> None:
    """Re-read what was written: file sizes, then headers/index/metadata against the planned tensors."""
    transport, root = open_transport(result.dst, storage_options)
    try:
        problems = []
        paths = {f.name: transport.join(root, f.name) for f in result.files}
        for f in result.files:
            path = paths[f.name]
            size = transport.size(path) if transport.exists(path) else None
            if size != f.size:
                problems.append(f"{transport.url(path)}: {size} bytes on storage, {f.size} written")
        if not problems:
            # torch shards have no reader-level index: read each file; safetensors through its index
            urls = (
                [transport.url(p) for n, p in paths.items() if n.endswith(".bin")]
                if result.to == "torch"
                else [result.output]
            )
            found: dict[str, Any] = {}
            for url in urls:
                with TensorSource.open(url, storage_options) as back:
                    found.update(back.tensors)
            for t in tensors:
                got = found.get(t.key)
                if got is None:
                    problems.append(f"tensor {t.key!r} is missing from the output")
                elif got.dtype != t.dtype or got.shape != t.shape:
                    problems.append(
                        f"tensor {t.key!r} reads back as {got.dtype} {list(got.shape)}, expected {t.dtype} {list(t.shape)}"
                    )
            extra = set(found) - {t.key for t in tensors}
            if extra:
                problems.append(f"unexpected tensors in the output: {sorted(extra)[:5]}")
        if problems:
            raise CorruptCheckpointError(
                f"{result.output}: the merged output failed verification (input kept): " + "; ".join(problems)
            )
    finally:
        transport.close()


def _check_removable(url: str, storage_options: dict[str, Any] | None) -> None:
    """Before anything is written: ``remove_checkpoint_dir`` deletes only a real directory, never through a link.

    A checkpoint directory that is a symbolic link points at data somewhere else (often another disk, or
    another run's checkpoint): deleting what it points at is not what "remove this directory" says, and
    removing only the link frees nothing. So it is refused up front (before, the merge was written and then
    ``rmtree`` failed with a bare ``OSError``).
    """
    transport, root = open_transport(url, storage_options)
    try:
        if transport.is_local and os.path.islink(root.rstrip("/") or root):
            raise TargetError(
                f"{url!r} is a symbolic link to {os.path.realpath(root)!r}; remove_checkpoint_dir "
                "(--remove-checkpoint-dir) deletes only a real directory, never through a link: pass the real "
                "path to delete the data, or drop the option and remove the link yourself"
            )
    finally:
        transport.close()


def _remove(url: str, storage_options: dict[str, Any] | None) -> None:
    transport, root = open_transport(url, storage_options)
    try:
        transport.remove_tree(root)
    finally:
        transport.close()


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
    *,
    max_shard_size: int | str = "5GB",
    storage_options: dict[str, Any] | None = None,
    output_storage_options: dict[str, Any] | None = None,
    overwrite: bool = True,
    drop_non_tensors: bool = False,
    progress: Callable[[int], None] | None = None,
    on_start: Callable[[TensorSource, int], None] | None = None,
    create_bucket: bool = False,
) -> ConvertResult:
    """Merge a sharded (FSDP ``SHARDED_STATE_DICT``) DCP checkpoint into one Hugging Face style state dict.

    Same arguments and output names as ``accelerate.utils.merge_fsdp_weights``: ``checkpoint_dir`` is the
    DCP directory (``.../pytorch_model_fsdp_0``); the result is ``{output_path}/model.safetensors``
    (``safe_serialization=True``) or ``{output_path}/pytorch_model.bin``, sharded with an index above
    ``max_shard_size``. A state dict with a single top-level key (accelerate's ``{"model": ...}``) is
    unwrapped, so keys drop that prefix. Both paths may be any fsspec URL (``output_storage_options``
    defaults to ``storage_options``). ``overwrite=True`` (accelerate replaces an existing file too).
    ``create_bucket=True`` creates the output's bucket if missing (otherwise ``BucketNotFoundError``).

    Returns a :class:`~dcp_storage.conversion.ConvertResult` (``.output``: the file or index to load).
    """
    started = time.monotonic()
    checkpoint_dir, output_path = os.fspath(checkpoint_dir), os.fspath(output_path)
    out_opts = output_storage_options if output_storage_options is not None else storage_options
    shard = parse_size(max_shard_size)
    transport, root = open_transport(checkpoint_dir, storage_options)
    try:
        _check_input(transport, root)
    finally:
        transport.close()
    if remove_checkpoint_dir and same_location(checkpoint_dir, storage_options, output_path, out_opts, inside=True):
        raise TargetError(
            f"{output_path!r} lies inside {checkpoint_dir!r}, which remove_checkpoint_dir would delete; "
            "write the merged weights elsewhere"
        )
    refuse_overwriting_input(checkpoint_dir, storage_options, output_path, out_opts, tool="merge")
    if remove_checkpoint_dir:
        _check_removable(checkpoint_dir, storage_options)
    # accelerate's flag names the two formats it writes (with their default file names, as here)
    target = convert_targets()["safetensors" if safe_serialization else "torch"]
    with TensorSource.open(checkpoint_dir, storage_options) as source:
        paths = [t.path for t in source.tensors.values()] + [v.path for v in source.values.values()]
        tensors, values = plan_outputs(source, rename=_unwrap_single_top_level(paths))
        result = _run(
            source,
            output_path,
            out_opts,
            target,
            tensors,
            values,
            shard,
            overwrite,
            drop_non_tensors,
            progress,
            on_start,
            started,
            create_bucket=create_bucket,
        )
    verify_output(result, tensors, out_opts)
    if remove_checkpoint_dir:
        _remove(checkpoint_dir, storage_options)
    result.seconds = round(time.monotonic() - started, 3)
    return result
