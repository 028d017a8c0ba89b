"""A seeded corpus of hostile checkpoints, written by the tests themselves (nothing is checked in).

Every :class:`Case` is one damaged or malicious checkpoint in its own directory, made from a small valid
checkpoint of the same format by one mutation: empty, random bytes, truncated at seeded random points,
absurd header lengths, overlapping or out-of-range offsets, index entries that leave the checkpoint
(``../../x``, absolute paths, URLs to another bucket), pickles whose payload would create a marker file
(in ``.metadata``, in data records, in ``torch.save`` files of both formats), unknown dtypes, shapes whose
byte count overflows. Families:

* ``dcp``: DCP native, ``.metadata`` + ``__0_0.distcp`` of ``torch.save`` records (``FsspecWriter``);
* ``dcp_st``: torch's ``FileSystemWriter(serialization_format=SAFETENSORS)``: ``.metadata`` + safetensors;
* ``st``: one ``model.safetensors``;
* ``hf``: two shards and ``model.safetensors.index.json``;
* ``zip`` / ``legacy``: a ``torch.save`` file in the zip and the pre-1.6 pickle formats.

Each case says which file is to blame (``culprit``: the error must name it) and whether the damage is in
what ``describe``/``inspect`` reads (``in_metadata``) or only in tensor data that a load or a deep verify
reads. The same seed gives the same bytes.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import random
import shutil
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import tests.hostile.zip_mutations as zm
from tests.storage.test_roundtrip_single_process import evil_reduce

from . import payloads as P

__all__ = ["FAMILIES", "Case", "build_corpus", "dest_state_dict", "torch_state_dict"]

SEED = 20240607
FAMILIES = ("dcp", "dcp_st", "st", "hf", "zip", "legacy")
ST_FILE, INDEX_FILE, PT_FILE, METADATA, DISTCP = (
    "model.safetensors",
    "model.safetensors.index.json",
    "model.pt",
    ".metadata",
    "__0_0.distcp",
)
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
BIG = 70_000  # float32 elements: 280 KB, above DcpLoaderConfig.small_item_bytes (read by header probe)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return {
        "w": torch.randn(16, 8, generator=g),
        "big": torch.randn(BIG, generator=g),
        "ids": torch.arange(10, dtype=torch.int64),
    }


def torch_state_dict() -> dict[str, Any]:
    """What the DCP and ``torch.save`` checkpoints hold: the tensors and a non-tensor value."""
    return {**tensors(), "step": 7}


def dest_state_dict(case: Case, tensors_only: bool = False) -> dict[str, Any]:
    """A fresh destination for loading ``case`` (the shapes of the valid checkpoint it was made from).

    ``tensors_only``: leave out the non-tensor value (``DynamicMetaLoadPlanner`` loads tensors only).
    """
    out: dict[str, Any] = {k: torch.zeros_like(v) for k, v in tensors().items()}
    if case.family in ("dcp", "dcp_st", "zip", "legacy") and not tensors_only:
        out["step"] = 0
    if case.keys is not None:
        out = {k: v for k, v in out.items() if k in case.keys}
    return out


@dataclass(frozen=True)
class Case:
    """One hostile checkpoint. ``url``: what a user opens; ``culprit``: the file name errors must name."""

    name: str
    family: str
    url: str
    culprit: str
    in_metadata: bool = True
    marker: str | None = None  # a payload case: this file must never appear
    keys: tuple[str, ...] | None = None  # what to load (default: every key of the valid checkpoint)

    def __str__(self) -> str:
        return self.name


# ------------------------------------------------------------------------------------------- bytes helpers
def _rng(name: str, seed: int) -> random.Random:
    return random.Random(f"{seed}:{name}")


def _random_bytes(rng: random.Random, n: int) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(n))


def _safetensors_blob(header: Any, data: bytes = b"", raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _st_header(data_len: int = 16) -> dict[str, Any]:
    return {"a": {"dtype": "F32", "shape": [data_len // 4], "data_offsets": [0, data_len]}}


class _FakeStorage:
    def __init__(self, storage_type: Any, numel: int) -> None:
        self.storage_type, self.numel = storage_type, numel


class _FakeTensor:
    """Pickles like a tensor (``_rebuild_tensor_v2``) with whatever shape and stride we ask for."""

    def __init__(self, storage: _FakeStorage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self) -> Any:
        return (torch._utils._rebuild_tensor_v2, self.args)


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _FakeStorage):
            return ("storage", obj.storage_type, "0", "cpu", obj.numel)
        return None


def _torch_save_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _data_pkl(obj: Any) -> bytes:
    buf = io.BytesIO()
    _TorchPickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _handmade_torch_zip(data_pkl: bytes, storage: bytes, *, compress: bool = False, with_storage: bool = True) -> bytes:
    """A ``torch.save``-shaped zip (``archive/data.pkl``, ``byteorder``, ``data/0``) around a crafted pickle."""

    def entry(name: str) -> zipfile.ZipInfo:
        return zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))  # fixed: the corpus is reproducible

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(entry("archive/data.pkl"), data_pkl)
        zf.writestr(entry("archive/byteorder"), b"little")
        if with_storage:
            method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
            zf.writestr(entry("archive/data/0"), storage, compress_type=method)
        zf.writestr(entry("archive/version"), b"3\n")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------- the builder
class _Builder:
    def __init__(self, root: Path, seed: int) -> None:
        self.root = root
        self.seed = seed
        self.good = root / "_good"
        self.cases: list[Case] = []
        self._make_good()

    # -- valid checkpoints every case starts from
    def _make_good(self) -> None:
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        from dcp_storage import FsspecWriter

        self.good.mkdir(parents=True)
        dcp.save(torch_state_dict(), storage_writer=FsspecWriter(str(self.good / "dcp")), no_dist=True)
        writer = FileSystemWriter(str(self.good / "dcp_st"), serialization_format=SerializationFormat.SAFETENSORS)
        dcp.save(torch_state_dict(), storage_writer=writer, no_dist=True)
        (self.good / "st").mkdir()
        save_file(tensors(), str(self.good / "st" / ST_FILE))
        (self.good / "hf").mkdir()
        t = tensors()
        save_file({"w": t["w"], "ids": t["ids"]}, str(self.good / "hf" / SHARDS[0]))
        save_file({"big": t["big"]}, str(self.good / "hf" / SHARDS[1]))
        weight_map = {"w": SHARDS[0], "ids": SHARDS[0], "big": SHARDS[1]}
        (self.good / "hf" / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        (self.good / "zip").mkdir()
        torch.save(torch_state_dict(), self.good / "zip" / PT_FILE)
        (self.good / "legacy").mkdir()
        torch.save(torch_state_dict(), self.good / "legacy" / PT_FILE, _use_new_zipfile_serialization=False)

    # -- one case: copy the family's good checkpoint, then mutate it
    def case(
        self,
        family: str,
        name: str,
        culprit: str,
        mutate: Callable[[Path], None],
        *,
        open_as: str = "",
        in_metadata: bool = True,
        payload: bool = False,
        keys: tuple[str, ...] | None = None,
    ) -> None:
        full = f"{family}/{name}"
        if any(c.name == full for c in self.cases):
            raise ValueError(f"duplicate corpus case {full}")
        where = self.root / full.replace("/", "__")
        shutil.copytree(self.good / family, where)
        marker = str(self.root / f"MARKER-{full.replace('/', '__')}") if payload else None
        self._marker = Path(marker) if marker else None
        mutate(where)
        target = {"dcp": "", "dcp_st": "", "st": ST_FILE, "hf": INDEX_FILE, "zip": PT_FILE, "legacy": PT_FILE}[family]
        if open_as == ".":
            url = str(where)
        else:
            url = str(where / (open_as or target)) if (open_as or target) else str(where)
        self.cases.append(Case(full, family, url, culprit, in_metadata, marker, keys))

    def evil(self) -> Any:
        assert self._marker is not None
        return evil_reduce(self._marker)

    # -- shared mutations
    def file_mutations(self, family: str, file: str, *, in_metadata: bool, open_as: str = "", cuts: int = 4) -> None:
        """Empty, random bytes, truncated at seeded random points."""
        rng = _rng(f"{family}/{file}", self.seed)
        size = (self.good / family / file).stat().st_size
        tag = file.lstrip(".").replace(".", "-")
        self.case(
            family,
            f"{tag}-empty",
            file,
            lambda d: (d / file).write_bytes(b""),
            open_as=open_as,
            in_metadata=in_metadata,
        )
        for n in (1, 7, 64, size):
            blob = _random_bytes(rng, n)
            label = "full" if n == size else n  # the valid file's size varies with its path and save ids
            self.case(
                family,
                f"{tag}-random-{label}",
                file,
                lambda d, b=blob: (d / file).write_bytes(b),
                open_as=open_as,
                in_metadata=in_metadata,
            )
        cut_rng = _rng(f"{family}/{file}/cuts", self.seed)  # apart: the random blobs' sizes vary
        for frac in sorted(cut_rng.random() for _ in range(cuts)):
            cut = min(size - 1, max(1, int(frac * size)))
            self.case(
                family,
                f"{tag}-truncated-{frac:.4f}",
                file,
                lambda d, c=cut: (d / file).write_bytes((d / file).read_bytes()[:c]),
                open_as=open_as,
                in_metadata=in_metadata,
            )

    # ------------------------------------------------------------------------------------- DCP metadata
    def file_of(self, family: str, fqn: str) -> str:
        """The data file of the valid checkpoint that holds ``fqn``."""
        md = pickle.loads((self.good / family / METADATA).read_bytes())
        return next(info.relative_path for index, info in md.storage_data.items() if index.fqn == fqn)

    def metadata_edits(self, family: str) -> None:
        """Re-pickled ``.metadata`` with one field made hostile (a valid pickle of allowed classes)."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        def edit(fn: Callable[[Any], Any], protocol: int = pickle.HIGHEST_PROTOCOL) -> Callable[[Path], None]:
            def mutate(d: Path) -> None:
                md = pickle.loads((d / METADATA).read_bytes())
                fn(md)
                (d / METADATA).write_bytes(pickle.dumps(md, protocol=protocol))

            return mutate

        def entry(md: Any, fqn: str) -> Any:
            return next(i for i in md.storage_data if i.fqn == fqn)

        def set_info(fqn: str, **changes: Any) -> Callable[[Any], None]:
            def fn(md: Any) -> None:
                index = entry(md, fqn)
                old = md.storage_data[index]
                fields = {"relative_path": old.relative_path, "offset": old.offset, "length": old.length}
                fields.update(changes)
                md.storage_data[index] = _StorageInfo(**fields)

            return fn

        paths = {
            "parent": "../../x.distcp",
            "absolute": "/etc/passwd",
            "url": "s3://another-bucket/x.distcp",
            "file-url": "file:///etc/passwd",
            "missing": "nope.distcp",
            "not-a-string": 7,
        }
        for tag, rel in paths.items():
            culprit = "nope.distcp" if tag == "missing" else METADATA
            self.case(
                family,
                f"metadata-path-{tag}",
                culprit,
                edit(set_info("w", relative_path=rel)),
                in_metadata=tag != "missing",
            )
        size = (self.good / family / self.file_of(family, "big")).stat().st_size
        for tag, changes in {
            "offset-past-end": {"offset": size + 100},
            "offset-2^63": {"offset": 2**63},
            "offset-negative": {"offset": -5},
            "length-2^63": {"length": 2**63},
            "length-negative": {"length": -1},
            "offset-mid-record": {"offset": 3},
        }.items():
            fqn = "big" if "past" in tag else "w"
            in_data = "mid" in tag or "past" in tag  # the metadata is sound; the bytes it points at are not
            self.case(
                family,
                f"metadata-{tag}",
                self.file_of(family, fqn) if in_data else METADATA,
                edit(set_info(fqn, **changes)),
                in_metadata=not in_data,
            )

        def overlap(md: Any) -> None:  # "w" (16x8 f32) pointed at the record of "ids" (10 int64)
            md.storage_data[entry(md, "w")] = md.storage_data[entry(md, "ids")]

        self.case(family, "metadata-overlapping-records", self.file_of(family, "ids"), edit(overlap), in_metadata=False)

        def tensor_md(fqn: str, size: list[int], dtype: Any = torch.float32) -> Callable[[Any], None]:
            def fn(md: Any) -> None:
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=torch.Size(size))
                md.state_dict_metadata[fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=dtype), torch.Size(size), [chunk]
                )
                index = entry(md, fqn)
                info = md.storage_data.pop(index)
                from torch.distributed.checkpoint.metadata import MetadataIndex

                md.storage_data[MetadataIndex(fqn, torch.Size([0] * len(size)), index.index)] = info

            return fn

        self.case(family, "metadata-shape-overflow", METADATA, edit(tensor_md("w", [2**62, 2**62])))
        self.case(family, "metadata-shape-2^63-bytes", METADATA, edit(tensor_md("w", [2**61, 4])))
        self.case(family, "metadata-shape-negative", METADATA, edit(tensor_md("w", [-16, -8])))
        self.case(family, "metadata-shape-zero-by-2^70", METADATA, edit(tensor_md("w", [0, 2**70])))
        self.case(family, "metadata-dtype-string", METADATA, edit(tensor_md("w", [16, 8], "F128")))

        def unknown_dtype(d: Path) -> None:
            data = pickle.dumps(pickle.loads((d / METADATA).read_bytes()), protocol=2)
            assert b"ctorch\nfloat32\n" in data
            (d / METADATA).write_bytes(data.replace(b"ctorch\nfloat32\n", b"ctorch\nfloat99\n"))

        self.case(family, "metadata-dtype-unknown-global", METADATA, unknown_dtype)

        def chunk_outside(md: Any) -> None:
            item = md.state_dict_metadata["w"]
            item.chunks[0] = ChunkStorageMetadata(offsets=torch.Size([8, 0]), sizes=torch.Size([16, 8]))

        self.case(family, "metadata-chunk-outside-tensor", METADATA, edit(chunk_outside))

        def chunks(*spans: tuple[list[int], list[int]]) -> Callable[[Any], None]:
            """``w`` (16x8) split into chunks that overlap while their volumes add up to 128 elements; every
            chunk's storage entry is the record of the whole tensor (sound on its own)."""

            def fn(md: Any) -> None:
                from torch.distributed.checkpoint.metadata import MetadataIndex

                info = md.storage_data.pop(entry(md, "w"))
                md.state_dict_metadata["w"].chunks = [
                    ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in spans
                ]
                for o, _n in spans:
                    md.storage_data[MetadataIndex("w", torch.Size(o))] = info

            return fn

        self.case(family, "metadata-chunks-overlap", METADATA, edit(chunks(([0, 0], [12, 8]), ([4, 0], [4, 8]))))
        self.case(family, "metadata-chunks-duplicate", METADATA, edit(chunks(([0, 0], [8, 8]), ([0, 0], [8, 8]))))
        self.case(
            family,
            "metadata-chunks-overlap-columns",
            METADATA,
            edit(chunks(([0, 0], [16, 4]), ([0, 2], [8, 4]), ([8, 2], [8, 4]))),
        )
        for tag, rel in {"dot": ".", "dot-slash": "./", "dot-segment": f"./{self.file_of(family, 'w')}"}.items():
            self.case(family, f"metadata-path-{tag}", METADATA, edit(set_info("w", relative_path=rel)))

        def no_storage(md: Any) -> None:
            md.storage_data = None

        self.case(family, "metadata-no-storage-map", METADATA, edit(no_storage))

        def storage_list(md: Any) -> None:
            md.storage_data = list(md.storage_data.items())

        self.case(family, "metadata-storage-map-list", METADATA, edit(storage_list))

        def storage_info_tuple(md: Any) -> None:
            index = entry(md, "w")
            md.storage_data[index] = tuple(vars(md.storage_data[index]).values())

        self.case(family, "metadata-storage-entry-tuple", METADATA, edit(storage_info_tuple))

        def missing_entry(md: Any) -> None:
            del md.storage_data[entry(md, "w")]

        self.case(family, "metadata-missing-storage-entry", METADATA, edit(missing_entry))

        def state_dict_list(md: Any) -> None:
            md.state_dict_metadata = list(md.state_dict_metadata.items())

        self.case(family, "metadata-state-dict-list", METADATA, edit(state_dict_list))

        def not_metadata(d: Path) -> None:
            (d / METADATA).write_bytes(pickle.dumps({"state_dict_metadata": {}}))

        self.case(family, "metadata-a-dict", METADATA, not_metadata)
        bomb = b"\x80\x02Nr\xff\xff\xff\x3f."  # LONG_BINPUT 2**30-1: a 16 GiB memo from 9 bytes
        self.case(family, "metadata-memo-bomb", METADATA, lambda d: (d / METADATA).write_bytes(bomb))

        for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):

            def payload(d: Path, p: int = protocol) -> None:
                md = pickle.loads((d / METADATA).read_bytes())
                md.planner_data = self.evil()
                (d / METADATA).write_bytes(pickle.dumps(md, protocol=p))

            self.case(family, f"metadata-payload-p{protocol}", METADATA, payload, payload=True)

        def payload_as_path(d: Path) -> None:
            md = pickle.loads((d / METADATA).read_bytes())
            index = entry(md, "w")
            old = md.storage_data[index]
            md.storage_data[index] = _StorageInfo(self.evil(), old.offset, old.length)  # type: ignore[arg-type]
            (d / METADATA).write_bytes(pickle.dumps(md))

        self.case(family, "metadata-payload-in-storage-entry", METADATA, payload_as_path, payload=True)

    def point_item(self, d: Path, fqn: str, record: bytes, name: str = "evil.distcp") -> None:
        """Point ``fqn``'s storage entry at ``record``, written to a new data file (as an attacker would)."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        (d / name).write_bytes(record)
        md = pickle.loads((d / METADATA).read_bytes())
        index = next(i for i in md.storage_data if i.fqn == fqn)
        md.storage_data[index] = _StorageInfo(name, 0, len(record))
        (d / METADATA).write_bytes(pickle.dumps(md))

    # ------------------------------------------------------------------------------------------ families
    def byte_item_payloads(self, family: str, raw_protocols: tuple[int, ...]) -> None:
        """The non-tensor value ``step`` replaced by payload pickles: torch.save, legacy, and bare pickles."""
        payloads: dict[str, Callable[[], bytes]] = {
            "byte-item-payload": lambda: _torch_save_bytes(self.evil()),
            "byte-item-payload-legacy": lambda: _legacy_bytes(self.evil()),
            # what a "does it look like a pickle?" sniff misses: pickletools cannot parse I0x10, and a
            # TorchScript archive is a zip whose __setstate__ torch.jit.load runs
            "byte-item-payload-text-int": lambda: P.text_int_payload(str(self._marker)),
            "byte-item-payload-torchscript": lambda: P.torchscript_payload(str(self._marker)),
        }
        for protocol in raw_protocols:  # a bare pickle: torch.load(weights_only=False) unpickles it as a legacy file
            payloads[f"byte-item-payload-raw-pickle-p{protocol}"] = lambda p=protocol: pickle.dumps(
                self.evil(), protocol=p
            )
        for tag, make in payloads.items():
            self.case(
                family,
                tag,
                "evil.distcp",
                lambda d, m=make: self.point_item(d, "step", m()),
                in_metadata=False,
                payload=True,
            )
        self.case(  # a value 200,000 levels deep: decoding is iterative, re-encoding it recurses
            family,
            "byte-item-deep-nesting",
            "evil.distcp",
            lambda d: self.point_item(d, "step", _handmade_torch_zip(P.deep_nesting(), b"", with_storage=False)),
            in_metadata=False,
        )
        self.case(  # stored deflated: torch.load would inflate it (to any size its header claims)
            family,
            "byte-item-deflated",
            "evil.distcp",
            lambda d: self.point_item(d, "step", P.deflated_torch_save(7)),
            in_metadata=False,
        )

    def pickle_attacks(self, family: str, bombs: tuple[str, ...]) -> None:
        """``.metadata`` pickles of allow-listed globals only that modify what they did not create, or
        give a fresh instance dunder or slot state, then decode the valid Metadata; and size bombs."""

        def spliced(prefix: bytes) -> Callable[[Path], None]:
            def mutate(d: Path) -> None:
                md = pickle.loads((d / METADATA).read_bytes())
                (d / METADATA).write_bytes(P.splice(prefix, pickle.dumps(md, protocol=2)))

            return mutate

        for name, prefix in P.STATE_ATTACKS.items():
            self.case(family, f"metadata-state-{name}", METADATA, spliced(prefix))
        for name, whole in P.FRESH_ATTACKS.items():
            self.case(family, f"metadata-state-{name}", METADATA, spliced(P.as_prefix(whole)))
        for op in bombs:
            self.case(
                family, f"metadata-bomb-{op}", METADATA, lambda d, o=op: (d / METADATA).write_bytes(P.size_bomb(o))
            )

        def deep(d: Path) -> None:  # 200,000 levels from ~400 KB, built without recursion
            md = pickle.loads((d / METADATA).read_bytes())
            md.storage_meta = "DEEP-PLACEHOLDER"
            (d / METADATA).write_bytes(P.nest_inside(pickle.dumps(md, protocol=2), "DEEP-PLACEHOLDER"))

        self.case(family, "metadata-deep-nesting", METADATA, deep)

    def dcp(self) -> None:
        self.file_mutations("dcp", METADATA, in_metadata=True)
        self.file_mutations("dcp", self.file_of("dcp", "big"), in_metadata=False, cuts=6)
        self.file_mutations("dcp", self.file_of("dcp", "w"), in_metadata=False, cuts=3)
        big_file = self.file_of("dcp", "big")  # cut inside the zip trailer that a ranged read never fetches
        self.case(
            "dcp",
            "big-record-truncated-in-trailer",
            big_file,
            lambda d: (d / big_file).write_bytes((d / big_file).read_bytes()[:-100]),
            in_metadata=False,
        )
        self.metadata_edits("dcp")

        self.case(
            "dcp",
            "record-payload-small",
            "evil.distcp",
            lambda d: self.point_item(d, "w", _torch_save_bytes(self.evil())),
            in_metadata=False,
            payload=True,
        )
        self.case(
            "dcp",
            "record-payload-big",
            "evil.distcp",
            lambda d: self.point_item(d, "big", _torch_save_bytes([torch.zeros(BIG), self.evil()])),
            in_metadata=False,
            payload=True,
        )
        self.case(
            "dcp",
            "record-payload-legacy",
            "evil.distcp",
            lambda d: self.point_item(d, "w", _legacy_bytes(self.evil())),
            in_metadata=False,
            payload=True,
        )
        self.byte_item_payloads("dcp", raw_protocols=(0, 1))
        self.pickle_attacks("dcp", P.BOMBS[:-1])  # LONG_BINPUT: metadata-memo-bomb
        record = _data_pkl(_FakeTensor(_FakeStorage(torch.FloatStorage, 128), 0, (16, 8), (8, 1)))
        for name, prefix in P.RECORD_STATE_ATTACKS.items():
            blob = _handmade_torch_zip(P.splice(prefix, record), b"\0" * 512)
            self.case(
                "dcp",
                f"record-state-{name}",
                "evil.distcp",
                lambda d, b=blob: self.point_item(d, "w", b),
                in_metadata=False,
            )

        f32 = torch.FloatStorage
        for tag, tensor, storage in (
            ("record-shape-overflow", _FakeTensor(_FakeStorage(f32, 1), 0, (2**40, 2**40), (0, 0)), b"\0" * 4),
            ("record-storage-2^62", _FakeTensor(_FakeStorage(f32, 2**62), 0, (16, 8), (8, 1)), b"\0" * 512),
            ("record-stride-past-storage", _FakeTensor(_FakeStorage(f32, 128), 0, (16, 8), (1000, 1)), b"\0" * 512),
            ("record-negative-offset", _FakeTensor(_FakeStorage(f32, 128), -4, (16, 8), (8, 1)), b"\0" * 512),
            ("record-shape-zero-by-2^70", _FakeTensor(_FakeStorage(f32, 0), 0, (0, 2**70), (1, 1)), b""),
        ):
            blob = _handmade_torch_zip(_data_pkl(tensor), storage)
            self.case("dcp", tag, "evil.distcp", lambda d, b=blob: self.point_item(d, "w", b), in_metadata=False)
        unknown = _data_pkl(_FakeTensor(_FakeStorage(f32, 128), 0, (16, 8), (8, 1))).replace(
            b"ctorch\nFloatStorage\n", b"ctorch\nFloat99Storage\n"
        )
        self.case(
            "dcp",
            "record-dtype-unknown",
            "evil.distcp",
            lambda d: self.point_item(d, "w", _handmade_torch_zip(unknown, b"\0" * 512)),
            in_metadata=False,
        )
        self.case(
            "dcp",
            "record-not-a-tensor",
            "evil.distcp",
            lambda d: self.point_item(d, "w", _torch_save_bytes({"a": 1})),
            in_metadata=False,
        )
        self.record_zip_layouts()

    def record_zip_layouts(self) -> None:
        """DCP records (zips inside ``.distcp`` files) with layouts to refuse.

        Non-tensor items (``step``) are decoded by ``torch.load``, which reads the central directory: every
        layout attack and a CRC mismatch are refused there. Tensor records are decoded by our own parser,
        which walks the local headers only (the central directory and CRCs are checked with
        ``verify=True``: tests/formats/dcp_native): the attacks on what it reads, and deflated entries
        (such a record goes to ``torch.load``) are refused by default.
        """

        def attacks(record: bytes) -> dict[str, bytes]:
            with zipfile.ZipFile(io.BytesIO(record)) as zf:
                plain = [(i.filename, zf.read(i)) for i in zf.infolist()]
            pkl = next(n for n, _ in plain if n.endswith("data.pkl"))
            data = next((n for n, _ in plain if "/data/" in n), pkl)
            short = data.rsplit("/", 2)[-2] + "/" + data.rsplit("/", 1)[-1]  # "data/0" or "x/data.pkl"
            return {
                "duplicate-entry": zm.duplicate_entry(record, short, bytes(range(256)) * 2),
                "local-name-differs": zm.patch_local(record, short, name_bytes=data[:-1].encode() + b"X"),
                "local-sizes-differ": zm.patch_local(record, short, flags=0x800, csize=4, usize=4),
                "central-sizes-differ": zm.edit_entry(record, short, csize=1),
                "entries-overlap": zm.edit_entry(record, "byteorder", offset=zm.local_offset(record, short)),
                "zip64-extra-short": zm.edit_entry(record, short, usize=0xFFFFFFFF, extra=b"\x01\x00\x08\x00"),
                # inflating to 1 GiB while declaring the real size; then declaring 256 MiB from 256 KB
                "deflate-bomb": zm.deflate_bomb_zip(plain, data, inflated=1 << 30),
                "deflate-ratio": zm.deflate_bomb_zip(plain, data, inflated=256 << 20, declared=256 << 20),
                "data-pkl-deflate-bomb": zm.deflate_bomb_zip(plain, pkl, inflated=1 << 30),
            }

        tensor_refused = (
            "local-name-differs",
            "local-sizes-differ",
            "deflate-bomb",
            "deflate-ratio",
            "data-pkl-deflate-bomb",
        )
        for tag, blob in attacks(_torch_save_bytes(tensors()["w"])).items():
            if tag in tensor_refused:
                self.case(
                    "dcp",
                    f"record-{tag}",
                    "evil.distcp",
                    lambda d, b=blob: self.point_item(d, "w", b),
                    in_metadata=False,
                )
        step = _torch_save_bytes(torch.arange(128, dtype=torch.int32))  # a value holding a tensor: has data/0
        flipped = bytearray(step)
        head = zm.local_offset(step, "data/0")
        flipped[head + 30 + sum(struct.unpack_from("<HH", step, head + 26)) + 100] ^= 0x01
        items = {**attacks(step), "crc-mismatch": bytes(flipped)}
        for tag, blob in items.items():
            self.case(
                "dcp",
                f"byte-item-{tag}",
                "evil.distcp",
                lambda d, b=blob: self.point_item(d, "step", b),
                in_metadata=False,
            )

    def dcp_st(self) -> None:
        self.file_mutations("dcp_st", METADATA, in_metadata=True, cuts=3)
        self.file_mutations("dcp_st", DISTCP, in_metadata=True, cuts=4)
        self.metadata_edits("dcp_st")

        self.byte_item_payloads("dcp_st", raw_protocols=(0,))
        self.pickle_attacks("dcp_st", ("BYTEARRAY8", "BINUNICODE8", "LONG4"))
        for tag, blob in _hostile_safetensors_blobs(_rng("dcp_st-blobs", self.seed)).items():
            self.case("dcp_st", f"blob-{tag}", "evil.distcp", lambda d, b=blob: self.point_item(d, "w", b))

    def st(self) -> None:
        self.file_mutations("st", ST_FILE, in_metadata=True, cuts=6)
        for tag, blob in _hostile_safetensors_blobs(_rng("st-blobs", self.seed)).items():
            self.case("st", f"header-{tag}", ST_FILE, lambda d, b=blob: (d / ST_FILE).write_bytes(b))
        self.case("st", "directory-of-garbage", ST_FILE, lambda d: (d / ST_FILE).write_bytes(b"\x00" * 64), open_as=".")

        def sharding_info(text: str) -> Callable[[Path], None]:
            def mutate(d: Path) -> None:
                from safetensors.torch import save_file

                save_file(tensors(), str(d / ST_FILE), metadata={"DCP_SHARDING_INFO": text})

            return mutate

        for tag, text in {
            "not-json": "{",
            "huge-offsets": json.dumps({"w": {"saved_offsets": [2**62, 0]}}),
            "wrong-rank": json.dumps({"w": {"saved_offsets": [0]}}),
            "negative": json.dumps({"w": {"saved_offsets": [-1, 0]}}),
            "strings": json.dumps({"w": {"saved_offsets": ["0", "0"]}}),
            "a-list": json.dumps([1]),
        }.items():
            self.case("st", f"sharding-info-{tag}", ST_FILE, sharding_info(text))

    def hf(self) -> None:
        self.file_mutations("hf", INDEX_FILE, in_metadata=True, cuts=3)
        self.file_mutations("hf", SHARDS[0], in_metadata=True, cuts=3)

        def index_doc(doc: Any) -> Callable[[Path], None]:
            def mutate(d: Path) -> None:
                (d / INDEX_FILE).write_text(json.dumps(doc))

            return mutate

        good_map = {"w": SHARDS[0], "ids": SHARDS[0], "big": SHARDS[1]}
        for tag, target in {
            "parent": "../../x.safetensors",
            "parent-inside": f"sub/../../{SHARDS[1]}",
            "absolute": "/etc/passwd",
            "url": "s3://another-bucket/model.safetensors",
            "file-url": "file:///etc/passwd",
            "windows-drive": "C:\\x.safetensors",
            "home": "~/x.safetensors",
            "empty-name": "",
            "number": 5,
            "dot": ".",
            "dot-slash": "./",
            "dot-segment": f"./{SHARDS[1]}",
            "trailing-slash": "sub/",
        }.items():
            self.case("hf", f"index-path-{tag}", INDEX_FILE, index_doc({"weight_map": {**good_map, "big": target}}))
        self.case(
            "hf",
            "index-names-missing-file",
            "model-00003-of-00002.safetensors",
            index_doc({"weight_map": {**good_map, "big": "model-00003-of-00002.safetensors"}}),
        )
        self.case("hf", "index-names-wrong-shard", SHARDS[0], index_doc({"weight_map": {**good_map, "big": SHARDS[0]}}))
        self.case(
            "hf",
            "index-names-missing-file-dir",
            "model-00003-of-00002.safetensors",
            index_doc({"weight_map": {**good_map, "big": "model-00003-of-00002.safetensors"}}),
            open_as=".",
        )
        self.case("hf", "index-empty-weight-map", INDEX_FILE, index_doc({"weight_map": {}}))
        self.case("hf", "index-weight-map-list", INDEX_FILE, index_doc({"weight_map": [["w", SHARDS[0]]]}))
        self.case("hf", "index-a-list", INDEX_FILE, index_doc([1, 2]))
        self.case("hf", "index-deep-nesting", INDEX_FILE, lambda d: (d / INDEX_FILE).write_text("[" * 100_000))
        self.case(
            "hf", "index-not-utf8", INDEX_FILE, lambda d: (d / INDEX_FILE).write_bytes(b'{"weight_map": "\xff\xfe"}')
        )
        for tag, blob in list(_hostile_safetensors_blobs(_rng("hf-blobs", self.seed)).items())[:6]:
            self.case("hf", f"shard-{tag}", SHARDS[1], lambda d, b=blob: (d / SHARDS[1]).write_bytes(b))

    def zip(self) -> None:
        self.file_mutations("zip", PT_FILE, in_metadata=True, cuts=8)
        self.case(
            "zip",
            "payload",
            PT_FILE,
            lambda d: torch.save({**torch_state_dict(), "evil": self.evil()}, d / PT_FILE),
            payload=True,
        )
        self.case("zip", "payload-only", PT_FILE, lambda d: torch.save(self.evil(), d / PT_FILE), payload=True)

        def patch_eocd(**fields: int) -> Callable[[Path], None]:
            def mutate(d: Path) -> None:
                data = bytearray((d / PT_FILE).read_bytes())
                at = data.rfind(b"PK\x05\x06")
                offsets = {"entries": (10, "<H"), "cd_size": (12, "<I"), "cd_offset": (16, "<I")}
                for key, value in fields.items():
                    pos, fmt = offsets[key]
                    struct.pack_into(fmt, data, at + pos, value)
                loc = data.rfind(b"PK\x06\x07")
                if loc >= 0:  # torch always writes zip64 records: drop the locator so the plain record rules
                    data[loc : loc + 4] = b"XXXX"
                (d / PT_FILE).write_bytes(bytes(data))

            return mutate

        self.case("zip", "eocd-cd-offset-past-end", PT_FILE, patch_eocd(cd_offset=0xFFFFFFF0))
        self.case("zip", "eocd-cd-size-huge", PT_FILE, patch_eocd(cd_size=0xFFFFFFF0))
        self.case("zip", "eocd-entries-huge", PT_FILE, patch_eocd(entries=0xFFFF))

        def patch_zip64(offset: int) -> Callable[[Path], None]:
            def mutate(d: Path) -> None:
                data = bytearray((d / PT_FILE).read_bytes())
                loc = data.rfind(b"PK\x06\x07")
                struct.pack_into("<Q", data, loc + 8, offset)
                (d / PT_FILE).write_bytes(bytes(data))

            return mutate

        self.case("zip", "zip64-locator-2^63", PT_FILE, patch_zip64(2**63))
        self.case("zip", "zip64-locator-zero", PT_FILE, patch_zip64(0))

        def patch_zip64_record(field_at: int, value: int) -> Callable[[Path], None]:
            def mutate(d: Path) -> None:
                data = bytearray((d / PT_FILE).read_bytes())
                rec = data.rfind(b"PK\x06\x06")
                struct.pack_into("<Q", data, rec + field_at, value)
                (d / PT_FILE).write_bytes(bytes(data))

            return mutate

        self.case("zip", "zip64-entries-2^63", PT_FILE, patch_zip64_record(32, 2**63))
        self.case("zip", "zip64-cd-size-2^63", PT_FILE, patch_zip64_record(40, 2**63))
        self.case("zip", "zip64-cd-offset-2^64-1", PT_FILE, patch_zip64_record(48, 2**64 - 1))

        def patch_central(field_at: int, fmt: str, value: int, which: int = 0) -> Callable[[Path], None]:
            def mutate(d: Path) -> None:
                data = bytearray((d / PT_FILE).read_bytes())
                pos = -1
                for _ in range(which + 1):
                    pos = data.find(b"PK\x01\x02", pos + 1)
                struct.pack_into(fmt, data, pos + field_at, value)
                (d / PT_FILE).write_bytes(bytes(data))

            return mutate

        self.case("zip", "central-name-length-huge", PT_FILE, patch_central(28, "<H", 0xFFFF))
        self.case("zip", "central-extra-length-huge", PT_FILE, patch_central(30, "<H", 0xFFFF))
        self.case("zip", "central-header-offset-past-end", PT_FILE, patch_central(42, "<I", 0x7FFFFFF0, which=3))
        self.case("zip", "central-method-bzip2", PT_FILE, patch_central(10, "<H", 12))
        self.case("zip", "central-zip64-without-extra", PT_FILE, patch_central(42, "<I", 0xFFFFFFFF, which=3))

        def garble_data_pkl(d: Path) -> None:
            data = bytearray((d / PT_FILE).read_bytes())
            at = data.find(b"data.pkl") + len(b"data.pkl")
            at = data.find(b"\x80\x02", at)
            data[at + 2 : at + 40] = _random_bytes(_rng("garble", self.seed), 38)
            (d / PT_FILE).write_bytes(bytes(data))

        self.case("zip", "data-pkl-garbled", PT_FILE, garble_data_pkl)
        f32 = torch.FloatStorage

        def handmade(obj: Any, storage: bytes, **kw: Any) -> Callable[[Path], None]:
            def mutate(d: Path) -> None:
                (d / PT_FILE).write_bytes(_handmade_torch_zip(_data_pkl(obj), storage, **kw))

            return mutate

        def handmade_raw(data_pkl: bytes) -> Callable[[Path], None]:
            def mutate(d: Path) -> None:
                (d / PT_FILE).write_bytes(_handmade_torch_zip(data_pkl, b"\0" * 512))

            return mutate

        good = _FakeTensor(_FakeStorage(f32, 128), 0, (16, 8), (8, 1))
        for tag, obj, storage, kw in (
            ("shape-overflow", {"w": _FakeTensor(_FakeStorage(f32, 1), 0, (2**40, 2**40), (0, 0))}, b"\0" * 4, {}),
            ("storage-2^62", {"w": _FakeTensor(_FakeStorage(f32, 2**62), 0, (16, 8), (8, 1))}, b"\0" * 512, {}),
            ("stride-past-storage", {"w": _FakeTensor(_FakeStorage(f32, 128), 0, (16, 8), (1000, 1))}, b"\0" * 512, {}),
            ("shape-zero-by-2^70", {"w": _FakeTensor(_FakeStorage(f32, 0), 0, (0, 2**70), (1, 1))}, b"", {}),
            ("storage-record-missing", {"w": good}, b"", {"with_storage": False}),
            ("storage-record-compressed", {"w": good}, b"\0" * 512, {"compress": True}),
            ("storage-record-short", {"w": good}, b"\0" * 100, {}),
            ("not-a-dict", [good], b"\0" * 512, {}),
        ):
            self.case("zip", tag, PT_FILE, handmade(obj, storage, **kw), keys=("w",))
        self.case("zip", "data-pkl-memo-bomb", PT_FILE, handmade_raw(b"\x80\x02Nr\xff\xff\xff\x3f."), keys=("w",))
        for op in ("BYTEARRAY8", "BINBYTES8", "BINBYTES", "FRAME"):
            self.case("zip", f"data-pkl-bomb-{op}", PT_FILE, handmade_raw(P.size_bomb(op)), keys=("w",))
        for name, prefix in P.RECORD_STATE_ATTACKS.items():
            spliced = P.splice(prefix, _data_pkl({"w": good}))
            self.case("zip", f"data-pkl-state-{name}", PT_FILE, handmade_raw(spliced), keys=("w",))
        deep = P.nest_inside(_data_pkl({"w": good, "extra": "DEEP-PLACEHOLDER"}), "DEEP-PLACEHOLDER")
        self.case("zip", "data-pkl-deep-nesting", PT_FILE, handmade_raw(deep), keys=("w",))
        unknown = _data_pkl({"w": good}).replace(b"ctorch\nFloatStorage\n", b"ctorch\nFloat99Storage\n")
        self.case(
            "zip",
            "dtype-unknown",
            PT_FILE,
            lambda d: (d / PT_FILE).write_bytes(_handmade_torch_zip(unknown, b"\0" * 512)),
            keys=("w",),
        )
        self.zip_layouts()

    def zip_layouts(self) -> None:
        """Zip layouts to refuse: duplicate names, local headers that disagree with the central directory,
        overlapping entries, zip64 fields that are missing, deflate bombs. (A flipped tensor byte is found by
        ``verify=True`` and ``verify --deep``: tests/formats/torch_save.)"""

        def mutated(fn: Callable[[bytes], bytes]) -> Callable[[Path], None]:
            return lambda d: (d / PT_FILE).write_bytes(fn((d / PT_FILE).read_bytes()))

        zip64_short = struct.pack("<HHQ", 1, 16, 512)  # says 16 bytes, holds 8
        for tag, fn in {
            "duplicate-entry-name": lambda b: zm.duplicate_entry(b, "data/0", bytes(range(256)) * 2),
            "local-name-differs": lambda b: zm.patch_local(b, "data/0", name_bytes=b"model/data/X"),
            "central-offset-other-entry": lambda b: zm.edit_entry(b, "data/2", offset=zm.local_offset(b, "data/0")),
            "local-method-deflated": lambda b: zm.patch_local(b, "data/0", method=8),
            "local-sizes-differ": lambda b: zm.patch_local(b, "data/0", flags=0x800, csize=4, usize=4),
            "local-flags-differ": lambda b: zm.patch_local(b, "data/2", flags=0x800),
            "local-sizes-differ-with-descriptor": lambda b: zm.patch_local(b, "data/1", csize=7, usize=7),
            "local-extra-undeclared": lambda b: zm.shift_local_data(b, "data/0"),  # data read 4 bytes late
            "central-sizes-differ": lambda b: zm.edit_entry(b, "data/2", csize=16),
            "central-encrypted": lambda b: zm.patch_local(
                zm.edit_entry(b, "data/0", flags=0x809), "data/0", flags=0x809
            ),
            "entries-overlap": lambda b: zm.overlapping_entry(b, "data/2", "data/1"),
            "zip64-extra-empty": lambda b: zm.edit_entry(b, "data/0", usize=0xFFFFFFFF, extra=b"\x01\x00\x00\x00"),
            "zip64-extra-short": lambda b: zm.edit_entry(
                b, "data/0", usize=0xFFFFFFFF, csize=0xFFFFFFFF, extra=zip64_short
            ),
            "zip64-extra-overruns": lambda b: zm.edit_entry(b, "data/0", offset=0xFFFFFFFF, extra=b"\x01\x00\xff\xff"),
        }.items():
            self.case("zip", tag, PT_FILE, mutated(fn))

        def entries_of(b: bytes) -> list[tuple[str, bytes]]:
            with zipfile.ZipFile(io.BytesIO(b)) as zf:
                return [(i.filename, zf.read(i)) for i in zf.infolist()]

        # data.pkl inflating to 1 GiB while it declares its real size; then a declared 400 MiB from 400 KB
        self.case("zip", "data-pkl-deflate-bomb", PT_FILE, mutated(
            lambda b: zm.deflate_bomb_zip(entries_of(b), "model/data.pkl", inflated=1 << 30)
        ))  # fmt: skip
        self.case("zip", "data-pkl-deflate-ratio", PT_FILE, mutated(
            lambda b: zm.deflate_bomb_zip(entries_of(b), "model/data.pkl", inflated=400 << 20, declared=400 << 20)
        ))  # fmt: skip

    def legacy(self) -> None:
        self.file_mutations("legacy", PT_FILE, in_metadata=True, cuts=4)
        self.case("legacy", "plain", PT_FILE, lambda d: None)  # valid, but a format we refuse (with our error)
        self.case(
            "legacy",
            "payload",
            PT_FILE,
            lambda d: (d / PT_FILE).write_bytes(_legacy_bytes({**torch_state_dict(), "evil": self.evil()})),
            payload=True,
        )
        self.case(
            "legacy",
            "payload-only",
            PT_FILE,
            lambda d: (d / PT_FILE).write_bytes(_legacy_bytes(self.evil())),
            payload=True,
        )


def _legacy_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()


def _hostile_safetensors_blobs(rng: random.Random) -> dict[str, bytes]:
    """One safetensors blob per header attack (each otherwise well formed)."""
    data16 = b"\0" * 16
    h = _st_header
    blobs = {
        "length-2^63": struct.pack("<Q", 2**63) + b"{}",
        "length-2^64-1": struct.pack("<Q", 2**64 - 1) + b"{}",
        "length-past-end": struct.pack("<Q", 1000) + b'{"a": 1}',
        "length-over-100MiB": struct.pack("<Q", 100 * 1024 * 1024 + 1) + b"{" + b" " * 64,
        "not-json": _safetensors_blob(None, data16, raw_header=b"{not json at all"),
        "not-utf8": _safetensors_blob(None, data16, raw_header=b'{"\xff\xfe": 1}'),
        "json-list": _safetensors_blob([1, 2, 3], data16),
        "deep-nesting": _safetensors_blob(None, data16, raw_header=b"{" + b'"a":[' * 50_000),
        "duplicate-key": _safetensors_blob(
            None,
            data16,
            raw_header=b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
            b'"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}',
        ),
        "dtype-unknown": _safetensors_blob({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, data16),
        "dtype-number": _safetensors_blob({"a": {"dtype": 32, "shape": [4], "data_offsets": [0, 16]}}, data16),
        "shape-overflow": _safetensors_blob(
            {"a": {"dtype": "F32", "shape": [2**40, 2**40, 2**40], "data_offsets": [0, 16]}}, data16
        ),
        "shape-negative": _safetensors_blob({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, data16),
        "shape-zero-by-2^70": _safetensors_blob({"a": {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}}),
        "shape-float": _safetensors_blob({"a": {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}}, data16),
        "shape-bool": _safetensors_blob({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, data16),
        "shape-huge-int": _safetensors_blob(
            None,
            data16,
            raw_header=b'{"a": {"dtype": "F32", "shape": [1' + b"0" * 5000 + b'], "data_offsets": [0, 16]}}',
        ),
        "offsets-reversed": _safetensors_blob({"a": {"dtype": "F32", "shape": [0], "data_offsets": [16, 0]}}, data16),
        "offsets-past-end": _safetensors_blob({"a": {"dtype": "F32", "shape": [4], "data_offsets": [64, 80]}}, data16),
        "offsets-2^63": _safetensors_blob(
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [2**63, 2**63 + 16]}}, data16
        ),
        "offsets-three": _safetensors_blob({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16, 32]}}, data16),
        "offsets-overlap": _safetensors_blob(
            {**h(), "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, data16
        ),
        "entry-a-list": _safetensors_blob({"a": [1, 2]}, data16),
        "metadata-not-strings": _safetensors_blob({**h(), "__metadata__": {"x": 1}}, data16),
        "random-header": _safetensors_blob(None, data16, raw_header=b"{" + _random_bytes(rng, 200)),
    }
    return blobs


def build_corpus(root: Path, seed: int = SEED) -> list[Case]:
    """Write every case under ``root`` (an empty directory); returns them in a stable order."""
    from .corpus_files import add_file_cases

    builder = _Builder(root, seed)
    for family in FAMILIES:
        getattr(builder, family)()
    add_file_cases(builder)  # special files, sparse giants, symlinks out, broadcast views
    return builder.cases


def describe_corpus(cases: list[Case]) -> dict[str, int]:
    """Cases per family (for reports)."""
    counts: dict[str, int] = {}
    for case in cases:
        counts[case.family] = counts.get(case.family, 0) + 1
    return counts


if __name__ == "__main__":  # python -m tests.hostile.corpus DIR: write the corpus for a look
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "hostile-corpus")
    os.makedirs(out, exist_ok=False)
    made = build_corpus(out)
    print(f"{len(made)} cases in {out}: {describe_corpus(made)}")
