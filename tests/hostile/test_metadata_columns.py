"""The ``.metadata`` fast path (columns checked on arrays, served as views) gives every hostile ``.metadata``
of the corpus the outcome of the general path: the same error, word for word, or the same acceptance.

Both column builders: the native decoder, and ``DCP_STORAGE_METADATA_DECODER=python`` (columns from the
guarded unpickler's object, the native decoder's reference). Every regular hostile metadata goes through
``columns_sound``; where that says no, the general checks name the problem.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dcp_storage.formats.columns import columns_from_metadata
from dcp_storage.formats.dcp_native import native as metadata_io
from dcp_storage.formats.dcp_native import native as native_decode

from .corpus import Case


def _outcome(data: bytes, path: str) -> str:
    try:
        md = metadata_io.load_metadata(data, path)
    except Exception as exc:  # noqa: BLE001 - the outcome compared
        return f"{type(exc).__name__}: {exc}"
    return f"ok: {sorted(md.state_dict_metadata)}"


def _columns(data: bytes, path: str, decoder: str) -> Any:
    if decoder == "native":
        return native_decode.decode_columns(data)
    try:
        md = metadata_io.safe_loads(data, path, metadata_io._ALLOWED, expected=metadata_io.Metadata)
    except Exception:  # noqa: BLE001 - refused by the unpickler: no columns
        return None
    return columns_from_metadata(md)


@pytest.mark.parametrize("decoder", ["python", "native"])
def test_fast_path_refuses_what_the_general_path_refuses(
    corpus: list[Case], monkeypatch: pytest.MonkeyPatch, decoder: str
) -> None:
    if decoder == "native" and not native_decode.available():
        pytest.skip("the native .metadata decoder is not built")
    compared = refused = 0
    for case in corpus:
        path = Path(case.url) / ".metadata"
        if not path.is_file() or path.is_symlink() or os.path.getsize(path) > 64 << 20:
            continue
        data = path.read_bytes()
        monkeypatch.setenv("DCP_STORAGE_METADATA_DECODER", "off")
        general = _outcome(data, str(path))
        monkeypatch.setenv("DCP_STORAGE_METADATA_DECODER", decoder)
        monkeypatch.setenv("DCP_STORAGE_LAZY_METADATA_ENTRIES", "0")
        fast = _outcome(data, str(path))
        monkeypatch.delenv("DCP_STORAGE_LAZY_METADATA_ENTRIES")
        assert fast == general, case.name
        compared += 1
        if not general.startswith("ok") and _columns(data, str(path), decoder) is not None:
            refused += 1  # columns built, refused by columns_sound, then named by the general checks
    assert compared >= 200, compared
    assert refused >= 20, refused
