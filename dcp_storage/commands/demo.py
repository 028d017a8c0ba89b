"""``dcp-storage demo``: the main job on an embedded S3 server (see :mod:`dcp_storage_testing.demo`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dcp_storage.commands import _common


def add_parser(sub: Any) -> None:
    p = _common.add_command(
        sub,
        "demo",
        help="save a 2-rank FSDP2 model to an embedded S3 server, load it at 3 ranks, verify",
        description="The library's main job end to end, on this machine only: start an embedded S3 server (moto, "
        "127.0.0.1, a free port), save a transformer-like model sharded with FSDP2 over --save-ranks gloo processes "
        "(CPU) to s3:// with FsspecWriter, load it back with FsspecReader into a model sharded over --load-ranks "
        "processes (resharding), and compare every tensor bit for bit. Prints, per phase, bytes, seconds, GB/s and "
        "storage requests. Exits 1 if a loaded tensor differs. Needs no network and no credentials.",
        examples=["dcp-storage demo", "dcp-storage demo --save-ranks 4 --load-ranks 2 --layers 8 --dim 1024 --json"],
    )
    p.add_argument("--save-ranks", type=int, default=2, metavar="N", help="processes that save (default: 2)")
    p.add_argument("--load-ranks", type=int, default=3, metavar="N", help="processes that load (default: 3)")
    p.add_argument("--layers", type=int, default=4, metavar="N", help="transformer blocks of the model (default: 4)")
    p.add_argument("--dim", type=int, default=512, metavar="N", help="model width (default: 512)")
    p.add_argument("--json", action="store_true", help="print the per-rank figures as JSON")
    _common.add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dcp_storage_testing.demo import DemoConfig, format_report, run_demo  # imports torch: only when it runs

    cfg = DemoConfig(save_ranks=args.save_ranks, load_ranks=args.load_ranks, layers=args.layers, dim=args.dim)
    result = run_demo(cfg)
    if args.json:
        out = dict(result, config=cfg.__dict__)
        print(json.dumps(out, indent=2, default=str))
    else:
        print(format_report(result))
    ok = not any(r["mismatched"] for r in result["load"])
    if not ok:
        print("dcp-storage demo: error: loaded tensors differ from the saved ones", file=sys.stderr)
    return 0 if ok else 1
