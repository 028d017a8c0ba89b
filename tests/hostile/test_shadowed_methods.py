"""A pickle must not give a container it built instance attributes that hide the container's methods.

An ``OrderedDict`` instance has a ``__dict__``, and a pickle may ``BUILD`` plain (non-dunder) attributes
onto one it created (torch's ``state_dict()`` records ``_metadata`` that way). ``{"items": list}`` is such
a plain attribute, but it hides ``OrderedDict.items`` for that instance: every later ``.items()`` returns
``[]`` while ``[key]`` and ``in`` still see the real entries. A ``.metadata`` whose ``storage_data`` and
``state_dict_metadata`` are such dicts passes every structural check unseen (the checks iterate
``.items()``), so a tensor whose chunks leave a gap loaded "successfully" with the gap left as it was.
Such state is refused like dunder state, for every allow-list unpickler and every way of writing the key.
"""

from __future__ import annotations

import collections
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_storage.errors import DcpStorageError, UnsafeCheckpointError

_SHADOWS = ("items", "values", "keys")


class _Shadowed(collections.OrderedDict):
    """Pickled as an ``OrderedDict`` whose ``BUILD`` state hides ``names`` (see :class:`_Pickler`)."""

    names: tuple[str, ...] = _SHADOWS


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is _Shadowed:
            state = dict.fromkeys(obj.names, list)  # list() == []: the hidden method now returns nothing
            return collections.OrderedDict, (), state, None, iter(dict(obj).items())
        return NotImplemented


def _dumps(obj: Any, protocol: int = 2) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


def _gap_checkpoint(root: Path, shadow: bool) -> bytes:
    """A checkpoint of ``w`` (4 elements saved) whose ``.metadata`` claims 16: a gap of 12 elements."""
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecWriter

    dcp.save({"w": torch.arange(4.0)}, storage_writer=FsspecWriter(str(root)), no_dist=True)
    md = pickle.loads((root / ".metadata").read_bytes())
    md.state_dict_metadata["w"].size = torch.Size([16])
    if shadow:
        md.storage_data = _Shadowed(md.storage_data)
        md.state_dict_metadata = _Shadowed(md.state_dict_metadata)
    data = _dumps(md)
    (root / ".metadata").write_bytes(data)
    return data


def test_a_gap_hidden_behind_shadowed_items_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_storage import open_reader
    from dcp_storage.formats.dcp_native.native import load_metadata

    plain = _gap_checkpoint(tmp_path / "plain", shadow=False)
    with pytest.raises(DcpStorageError, match="w"):  # the gap itself: refused when not hidden
        load_metadata(plain, "plain/.metadata")

    hidden = _gap_checkpoint(tmp_path / "hidden", shadow=True)
    with pytest.raises(UnsafeCheckpointError, match=r"hidden/\.metadata") as info:
        load_metadata(hidden, "hidden/.metadata")
    assert "BUILD" in str(info.value)
    target = {"w": torch.full((16,), -1.0)}
    with pytest.raises((CheckpointException, AssertionError), match="hidden"):
        dcp.load(target, storage_reader=open_reader(str(tmp_path / "hidden")), no_dist=True)
    assert (target["w"] == -1).all()  # nothing was loaded


def _key(form: str, name: str) -> bytes:
    raw = name.encode()
    return {
        "binunicode": b"X" + len(raw).to_bytes(4, "little") + raw,
        "short-binunicode": b"\x8c" + bytes([len(raw)]) + raw,
        "unicode-line": b"V" + raw + b"\n",
        "string-line": b"S'" + raw + b"'\n",
        "short-binstring": b"U" + bytes([len(raw)]) + raw,
    }[form]


def _shadowing_od(form: str, name: str) -> bytes:
    """``OrderedDict()`` with ``{name: list}`` as BUILD state, the key written as ``form``, then STOP."""
    return b"\x80\x02ccollections\nOrderedDict\n)R}" + _key(form, name) + b"c__builtin__\nlist\nsb."


FORMS = ("binunicode", "short-binunicode", "unicode-line", "string-line", "short-binstring")


def _decoders() -> dict[str, Any]:
    from dcp_storage.formats.torch_save.pickle_tree import decode_data_pkl
    from dcp_storage.safe_unpickle import safe_loads

    allowed = {("collections", "OrderedDict"): collections.OrderedDict, ("__builtin__", "list"): list}
    return {
        "allow-list": lambda data: safe_loads(data, "ckpt/x.pkl", allowed),
        "data_pkl": lambda data: decode_data_pkl(data.replace(b"__builtin__\nlist", b"__builtin__\nset"), "ckpt/x.pkl"),
    }


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("decoder", ["allow-list", "data_pkl"])
@pytest.mark.parametrize("name", ["items", "get", "update", "move_to_end"])
def test_every_spelling_of_a_shadowing_key_is_refused(decoder: str, form: str, name: str) -> None:
    data = _shadowing_od(form, name)
    if decoder == "allow-list":
        live = pickle.loads(data)
        assert name in vars(live)  # the stream does hide the method when unguarded
    with pytest.raises(UnsafeCheckpointError, match="ckpt/x.pkl"):
        _decoders()[decoder](data)


def test_plain_attributes_on_a_state_dict_still_load(tmp_path: Path) -> None:
    """torch's ``state_dict()`` carries ``_metadata`` as BUILD state: that stays accepted everywhere."""
    from dcp_storage.formats.torch_save.pickle_tree import decode_data_pkl

    sd = torch.nn.Linear(2, 2).state_dict()
    assert hasattr(sd, "_metadata")
    path = tmp_path / "model.pt"
    torch.save(sd, path)
    import zipfile

    with zipfile.ZipFile(path) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    tree, _ = decode_data_pkl(pkl, "model.pt")
    assert set(tree) == {"weight", "bias"} and "_metadata" in vars(tree)
    for form in FORMS:  # a non-shadowing key in every spelling
        got = pickle.loads(_shadowing_od(form, "notes"))
        assert vars(got) == {"notes": list}
        from dcp_storage.safe_unpickle import safe_loads

        allowed = {("collections", "OrderedDict"): collections.OrderedDict, ("__builtin__", "list"): list}
        assert vars(safe_loads(_shadowing_od(form, "notes"), "x", allowed)) == {"notes": list}


_OD = b"\x80\x02ccollections\nOrderedDict\n)R"
_LIST = b"c__builtin__\nlist\n"


def _paths(key: bytes) -> dict[str, bytes]:
    """The same shadowing state reaching BUILD through each opcode that adds a key or fetches a value."""
    return {
        "setitems": _OD + b"}(" + key + _LIST + b"ub.",
        "dict-opcode": _OD + b"(" + key + _LIST + b"db.",
        "key-from-memo": key + b"q\x010" + _OD + b"}h\x01" + _LIST + b"sb.",
        "state-from-memo": b"\x80\x02}" + key + _LIST + b"sq\x010" + _OD + b"h\x01b.",
    }


_KEYS = {
    "binunicode8": b"\x8d" + (5).to_bytes(8, "little") + b"items",
    "binstring": b"T" + (5).to_bytes(4, "little") + b"items",
    "short-binunicode": _key("short-binunicode", "items"),
}


@pytest.mark.parametrize("key", sorted(_KEYS))
@pytest.mark.parametrize("path", sorted(_paths(b"")))
@pytest.mark.parametrize("decoder", ["allow-list", "data_pkl"])
def test_a_shadowing_key_is_refused_on_every_path_to_build(decoder: str, path: str, key: str) -> None:
    data = _paths(_KEYS[key])[path]
    if decoder == "allow-list":
        assert "items" in vars(pickle.loads(data))  # live when unguarded
        plain = _paths(_KEYS[key].replace(b"items", b"itemz"))[path]
        allowed = {("collections", "OrderedDict"): collections.OrderedDict, ("__builtin__", "list"): list}
        from dcp_storage.safe_unpickle import safe_loads

        assert vars(safe_loads(plain, "x", allowed)) == {"itemz": list}  # same spelling, no method hidden
    with pytest.raises(UnsafeCheckpointError, match="ckpt/x.pkl"):
        _decoders()[decoder](data)
