"""The ``fp4moe`` command: one module per subcommand (``add`` declares its options, ``run`` runs it), the
shared engine options declared once (``options``)."""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path

from fp4moe import __version__
from fp4moe.cli import bench, convert, demo, env, eval, generate, inspect, quantize, serve
from fp4moe.cli.options import EXIT_ERROR

# subcommands in --help order
COMMANDS = {
    "quantize": quantize,
    "inspect": inspect,
    "convert": convert,
    "generate": generate,
    "serve": serve,
    "bench": bench,
    "demo": demo,
    "eval": eval,
    "env": env,
}



def _resume_hint(args) -> str:
    """Where an interrupted ``quantize`` search kept its measured table: how to resume from it."""
    dst = getattr(args, "dst", None)
    if args.command != "quantize" or dst is None:
        return ""
    from fp4moe.quantize.search_pass import saved_table_path

    saved = saved_table_path(Path(dst))
    return f" but the measured table, {saved}: add --sensitivity {saved} to resume" if saved.exists() else ""

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4moe", description="NVFP4 for fused-expert MoE models (qwen3_5_moe)."
    )
    parser.add_argument("--version", action="version", version=f"fp4moe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from fp4moe.errors import USER_ERRORS

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except USER_ERRORS as e:
        print(f"fp4moe {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:
        if e.errno == errno.ENOSPC:
            print(f"fp4moe {args.command}: error: {e.strerror or e}; nothing was written", file=sys.stderr)
            return EXIT_ERROR
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):  # a folder that is read-only or not ours
            where = f": {e.filename}" if e.filename else ""
            print(f"fp4moe {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
            return EXIT_ERROR
        raise
    except KeyboardInterrupt:
        print(f"fp4moe {args.command}: interrupted; nothing was written{_resume_hint(args)}", file=sys.stderr)
        return 130
