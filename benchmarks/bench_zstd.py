#!/usr/bin/env python
"""zstd benchmark: compression ratio, write/read GB/s, and bytes a resharding load reads.

Usage::

    .venv/bin/python benchmarks/bench_zstd.py [--quick] [--repeats N] [--json out.json]

Needs the ``dcp-storage-zstd`` plugin (``pip install -e plugins/dcp-storage-zstd``) and ``transformers``.

Checkpoints (seeded, built in memory):

* ``random-bits bf16``: uniformly random bytes viewed as bf16: nothing to compress (the worst case).
* ``llama-init bf16`` / ``llama-init fp32``: a ``transformers`` ``LlamaForCausalLM`` built from a config
  with ``torch.manual_seed`` (normal(0, 0.02) weights, norms of ones), as shipped before training.
* ``llama-adam fp32``: the fp32 model after 3 Adam steps on random tokens, with its optimizer state
  (``exp_avg``, ``exp_avg_sq``): what a training checkpoint holds. Adam's second moments have low-entropy
  exponent bytes.

Writers, all through ``dcp_storage.FsspecWriter(dir, extensions=...)`` so only the encoding differs:
``none``; ``torch ZStandard`` (torch's non-seekable ``_extension.ZStandard``, level 3, one frame per item);
``seekable L3`` (``ZstdSeekable()``: level 3, 1 MiB frames); ``seekable L1`` (level 1).

Single process, local directory (page cache), best of ``--repeats``: write GB/s = tensor bytes /
``dcp.save`` seconds; read GB/s = tensor bytes / ``dcp.load`` seconds (``FsspecReader``, plain tensors: every
item whole); ratio = uncompressed stored bytes / stored bytes. Every load is checked bit-exactly.

Resharding: a bf16 transformer (``dcp_storage_testing.models``) saved by 2 FSDP2 ranks, loaded by 3 gloo
ranks as ``Shard(0)`` DTensors: bytes read by all ranks (``reader.counters``), the slowest rank's seconds.
For ``seekable`` the same files are also loaded with every item read whole (``small_item_bytes`` huge), which
is what a reader without ranged frame reads (torch's) must do.

Results: a table on stdout and JSON (default ``benchmarks/results/zstd.json``; ``--quick``:
``zstd_quick.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

WHOLE = 1 << 40


def _llama(seed: int, quick: bool, dtype: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    size = (
        {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2, "vocab_size": 8000}
        if quick
        else {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "vocab_size": 16000}
    )
    config = LlamaConfig(num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False, **size)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


def build_cases(quick: bool) -> dict[str, dict[str, Any]]:
    import torch

    cases: dict[str, dict[str, Any]] = {}
    bf16 = {k: v.detach().clone() for k, v in _llama(1, quick, torch.bfloat16).state_dict().items()}
    cases["llama-init bf16"] = bf16
    g = torch.Generator().manual_seed(2)
    cases["random-bits bf16"] = {
        k: torch.randint(0, 256, (v.numel() * 2,), generator=g, dtype=torch.uint8).view(torch.bfloat16).view(v.shape)
        for k, v in bf16.items()
    }
    model = _llama(1, quick, torch.float32)
    cases["llama-init fp32"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        tokens = torch.randint(0, model.config.vocab_size, (2, 64), generator=g)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optim.step()
        optim.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    adam = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for p, st in optim.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            adam[f"optim.{names[id(p)]}.{key}"] = st[key].clone()
    cases["llama-adam fp32"] = adam
    return cases


def writers() -> dict[str, Any]:
    from dcp_storage_zstd import ZstdSeekable
    from torch.distributed.checkpoint._extension import ZStandard

    return {
        "none": lambda: None,
        "torch ZStandard": lambda: [ZStandard()],
        "seekable L3": lambda: [ZstdSeekable()],
        "seekable L1": lambda: [ZstdSeekable(level=1)],
    }


def _nbytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def _stored(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))


def measure_case(name: str, state: dict[str, Any], root: str, repeats: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecReader, FsspecWriter

    rows = []
    nbytes = _nbytes(state)
    baseline = None
    for wname, make in writers().items():
        path = os.path.join(root, wname.replace(" ", "_"))
        write_s = read_s = float("inf")
        for _ in range(repeats):
            shutil.rmtree(path, ignore_errors=True)
            t = time.perf_counter()
            dcp.save(state, storage_writer=FsspecWriter(path, extensions=make()))
            write_s = min(write_s, time.perf_counter() - t)
        stored = _stored(path)
        baseline = baseline or stored
        for _ in range(repeats):
            dest = {k: torch.empty_like(v) for k, v in state.items()}
            t = time.perf_counter()
            dcp.load(dest, storage_reader=FsspecReader(path))
            read_s = min(read_s, time.perf_counter() - t)
        bad = [
            k
            for k, v in state.items()
            if not torch.equal(dest[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8))
        ]
        if bad:
            raise SystemExit(f"{name} / {wname}: mismatched after load: {bad[:5]}")
        rows.append(
            {
                "case": name,
                "writer": wname,
                "tensor_bytes": nbytes,
                "stored_bytes": stored,
                "ratio": baseline / stored,
                "write_s": write_s,
                "write_gbps": nbytes / write_s / 1e9,
                "read_s": read_s,
                "read_gbps": nbytes / read_s / 1e9,
            }
        )
        print(
            f"{name:18s} {wname:16s} ratio {baseline / stored:5.3f}  write {nbytes / write_s / 1e9:6.3f} GB/s  "
            f"read {nbytes / read_s / 1e9:6.3f} GB/s",
            flush=True,
        )
        shutil.rmtree(path, ignore_errors=True)
    return rows


def measure_reshard(root: str, quick: bool) -> list[dict[str, Any]]:
    from dcp_storage_zstd.testing import run_all

    from dcp_storage_testing.distributed import run_ranks

    shape = (
        {"vocab": 8192, "dim": 512, "hidden": 2048, "layers": 2}
        if quick
        else {"vocab": 32000, "dim": 1024, "hidden": 4096, "layers": 4}
    )
    kinds = {
        "none": (None, None),
        "torch ZStandard": ("torch-zstd", None),
        "seekable L3": ("zstd-seekable", None),
        "seekable L3 256K frames": ("zstd-seekable", {"frame_bytes": 256 * 1024}),
    }
    paths = {k: os.path.join(root, f"reshard_{k.replace(' ', '_')}") for k in kinds}
    saves = [("save_fsdp2", (paths[k], 5, shape, "bfloat16", kind, opts)) for k, (kind, opts) in kinds.items()]
    run_ranks(run_all, 2, saves, timeout=1800)
    loads = [(k, None) for k in kinds] + [("seekable L3", WHOLE)]
    calls = [("load_resharded", (paths[k], 5, shape, "bfloat16", limit)) for k, limit in loads]
    results = run_ranks(run_all, 3, calls, timeout=1800)
    rows = []
    for i, (k, limit) in enumerate(loads):
        reports = [per_rank[i] for per_rank in results]
        if any(r["mismatched"] for r in reports):
            raise SystemExit(f"reshard {k}: mismatched {[r['mismatched'] for r in reports]}")
        stored = _stored(paths[k])
        read = sum(r["bytes_read"] for r in reports)
        needed = sum(r["needed"] for r in reports)
        seconds = max(r["seconds"] for r in reports)
        label = k + (" (every item whole)" if limit else "")
        rows.append(
            {
                "writer": label,
                "stored_bytes": stored,
                "bytes_read": read,
                "read_over_stored": read / stored,
                "needed_bytes": needed,
                "seconds": seconds,
                "gbps_needed": needed / seconds / 1e9,
                "requests": sum(r["requests"] for r in reports),
            }
        )
        print(
            f"reshard 2->3 {label:34s} stored {stored / 1e6:8.1f} MB  read {read / 1e6:8.1f} MB "
            f"({read / stored:4.2f}x stored)  {seconds:6.2f} s  {needed / seconds / 1e9:5.2f} GB/s",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small checkpoints (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-reshard", action="store_true")
    parser.add_argument("--skip-cases", action="store_true", help="only the resharding measurement")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    import zstandard

    torch.set_num_threads(1)
    out = args.json or os.path.join(HERE, "results", "zstd_quick.json" if args.quick else "zstd.json")
    root = tempfile.mkdtemp(prefix="dcp-storage-bench-zstd-")
    try:
        rows: list[dict[str, Any]] = []
        for name, state in {} if args.skip_cases else build_cases(args.quick).items():
            rows += measure_case(name, state, root, args.repeats)
        reshard = [] if args.skip_reshard else measure_reshard(root, args.quick)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),  # other work on the machine skews the seconds, not the bytes
            "torch": torch.__version__,
            "zstandard": zstandard.__version__,
        },
        "quick": args.quick,
        "repeats": args.repeats,
        "cases": rows,
        "reshard": reshard,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
