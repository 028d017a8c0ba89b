"""The file names of a checkpoint, defined once, and the check of the names a checkpoint records.

Names. Every module that writes, finds or lists a checkpoint's files takes their names from here:
DCP's ``.metadata`` and ``.distcp`` data files, dcp-storage's manifest and lock, Hugging Face safetensors
files and index, the extra-state file ``SafetensorsWriter`` writes, and the hidden temp names of a local
save in progress, with the patterns that recognise each kind of name in a listing.

Checking. A checkpoint names its own files: an HF index's ``weight_map``, DCP's ``.metadata`` storage map. A hostile
one could name ``../../etc/passwd``, an absolute path or a URL to another bucket and have a reader fetch
it with the caller's credentials. Every recorded name must be a plain relative path below the checkpoint.
"""

from __future__ import annotations

import os
import re
import unicodedata
import urllib.parse
from typing import Any

from dcp_storage.errors import CorruptCheckpointError

__all__ = [
    "DATA_SUFFIX",
    "HF_SHARD_RE",
    "LOCK_RE",
    "MANIFEST_RE",
    "RANK_METADATA_RE",
    "TEMP_RE",
    "EXTRA_STATE_FILE",
    "INDEX_FILE",
    "INDEX_SUFFIX",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "METADATA_FILE",
    "SAFETENSORS_SUFFIX",
    "check_prefix",
    "check_relative",
    "index_name",
    "shard_name",
    "single_name",
    "temp_name",
]

METADATA_FILE = ".metadata"  # DCP's metadata, the commit marker of a DCP checkpoint
DATA_SUFFIX = ".distcp"  # DCP's data files
MANIFEST_FILE = ".dcp_storage.json"  # dcp-storage's manifest (integrity.manifest), written just before .metadata
LOCK_FILE = ".dcp_storage.lock"  # held by a save from before its first byte until its commit (storage.claim)
SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"  # a Hugging Face index: {prefix}.safetensors.index.json
EXTRA_STATE_FILE = "extra_state.pt"  # SafetensorsWriter(allow_extra_state=True): non-tensor entries
DEFAULT_PREFIX = "model"  # what Hugging Face's save_pretrained names its files


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can start a file name in the checkpoint directory (plain, not hidden), else ``ValueError``."""
    if not prefix or "/" in prefix or os.sep in prefix or prefix.startswith("."):
        raise ValueError(f"filename_prefix must be a plain, non-hidden file name, got {prefix!r}")
    return prefix


def single_name(prefix: str = DEFAULT_PREFIX) -> str:
    """The one safetensors file of an unsharded save: ``model.safetensors``."""
    return f"{prefix}{SAFETENSORS_SUFFIX}"


def shard_name(prefix: str, k: int, n: int) -> str:
    """File ``k`` (1-based) of ``n``: ``model-00001-of-00003.safetensors``, as ``save_pretrained`` names it."""
    return f"{prefix}-{k:05d}-of-{n:05d}{SAFETENSORS_SUFFIX}"


def index_name(prefix: str = DEFAULT_PREFIX) -> str:
    """The index of a sharded save: ``model.safetensors.index.json``."""
    return f"{prefix}{INDEX_SUFFIX}"


INDEX_FILE = index_name()


def temp_name(name: str, token: str) -> str:
    """The hidden name ``.{name}.{token}.tmp`` a local save writes ``name`` under until its commit."""
    return f".{name}.{token}.tmp"


# What a listing holds. Temp files: the transport's open_atomic and SafetensorsWriter use a uuid4 hex token.
TEMP_RE = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{32}\.tmp$")
HF_SHARD_RE = re.compile(rf"^(?P<prefix>.+)-\d{{5}}-of-\d{{5}}{re.escape(SAFETENSORS_SUFFIX)}$")  # shard_name's
RANK_METADATA_RE = re.compile(rf"^__\d+{re.escape(METADATA_FILE)}$")  # a rank-local save's __{rank}.metadata
MANIFEST_RE = re.compile(rf"^(__\d+)?{re.escape(MANIFEST_FILE)}$")  # rank-local saves: __{rank}.dcp_storage.json
LOCK_RE = re.compile(rf"^(__\d+)?{re.escape(LOCK_FILE)}$")  # see storage.claim.lock_name


def check_relative(name: Any, where: str) -> str:
    """``name`` if it is a plain relative path that stays under the checkpoint root, else an error.

    The name is checked as it is and as what it may become further down (:func:`_read_as`): a URL library
    decodes ``%2e%2e`` into ``..`` and resolves it (yarl, under fsspec's HTTP filesystem, requests
    ``ckpt/%2e%2e/x`` as ``/x``), and NFKC folds fullwidth dots and solidus into ``..`` and ``/``.
    """
    if not isinstance(name, str) or not name:
        raise CorruptCheckpointError(f"{where}: file name must be a non-empty string, got {name!r}")
    for form in _read_as(name):
        _check_form(name, form, where)
    return name


def _read_as(name: str) -> list[str]:
    """``name``, its percent-decodings (repeated: some stacks decode twice) and their NFKC forms."""
    forms = [name]
    while "%" in forms[-1] and len(forms) < 4:
        decoded = urllib.parse.unquote(forms[-1])
        if decoded == forms[-1]:
            break
        forms.append(decoded)
    return list(dict.fromkeys([*forms, *(unicodedata.normalize("NFKC", f) for f in forms)]))


def _check_form(name: str, form: str, where: str) -> None:
    shown = repr(name) if form == name else f"{name!r} (read as {form!r} once decoded)"
    parts = form.replace("\\", "/").split("/")
    if (
        "://" in form
        or form.startswith(("/", "\\", "~"))
        or (len(form) > 1 and form[1] == ":")  # C:\..., or a scheme without //
        or ".." in parts
        or "\x00" in form
    ):
        raise CorruptCheckpointError(
            f"{where}: file name {shown} escapes the checkpoint directory (absolute path, URL or '..'); refusing it"
        )
    if "" in parts or "." in parts:  # "x/", ".", "a//b", "a/./b": a directory, or a name no writer produces
        raise CorruptCheckpointError(
            f"{where}: file name {shown} is not a plain file name (an empty or '.' part, or a trailing '/': it names "
            "a directory, or the checkpoint itself); refusing it"
        )
