"""``dcp-storage demo``: the main job on an embedded S3 server (see :mod:`dcp_storage.demo`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="save a 2-rank FSDP2 model to an embedded S3 server, load it at 3 ranks, verify")
    p.add_argument("--save-ranks", type=int, default=2)
    p.add_argument("--load-ranks", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--json", action="store_true", help="print the per-rank figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..demo import DemoConfig, format_report, run_demo

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
