"""The `kvgov` command: one subcommand per module, registered by name (no branching on names)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand modules; each defines add_parser(subparsers) which sets `func` on its parser.
SUBCOMMANDS = (
    "hf_kvgov.cli.demo",
    "hf_kvgov.cli.bench",
    "hf_kvgov.cli.check_quant",
    "hf_kvgov.cli.fetch",
    "hf_kvgov.cli.plan",
    "hf_kvgov.cli.eval",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgov",
        description="Govern the KV cache of HuggingFace transformers models: compare caches, plan capacity.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
