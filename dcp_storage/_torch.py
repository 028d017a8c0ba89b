"""Every private name of torch this package uses, and the one place that reads the interpreter's stack.

torch gives no public name for several things a storage layer for DCP must touch: the per-item storage
record that DCP pickles into ``.metadata`` (``_StorageInfo``), the stream-extension classes
(``_extension``), the planner helpers that turn a tensor into chunks and read items, the traversal and
flattening a load plans with, the device a group's object collectives use, the ``_DistWrapper`` that
says whether a ``dcp.load`` runs distributed, the zip writer ``torch.save`` uses, and a few ``nn.Module``
internals. Each is named here, and only here, behind an alias or a small function that says why it is
needed, so a torch release that renames one breaks this module and nothing else.
``tests/registry/test_torch_private_names.py`` keeps it so: no other module of ``dcp_storage`` or
``dcp_storage_testing`` (nor a plugin's package code) imports, names or looks up a private torch name or
a private ``sys`` function, and :data:`PRIVATE_NAMES` lists exactly what this module uses.

Versions checked: torch 2.13.0 (the pin; the suite runs on it), and the sources of 2.14.1 and of 2.6.0
(the floor in ``pyproject.toml``): every name below exists with the signature used here in all three,
except ``torch.distributed.checkpoint._extension`` and ``_StorageInfo.transform_descriptors``, which 2.6.0
does not have yet (they came with torch's stream extensions, pytorch PR 143358, merged in 2025 after the 2.6
branch cut): on 2.6.0 this module, and so the DCP reader and writer, does not import, as the reader and writer
did not before it existed. The declared floor is older than what the package runs on.

The stack (:func:`current_call`, :func:`save_frame`, :func:`on_thread_stack`): DCP tells a storage reader
neither whether the running ``dcp.load`` is distributed (``no_dist``) nor its planner nor its process
group; its ``_DistWrapper``, kept in a local of ``_load_state_dict``, does. Reading torch's frames is the
only way to learn it in time, so it lives here with the other couplings to torch internals.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._utils import _rebuild_tensor_v2, _rebuild_tensor_v3
from torch.distributed.checkpoint import _version as _dcp_version
from torch.distributed.checkpoint._extension import Extension, ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as _flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element as _set_element
from torch.distributed.checkpoint._traverse import traverse_state_dict, traverse_state_dict_v_2_3
from torch.distributed.checkpoint.filesystem import _item_size, _split_by_size_and_type, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, _create_read_items

from dcp_storage.runtime import gc_paused

__all__ = [
    "PRIVATE_NAMES",
    "DcpCall",
    "Extension",
    "ExtensionRegistry",
    "MemoryFormatEncoding",
    "StorageInfo",
    "StoragePrefix",
    "StreamTransformExtension",
    "buffers",
    "child_modules",
    "compiled_original",
    "create_chunk_list",
    "create_read_items",
    "current_call",
    "flatten_state_dict",
    "flatten_v2_3",
    "item_size",
    "legacy_storage_type",
    "local_shape_and_offset",
    "non_persistent_buffer_names",
    "object_coll_device",
    "p2p_matches_by_tag",
    "on_thread_stack",
    "save_frame",
    "set_element",
    "sharded_tensor_class",
    "split_by_size_and_type",
    "tensor_rebuilders",
    "torch_fsspec_classes",
    "traverse_for_current_version",
    "SAVE_WITHOUT_CRC",
    "save_without_crc",
    "zip_writer",
]

#: Every private name this module imports, reads, writes or looks up, fully qualified (the test checks that
#: this is exactly what the module uses, and that no other module uses any of them).
PRIVATE_NAMES: tuple[str, ...] = (
    "sys._current_frames",
    "sys._getframe",
    "torch._C.PyTorchFileWriter",
    "torch._dynamo.eval_frame",
    "torch._dynamo.eval_frame.OptimizedModule._orig_mod",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
    "torch.distributed._shard.sharded_tensor.ShardedTensor",
    "torch.distributed.checkpoint._extension.Extension",
    "torch.distributed.checkpoint._extension.ExtensionRegistry",
    "torch.distributed.checkpoint._extension.StreamTransformExtension",
    "torch.distributed.checkpoint._fsspec_filesystem.FsspecReader",
    "torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter",
    "torch.distributed.checkpoint._nested_dict.flatten_state_dict",
    "torch.distributed.checkpoint._traverse.set_element",
    "torch.distributed.checkpoint._traverse.traverse_state_dict",
    "torch.distributed.checkpoint._traverse.traverse_state_dict_v_2_3",
    "torch.distributed.checkpoint._version",
    "torch.distributed.checkpoint._version._derived_version",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.filesystem._StoragePrefix",
    "torch.distributed.checkpoint.filesystem._item_size",
    "torch.distributed.checkpoint.filesystem._split_by_size_and_type",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.planner_helpers._create_chunk_list",
    "torch.distributed.checkpoint.planner_helpers._create_read_items",
    "torch.distributed.checkpoint.utils._DistWrapper",
    "torch.distributed.distributed_c10d._get_object_coll_device",
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
    "torch.nn.Module._buffers",
    "torch.nn.Module._modules",
    "torch.nn.Module._non_persistent_buffers_set",
    "torch.serialization._get_storage_alignment",
    "torch.serialization._save",
    "torch.storage._dtype_to_storage_type_map",
    "torch.storage._new_dtypes",
)

# --- DCP's metadata records ------------------------------------------------------------------------------

#: Where one stored item lives (file, offset, length, transform descriptors): the values of
#: ``Metadata.storage_data``, pickled under this very class name, so readers and writers of DCP's layout
#: must build and recognise it.
StorageInfo = _StorageInfo
#: The file-name prefix DCP's writers carry per rank (``__{rank}_``) in their storage plans.
StoragePrefix = _StoragePrefix
#: The memory-format enum ``TensorProperties`` pickles into ``.metadata`` (a global our decoders allow).
MemoryFormatEncoding = _MEM_FORMAT_ENCODING

#: The stream-extension classes (compression) torch's writer takes and its reader resolves descriptors to:
#: ``Extension``, ``ExtensionRegistry``, ``StreamTransformExtension``, imported above under their own names
#: (``torch.distributed.checkpoint._extension``; not in torch 2.6.0).

# --- writing: torch's own size estimate and file bucketing, so our files split exactly as torch's do -------

#: ``item_size(write_item)``: the bytes torch estimates a tensor ``WriteItem`` takes (its bucketing input).
item_size = _item_size
#: ``split_by_size_and_type(bins, items)``: torch's ``FileSystemWriter`` split of write items over ``bins``
#: files (byte items first, then tensors by size).
split_by_size_and_type = _split_by_size_and_type

# --- planning: torch's chunk and read-item construction, so our plans match DCP's item for item ------------

#: ``create_chunk_list(tensor)``: the ``ChunkStorageMetadata`` list DCP's planner makes for a destination.
create_chunk_list = _create_chunk_list
#: ``create_read_items(fqn, md, obj)``: DCP's ``ReadItem`` list reading checkpoint entry ``md`` into ``obj``.
create_read_items = _create_read_items
#: ``set_element(root, path, value)``: put ``value`` at object path ``path`` of a nested state dict.
set_element = _set_element
#: ``flatten_state_dict(state_dict)``: DCP's flattening (keys joined by dots) with the mapping back.
flatten_state_dict = _flatten_state_dict


def flatten_v2_3(state_dict: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state_dict`` flattened as torch < 2.4 saved it: DCP switches its flattening by a module global,
    ``_version._derived_version = "2_3"``, exactly as its ``DefaultLoadPlanner`` does for old checkpoints
    (and, like it, resets it to ``None`` afterwards)."""
    _dcp_version._derived_version = "2_3"
    try:
        return _flatten_state_dict(state_dict)
    finally:
        _dcp_version._derived_version = None


def traverse_for_current_version() -> Callable[..., None]:
    """torch's state-dict traversal for the flattening in force now: the pre-2.4 one while a planner reads
    an old checkpoint (:func:`flatten_v2_3`), else the current one."""
    return traverse_state_dict_v_2_3 if _dcp_version._derived_version == "2_3" else traverse_state_dict


# --- torch.save's pickles and zip writer ----------------------------------------------------------------


def tensor_rebuilders() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(_rebuild_tensor_v2, _rebuild_tensor_v3)``: the functions ``torch.save`` pickles a plain tensor as
    (typed storage, and untyped storage plus dtype), so pickles we write load with ``torch.load``."""
    return _rebuild_tensor_v2, _rebuild_tensor_v3


def legacy_storage_type(dtype: torch.dtype) -> Any:
    """``torch.FloatStorage`` & co. for dtypes torch still pickles that way, else ``None`` (v3 dtypes)."""
    from torch.storage import _dtype_to_storage_type_map, _new_dtypes

    if dtype in _new_dtypes():
        return None
    name = _dtype_to_storage_type_map().get(dtype)
    return getattr(torch, name) if name else None


def save_without_crc(obj: Any, stream: Any) -> None:
    """``torch.save(obj, stream)`` with torch's zip writer told to compute no CRC-32 (each entry's is 0):
    :func:`~dcp_storage.formats.writing.save_record` fills them in. torch's ``save`` takes no such option
    per call (its ``serialization.config`` is global state), so this is ``torch.save``'s own body: a writer
    over the stream, ``serialization._save`` with torch.save's defaults (pickle, protocol 2), and the end
    records written on the way out."""
    import pickle

    writer = torch._C.PyTorchFileWriter(stream, False, torch.serialization._get_storage_alignment())
    try:
        torch.serialization._save(obj, writer, pickle, 2, False)
    except BaseException:
        # Finish the archive (torch then marks the writer finished, so its destructor writes nothing), but
        # raise what failed, not what the half-written archive's end records make of it.
        with contextlib.suppress(Exception):
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()
    stream.flush()


def _save_without_crc_available() -> bool:
    """Whether this torch has ``serialization._save`` of the signature :func:`save_without_crc` calls."""
    import inspect

    try:
        params = list(inspect.signature(torch.serialization._save).parameters)
        torch.serialization._get_storage_alignment()
    except (AttributeError, TypeError, ValueError):
        return False
    return params[:5] == ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]


SAVE_WITHOUT_CRC = _save_without_crc_available()


def zip_writer(stream: Any, alignment: int) -> Any:
    """torch's own zip writer (``torch._C.PyTorchFileWriter``, what ``torch.save`` writes with) over
    ``stream``, with CRC32s and ``alignment``-byte aligned records where this torch takes an alignment
    (2.6.0's takes none: then the writer's own default alignment)."""
    try:
        return torch._C.PyTorchFileWriter(stream, True, alignment)
    except TypeError:  # older signatures
        return torch._C.PyTorchFileWriter(stream)


# --- process groups and distributed tensors ---------------------------------------------------------------


def object_coll_device(group: Any = None) -> str:
    """The device kind (``"cpu"``, ``"cuda"``, ...) torch's object collectives use on ``group``: the group's
    own rule (gloo: cpu, NCCL: cuda), which torch has no public name for."""
    from torch.distributed.distributed_c10d import _get_object_coll_device

    return str(_get_object_coll_device(group))


def p2p_matches_by_tag(group: Any = None) -> bool:
    """Whether point-to-point messages on ``group`` are matched by tag (gloo), not by order alone (NCCL and the
    rest: a receive there takes the next message whatever its tag)."""
    import torch.distributed as dist

    return str(dist.get_backend(group)) == "gloo"


def sharded_tensor_class() -> type:
    """``ShardedTensor`` (FSDP1's sharded state dicts), imported only when asked: the module is heavy."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return ShardedTensor


def local_shape_and_offset(shape: Any, mesh: Any, placements: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and global offset of this rank's shard of a tensor of ``shape`` laid out by ``placements``
    over ``mesh`` (what ``DTensor`` computes; for tests that check a rank's slice)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local), tuple(offset)


def torch_fsspec_classes() -> tuple[type, type]:
    """torch's own ``(FsspecReader, FsspecWriter)``, for interoperability tests against ours."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecReader, FsspecWriter


# --- nn.Module internals ----------------------------------------------------------------------------------


def child_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """``module``'s children by name, ``None`` entries included (``named_children`` skips them)."""
    return module._modules


def buffers(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffers by name, persistent or not (``named_buffers`` walks the whole tree)."""
    return module._buffers


def non_persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    """Names of ``module``'s own buffers registered with ``persistent=False`` (they are in no state dict)."""
    return module._non_persistent_buffers_set


def compiled_original(model: Any) -> Any:
    """The module ``torch.compile`` wrapped, if ``model`` is such a wrapper, else ``None``.

    ``OptimizedModule`` can only exist once ``torch._dynamo`` is imported, so it is looked up among the
    loaded modules rather than imported (importing dynamo costs seconds)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        return model._orig_mod
    return None


# --- the running DCP call, read from the stack -------------------------------------------------------------

_MAX_FRAMES = 64  # dcp.load -> _load_state_dict -> reduce_scatter -> local_step -> a reader: a dozen at most
_DCP_MODULES = "torch.distributed.checkpoint"
_SAVER_MODULE = "torch.distributed.checkpoint.state_dict_saver"


@dataclass(frozen=True)
class DcpCall:
    """The DCP call a reader is serving: ``distributed`` is ``False`` under ``no_dist``."""

    distributed: bool
    group: Any  # the call's process group; None: the default group
    planner: Any  # the call's LoadPlanner (or SavePlanner), when found
    wrapper: Any = field(default=None, compare=False, repr=False)  # the call's _DistWrapper: which call it is


def current_call() -> DcpCall | None:
    """The innermost running DCP load or save, from its ``_DistWrapper``; ``None`` outside one.

    ``_load_state_dict`` builds one ``_DistWrapper(process_group, not no_dist, coordinator_rank)`` per call,
    keeps it in its local ``distW`` and drives every reader step from there (its methods hold it as
    ``self``); the planner is the local ``planner``. Only frames of ``torch.distributed.checkpoint`` modules
    are looked at. torch has built its loads this way since DCP's first release (checked in 2.6.0, 2.13.0
    and 2.14.1); if a future torch stops doing so, this returns ``None`` and readers fall back to what they
    did before (see :mod:`dcp_storage.strategies.collectives`).
    """
    try:
        from torch.distributed.checkpoint.utils import _DistWrapper
    except ImportError:  # a torch without it: no signal, readers keep their process-group rule
        return None
    frame = sys._getframe(1)
    planner: Any = None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        if str(frame.f_globals.get("__name__", "")).startswith(_DCP_MODULES):
            local_vars = frame.f_locals
            if planner is None:
                planner = local_vars.get("planner")
            wrapper = local_vars.get("distW")
            if not isinstance(wrapper, _DistWrapper):
                wrapper = local_vars.get("self")
            if isinstance(wrapper, _DistWrapper):
                return DcpCall(bool(wrapper.use_dist), wrapper.group, planner, wrapper)
        frame = frame.f_back
    return None


def save_frame() -> types.FrameType | None:
    """The outermost frame of a ``torch.distributed.checkpoint`` save (``state_dict_saver``) on this
    thread's stack, if any: a lock's renewal watches it to learn when the save has ended."""
    found = None
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == _SAVER_MODULE:
            found = frame
        frame = frame.f_back
    return found


def on_thread_stack(thread_id: int, target: types.FrameType) -> bool:
    """Whether ``target`` (from :func:`save_frame`) is still on the stack of thread ``thread_id``.

    ``sys._current_frames()`` runs with the cyclic collector paused. On CPython 3.11 before 3.11.9 it holds
    the runtime's thread-list lock while it makes frame objects; a collection started there runs finalizers,
    which may hand the GIL over, and a thread that starts or ends meanwhile waits for that lock holding the
    GIL: the whole process deadlocked (CPython gh-106883, fixed upstream the same way). A lease thread asks
    this four times a second while the save's thread pools start and end threads; a stress of exactly that
    deadlocked within 1-4 s every time before (``tests/storage/test_lease_stack_watch.py``)."""
    with gc_paused():
        frames = sys._current_frames()
    frame = frames.get(thread_id)
    del frames
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back
    return False
