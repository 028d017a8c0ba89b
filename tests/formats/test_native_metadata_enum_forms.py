"""Both ways Python pickles an enum member decode natively, and nothing else does.

Python 3.11.0-3.11.4 pickle ``_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT`` as
``getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")``; 3.11.5 and later as
``_MEM_FORMAT_ENCODING(0)``. A ``.metadata`` written by either must take the native path, whichever
interpreter reads it (the fast path was silently lost on the older one). The form is forced here with
``reducer_override``, so these tests check both forms on every interpreter.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from dcp_storage.formats.columns import columns_from_metadata, property_key
from dcp_storage.formats.dcp_native import native as native_decode
from tests.formats.test_native_metadata_decode import bench_metadata, check_equal, rich_metadata

needs_native = pytest.mark.skipif(not native_decode.available(), reason="C extension not built (no compiler)")


def dumps(md: Any, form: str, protocol: int = pickle.DEFAULT_PROTOCOL, member_name: str | None = None) -> bytes:
    """``pickle.dumps(md)`` with every memory-format member in the given form ("value" or "getattr")."""

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, _MEM_FORMAT_ENCODING):
                if form == "getattr":
                    return getattr, (type(obj), obj.name if member_name is None else member_name)
                return type(obj), (obj.value,)
            return NotImplemented

    out = io.BytesIO()
    Pickler(out, protocol=protocol).dump(md)
    return out.getvalue()


@needs_native
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("form", ["value", "getattr"])
def test_either_enum_form_decodes_natively(form, protocol):
    data = dumps(rich_metadata(), form, protocol)
    assert (b"getattr" in data) == (form == "getattr")
    cols = check_equal(data)
    formats = {property_key(p)[3] for p in cols.properties}
    assert len(formats) == 2  # channels_last and preserve_format: two distinct members went through


@needs_native
def test_getattr_form_gives_the_same_columns_as_the_value_form():
    a = native_decode.decode_columns(dumps(bench_metadata(50), "getattr"))
    b = native_decode.decode_columns(dumps(bench_metadata(50), "value"))
    ref = columns_from_metadata(bench_metadata(50))
    assert a is not None and b is not None
    assert [property_key(p) for p in a.properties] == [property_key(p) for p in b.properties]
    assert [property_key(p) for p in a.properties] == [property_key(p) for p in ref.properties]


@needs_native
@pytest.mark.parametrize("name", ["NO_SUCH_MEMBER", "TORCH_CONTIGUOUS_FORMATX", "TORCH_CONTIGUOUS_FORMA", ""])
def test_unknown_member_name_is_none(name):
    assert native_decode.decode_columns(dumps(bench_metadata(1), "getattr", member_name=name)) is None


@needs_native
def test_memory_format_code_out_of_range_is_none():
    data = dumps(bench_metadata(1), "value", protocol=4)
    enc = b"_MEM_FORMAT_ENCODING\x94\x93\x94K\x00"
    assert enc in data
    assert native_decode.decode_columns(data.replace(enc, enc[:-1] + b"\x07")) is None


@needs_native
def test_getattr_of_anything_but_the_memory_format_enum_is_none():
    """Only getattr(_MEM_FORMAT_ENCODING, member) is understood: getattr of another global, or with other
    arguments, goes to the general path (which refuses it, naming the global)."""
    md = bench_metadata(1)

    def with_reduction(reduction: tuple) -> bytes:
        class Pickler(pickle.Pickler):
            def reducer_override(self, obj: Any) -> Any:
                return reduction if isinstance(obj, _MEM_FORMAT_ENCODING) else NotImplemented

        out = io.BytesIO()
        Pickler(out, protocol=4).dump(md)
        return out.getvalue()

    for reduction in (
        (getattr, (torch.Size, "TORCH_CONTIGUOUS_FORMAT")),
        (getattr, (torch.float32, "TORCH_CONTIGUOUS_FORMAT")),
        (getattr, (_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT", None)),
        (getattr, (_MEM_FORMAT_ENCODING,)),
        (getattr, (_MEM_FORMAT_ENCODING, 0)),
    ):
        assert native_decode.decode_columns(with_reduction(reduction)) is None, reduction


def test_memory_format_names_follow_the_enum_values():
    names = native_decode._memory_format_names()
    assert [_MEM_FORMAT_ENCODING[name].value for name in names] == list(range(len(names)))
    assert len(names) == len(_MEM_FORMAT_ENCODING)


@needs_native
@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_python_2_s_builtin_module_only_in_protocol_2(protocol):
    """``__builtin__.getattr`` is what protocol 2 writes; pickle.loads maps it only there, and so do we."""
    py2 = dumps(bench_metadata(2), "getattr", 2)
    assert b"__builtin__" in py2 and native_decode.decode_columns(py2) is not None
    good = pickletools.optimize(dumps(bench_metadata(2), "getattr", protocol))  # frames rebuilt after the edit
    assert native_decode.decode_columns(good) is not None
    data = good.replace(b"\x8c\x08builtins", b"\x8c\x0b__builtin__").replace(b"cbuiltins\n", b"c__builtin__\n")
    data = pickletools.optimize(data)
    assert b"__builtin__" in data
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(data)
    assert native_decode.decode_columns(data) is None
