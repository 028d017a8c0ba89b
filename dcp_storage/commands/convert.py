"""``dcp-storage convert SRC DST``: any checkpoint format/store to any other, one tensor in memory at a time.

``dcp-storage merge CHECKPOINT_DIR OUTPUT``: accelerate's ``merge-weights`` for FSDP sharded checkpoints.
"""

from __future__ import annotations

import argparse
from typing import Any

from dcp_storage.commands import _common
from dcp_storage.text import printable as shown


def add_convert_parser(sub: Any) -> None:
    p = _common.add_command(
        sub,
        "convert",
        help="convert a checkpoint between formats (dcp, safetensors, torch.save, plugins'), on any store",
        description="Convert SRC (a DCP directory, safetensors file/directory/index, or torch.save file; local or "
        "any fsspec URL) into DST, streaming tensor by tensor: memory stays near the largest tensor. The output "
        "format comes from --to or DST's suffix (.safetensors, .pt, .bin; a directory needs --to).",
        examples=[
            "dcp-storage convert ./step-1000 ./hf --to safetensors --max-shard-size 5GB --dtype bf16",
            "dcp-storage convert ./model.safetensors ./model.pt",
            "dcp-storage convert s3://bucket/step-1000 ./local-ckpt --to dcp -o client_kwargs.endpoint_url=http://127.0.0.1:9000",
        ],
        format="--from FORMAT",
        src_format="--from FORMAT",
        overwrite="--overwrite",
        drop_non_tensors="--drop-non-tensors",
        create_bucket="--create-bucket",
    )
    p.add_argument("src", metavar="SRC", help="input checkpoint URL (format detected)")
    p.add_argument("dst", metavar="DST", help="output URL: a directory, or a .safetensors / .pt / .bin file")
    p.add_argument(
        "--to",
        metavar="FORMAT",
        help="output format: dcp, safetensors, torch, or a plugin format that can be written "
        "(`dcp-storage plugins list --kind formats`); default: from DST's suffix",
    )
    p.add_argument("--from", dest="src_format", metavar="FORMAT", help="input format name (default: detected)")
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="largest output file, e.g. 5GB or 500MiB (safetensors/torch directories: default 5GB; dcp: one file)",
    )
    p.add_argument(
        "--dtype", metavar="DTYPE", help="cast float16/bfloat16/float32/float64 tensors: bf16, fp16, fp32, fp64"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument(
        "--drop-non-tensors",
        action="store_true",
        help="leave non-tensor values out of outputs that hold only tensors (safetensors, sharded torch)",
    )
    p.add_argument(
        "--trust",
        action="store_true",
        help="decode SRC as torch.load(weights_only=False) would (objects such as argparse.Namespace); "
        "it can run code from SRC: only for checkpoints you trust",
    )
    _common.add_create_bucket(p)
    _common.add_storage_options(p, sides=True)
    _common.add_json(p)
    _common.add_common(p)
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    # Here, not at module level: the library imports torch, and --help must not (see dcp_storage.cli).
    from dcp_storage.conversion import convert
    from dcp_storage.conversion.plan import convert_targets, parse_dtype, resolve_target, target_names
    from dcp_storage.formats.safetensors.write_plan import parse_size

    if args.to is not None and args.to.strip().lower() not in convert_targets():  # as argparse's choices would
        shown_names = ", ".join(repr(n) for n in target_names())
        raise _common.UsageError(f"argument --to: invalid choice: {shown(args.to)!r} (choose from {shown_names})")
    try:
        resolve_target(args.to, args.dst)
        parse_dtype(args.dtype)
        if args.max_shard_size is not None:
            parse_size(args.max_shard_size)
    except (ValueError, TypeError) as exc:
        raise _common.UsageError(str(exc)) from None
    with _common.progress_bar("convert") as bar:
        result = convert(
            args.src,
            args.dst,
            to=args.to,
            src_format=args.src_format,
            max_shard_size=args.max_shard_size,
            dtype=args.dtype,
            storage_options=_common.storage_options(args),
            src_storage_options=_common.storage_options(args, "src"),
            dst_storage_options=_common.storage_options(args, "dst"),
            overwrite=args.overwrite,
            drop_non_tensors=args.drop_non_tensors,
            create_bucket=args.create_bucket,
            progress=bar.update,
            on_start=lambda _source, total: _common.set_total(bar, total),
            trust=args.trust,
        )
    if args.json:
        _common.emit_json(result.as_dict())
        return 0
    size = sum(f.size for f in result.files)
    print(
        f"converted {shown(result.src)} ({shown(result.src_format)}, {result.tensors} tensors, "
        f"{_common.human_bytes(result.tensor_bytes)}{f', {result.values} values' if result.values else ''}) -> "
        f"{shown(result.output)} ({result.to}, "
        f"{len(result.files)} files, {_common.human_bytes(size)}) in {result.seconds:.1f} s"
    )
    if result.dropped_values:
        dropped = ", ".join(shown(k) for k in result.dropped_values)  # keys from the checkpoint
        print(f"left out {len(result.dropped_values)} non-tensor values: {dropped}")
    return 0


def add_merge_parser(sub: Any) -> None:
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
    p.set_defaults(func=run_merge)


def run_merge(args: argparse.Namespace) -> int:
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


def add_parsers(sub: Any) -> None:
    """``convert`` and ``merge``: the two commands that write a checkpoint from another."""
    add_convert_parser(sub)
    add_merge_parser(sub)
