"""``dcp-storage merge CHECKPOINT_DIR OUTPUT``: accelerate's ``merge-weights`` for FSDP sharded checkpoints."""

from __future__ import annotations

import argparse
from typing import Any

from dcp_storage.commands import _common
from dcp_storage.text import printable as shown


def add_parser(sub: Any) -> None:
    p = _common.add_command(
        sub,
        "merge",
        help="merge an FSDP sharded DCP checkpoint (accelerate's pytorch_model_fsdp_0) into model.safetensors",
        description="Merge the DCP checkpoint CHECKPOINT_DIR (e.g. <output_dir>/pytorch_model_fsdp_0 from accelerate) "
        "into OUTPUT/model.safetensors (or pytorch_model.bin), sharded with an index above --max-shard-size. "
        "A single top-level key ({'model': ...}) is unwrapped, as accelerate's merge_fsdp_weights does. The output "
        "is verified before --remove-checkpoint-dir deletes anything.",
        examples=[
            "dcp-storage merge out/pytorch_model_fsdp_0 out/merged",
            "dcp-storage merge out/pytorch_model_fsdp_0 out/merged --no-safe-serialization --max-shard-size 2GB",
        ],
        drop_non_tensors="--drop-non-tensors",
        overwrite="--overwrite",
        create_bucket="--create-bucket",
    )
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="the DCP checkpoint directory (holds .metadata)")
    p.add_argument("output", metavar="OUTPUT", help="output directory (created if missing)")
    p.add_argument(
        "--safe-serialization",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write safetensors (default) or, with --no-safe-serialization, pytorch_model.bin",
    )
    p.add_argument(
        "--unsafe-serialization", dest="safe_serialization", action="store_false", help=argparse.SUPPRESS
    )  # accelerate's spelling
    p.add_argument(
        "--remove-checkpoint-dir",
        action="store_true",
        help="delete CHECKPOINT_DIR once the output is written and verified (refused up front when "
        "CHECKPOINT_DIR is a symbolic link: nothing is deleted through a link)",
    )
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="largest output file (default 5GB)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing merged output (without it, an existing one is refused, as convert does)",
    )
    p.add_argument("--drop-non-tensors", action="store_true", help="leave non-tensor values out of safetensors output")
    _common.add_create_bucket(p)
    _common.add_storage_options(p, sides=True)
    _common.add_json(p)
    _common.add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Here, not at module level: the library imports torch, and --help must not (see dcp_storage.cli).
    from dcp_storage.conversion import merge_fsdp_weights
    from dcp_storage.formats.safetensors.write_plan import parse_size

    try:
        parse_size(args.max_shard_size)
    except (ValueError, TypeError) as exc:
        raise _common.UsageError(str(exc)) from None
    with _common.progress_bar("merge") as bar:
        result = merge_fsdp_weights(
            args.checkpoint_dir,
            args.output,
            safe_serialization=args.safe_serialization,
            remove_checkpoint_dir=args.remove_checkpoint_dir,
            max_shard_size=args.max_shard_size,
            storage_options=_common.storage_options(args, "src"),
            output_storage_options=_common.storage_options(args, "dst"),
            overwrite=args.overwrite,
            drop_non_tensors=args.drop_non_tensors,
            create_bucket=args.create_bucket,
            progress=bar.update,
            on_start=lambda _source, total: _common.set_total(bar, total),
        )
    if args.json:
        _common.emit_json(dict(result.as_dict(), removed_checkpoint_dir=args.remove_checkpoint_dir))
        return 0
    size = sum(f.size for f in result.files)
    print(
        f"merged {shown(result.src)} ({result.tensors} tensors, {_common.human_bytes(result.tensor_bytes)}) -> "
        f"{shown(result.output)} "
        f"({len(result.files)} files, {_common.human_bytes(size)}, verified) in {result.seconds:.1f} s"
    )
    if args.remove_checkpoint_dir:
        print(f"removed {shown(result.src)}")
    return 0
