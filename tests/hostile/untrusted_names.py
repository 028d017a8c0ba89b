"""Checkpoints whose names attack the terminal: keys, file names, dtypes, format, writer and extension
descriptors holding ESC/OSC sequences, BEL, CR, backspace, newlines, C1 controls, bidi overrides and lone
surrogates. Some are valid (they must load, and print harmlessly); the others are also damaged, so the error
or ``verify`` problem quotes the hostile name.

Every builder returns a :class:`Hostile`: where it is, the hostile names the output must show (escaped),
and whether a load must fail.
"""

from __future__ import annotations

import json
import pickle
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .corpus import _handmade_torch_zip

__all__ = ["NAMES", "VALUES", "Hostile", "build_all", "raw_controls"]

# One per technique; together they cover every class of character that must not reach a terminal raw.
NAMES = {
    "clear-and-fake-ok": "\x1b[2J\x1b[HOK: checkpoint verified\x07",  # CSI clear + home, a fake verdict, BEL
    "osc-title": "w\x1b]0;pwned\x07",  # OSC: sets the window title
    "carriage-return": "bias\rOK: checkpoint verified",  # overwrites the start of the line
    "backspace": "weight\x08\x08\x08\x08\x08\x08OK",  # erases what was printed
    "newline": "w\nOK: checkpoint verified",  # forges a line of its own
    "c1-csi": "w\x9b31mred",  # 8-bit CSI (C1 control)
    "bidi": "w\u202egnp.exe\u2066x\u2069",  # right-to-left override and an isolate
    "del-and-zero-width": "a\x7fb\u200bc",
    "lone-surrogate": "lone\udc80",
}


@dataclass
class Hostile:
    name: str
    url: str
    names: list[str]  # hostile names the output must show, escaped
    loads: bool  # a load (and verify) must succeed


def raw_controls(text: str, allow: str = "") -> list[str]:
    """The characters of ``text`` that must not reach a terminal (every one ``str.isprintable`` rejects)."""
    return sorted({repr(ch) for ch in text if not ch.isprintable() and ch not in allow})


def _quiet_save(sd: dict[str, Any], path: Path, **writer: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save without a process group says so
        dcp.save(sd, storage_writer=FsspecWriter(str(path), **writer), no_dist=True)


def _state() -> dict[str, Any]:
    sd: dict[str, Any] = {name: torch.full((4, 3), float(i)) for i, name in enumerate(NAMES.values())}
    sd["step\x1b]0;pwned\x07"] = 7  # a non-tensor value
    return sd


def _tensor_names() -> list[str]:
    return list(NAMES.values())


def _edit_metadata(path: Path, edit: Any) -> None:
    md = pickle.loads((path / ".metadata").read_bytes())
    edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def dcp_valid(root: Path) -> Hostile:
    path = root / "dcp-valid"
    _quiet_save(_state(), path)
    return Hostile("dcp-valid", str(path), [*_tensor_names(), "step\x1b]0;pwned\x07"], loads=True)


VALUES = ["step\x1b]0;pwned\x07", "note\r\x1b[2KOK"]


def dcp_values(root: Path) -> Hostile:
    """Printable tensor keys, hostile non-tensor value keys (what safetensors output drops or refuses)."""
    path = root / "dcp-values"
    _quiet_save({"w": torch.ones(2, 2), **{v: i for i, v in enumerate(VALUES)}}, path)
    return Hostile("dcp-values", str(path), VALUES, loads=True)


def dcp_truncated(root: Path) -> Hostile:
    """Every record of the hostile keys lies past the end of its (truncated) file."""
    path = root / "dcp-truncated"
    _quiet_save(_state(), path)
    for data in path.glob("*.distcp"):
        with open(data, "r+b") as f:
            f.truncate(40)
    return Hostile("dcp-truncated", str(path), [NAMES["clear-and-fake-ok"]], loads=False)


def dcp_extension(root: Path) -> Hostile:
    """Items that name a hostile stream extension; a manifest with a hostile writer, format and extension."""
    path = root / "dcp-extension"
    _quiet_save(_state(), path)
    descriptor = "stream.\x1b[2Jevil/1"

    def edit(md: Any) -> None:
        for info in md.storage_data.values():
            info.transform_descriptors = [descriptor]

    _edit_metadata(path, edit)
    manifest_path = path / ".dcp_storage.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["writer"] = "dcp-storage/\x1b[2J\x1b[HOK"
    manifest["extensions"] = [{"descriptor": descriptor, "distribution": "evil\rpkg", "version": "1\x07"}]
    manifest_path.write_text(json.dumps(manifest))
    return Hostile("dcp-extension", str(path), [descriptor, "dcp-storage/\x1b[2J\x1b[HOK"], loads=False)


def dcp_unknown_format(root: Path) -> Hostile:
    """The manifest names a format (and writer) no plugin provides."""
    path = root / "dcp-format"
    _quiet_save(_state(), path)
    manifest_path = path / ".dcp_storage.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format"] = "evil\x1b[2J\x1b[HOK/1"
    manifest["writer"] = "w\x1b]0;pwned\x07/1"
    manifest_path.write_text(json.dumps(manifest))
    return Hostile("dcp-format", str(path), ["evil\x1b[2J\x1b[HOK"], loads=False)


def _safetensors(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()  # \uXXXX escapes: any code point, lone surrogates included
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def safetensors_valid(root: Path) -> Hostile:
    header, data = {}, b""
    for i, name in enumerate(NAMES.values()):
        blob = struct.pack("<3f", i, i, i)
        header[name] = {"dtype": "F32", "shape": [3], "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    header["__metadata__"] = {"format": "pt\x1b[2J"}
    path = root / "valid.safetensors"
    path.write_bytes(_safetensors(header, data))
    return Hostile("st-valid", str(path), _tensor_names(), loads=True)


def safetensors_bad_dtype(root: Path) -> Hostile:
    key, dtype = NAMES["clear-and-fake-ok"], "F32\x1b[2J\x1b[HOK"
    header = {key: {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}}
    path = root / "dtype.safetensors"
    path.write_bytes(_safetensors(header, b"\0" * 8))
    return Hostile("st-dtype", str(path), [key, dtype], loads=False)


def hf_index_hostile_file(root: Path) -> Hostile:
    """An HF index whose weight_map names a shard with a hostile name that does not exist."""
    path = root / "hf"
    path.mkdir()
    shard = "model\x1b[2J\x1b[HOK.safetensors"
    index = {"metadata": {}, "weight_map": {NAMES["carriage-return"]: shard}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return Hostile("hf-index", str(path / "model.safetensors.index.json"), [shard], loads=False)


def torch_save_valid(root: Path) -> Hostile:
    path = root / "valid.pt"
    torch.save(_state(), path)
    return Hostile("pt-valid", str(path), [*_tensor_names(), "step\x1b]0;pwned\x07"], loads=True)


def torch_save_hostile_global(root: Path) -> Hostile:
    """``data.pkl`` names a global whose module is an escape sequence (refused, never imported)."""
    module = "os\x1b[2J\x1b[HOK"
    data_pkl = b"\x80\x02c" + module.encode() + b"\nsystem\n)R."
    path = root / "global.pt"
    path.write_bytes(_handmade_torch_zip(data_pkl, b"\0" * 8))
    return Hostile("pt-global", str(path), [module], loads=False)


BUILDERS = (
    dcp_valid,
    dcp_values,
    dcp_truncated,
    dcp_extension,
    dcp_unknown_format,
    safetensors_valid,
    safetensors_bad_dtype,
    hf_index_hostile_file,
    torch_save_valid,
    torch_save_hostile_global,
)


def build_all(root: Path) -> list[Hostile]:
    return [build(root) for build in BUILDERS]
