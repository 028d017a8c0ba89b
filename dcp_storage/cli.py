"""The ``dcp-storage`` command line. Subcommands are added by ``dcp_storage.commands`` modules.

Nothing here or in a subcommand's ``add_parser`` imports torch or the library's heavy modules: ``--help``
and ``--version`` answer in a fraction of a second, and each subcommand imports what it needs when it runs.

Everything a command prints goes through :class:`dcp_storage.text.EscapingStream`: names from a
checkpoint are escaped where messages are formed, and whatever slipped through is escaped here, so no
control character from a checkpoint reaches the terminal.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from dcp_storage._version import __version__
from dcp_storage.commands import convert, demo, inspect, plugins, steps
from dcp_storage.commands._common import HelpFormatter, UsageError, as_typed
from dcp_storage.runtime import terminate_as_interrupt
from dcp_storage.text import escaped_stdio, printable

__all__ = ["build_parser", "main"]

_EXAMPLES = """\
examples:
  dcp-storage inspect s3://bucket/step-1000 -o client_kwargs.endpoint_url=http://127.0.0.1:9000
  dcp-storage verify ./hf --deep
  dcp-storage convert ./ckpt ./hf --to safetensors --max-shard-size 5GB
  dcp-storage merge out/pytorch_model_fsdp_0 out/merged
  dcp-storage ls ./run
  dcp-storage gc ./run --keep-last 3 --dry-run
  dcp-storage plugins
  dcp-storage demo

'dcp-storage COMMAND --help' describes each command, with examples."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dcp-storage",
        description="Storage tools for torch.distributed.checkpoint: inspect, verify, convert and merge checkpoints "
        "(DCP, safetensors, torch.save) on any fsspec URL, list plugins, run the demo.",
        epilog=_EXAMPLES,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    convert.add_parsers(sub)  # convert and merge
    inspect.add_parsers(sub)  # inspect and verify
    for command in (plugins, demo):
        command.add_parser(sub)
    steps.add_parsers(sub)  # ls and gc: the steps of a checkpoint manager's root
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    with escaped_stdio():  # the last line of defence: see the module docstring
        return _run(argv)


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        with terminate_as_interrupt():  # a `kill` cleans up as Ctrl-C does (dcp_storage.runtime)
            return int(args.func(args) or 0)
    except KeyboardInterrupt as exc:
        how = str(exc) if str(exc) in ("SIGTERM", "SIGINT") else "SIGINT"
        print(f"dcp-storage {args.command}: interrupted ({how})", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dcp-storage inspect ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except UsageError as exc:
        print(f"dcp-storage {args.command}: error: {printable(as_typed(str(exc), args))}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one clear line unless --debug
        if args.debug:
            traceback.print_exc()  # through the escaping stderr, unlike the interpreter's own report
            return 1
        message = printable(as_typed(str(exc), args))
        print(f"dcp-storage {args.command}: error: {type(exc).__name__}: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
