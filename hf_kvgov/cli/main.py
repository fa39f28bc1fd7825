"""The `kvgov` command: one subcommand per module, registered by name (no branching on names)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from hf_kvgov import models
from hf_kvgov.cli.interrupted import EXIT_INTERRUPTED
from hf_kvgov.cli.outputs import check_outputs
from hf_kvgov.cli.refusal import refuse

# Subcommand modules; each defines add_parser(subparsers) which sets `func` on its parser.
SUBCOMMANDS = (
    "hf_kvgov.cli.demo",
    "hf_kvgov.cli.bench",
    "hf_kvgov.cli.check_quant",
    "hf_kvgov.cli.fetch",
    "hf_kvgov.cli.plan",
    "hf_kvgov.cli.eval",
    "hf_kvgov.cli.serve",
)


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, whose refusal of a command line is one line naming the (sub)command, and exit status 2.

    Its subcommands' parsers are of this class too (argparse builds them with the parent's class); each records
    itself as the namespace's ``command_parser``, so options one of them does not know are refused in its name.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_defaults(command_parser=self)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists what it takes)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="kvgov",
        description="Govern the KV cache of HuggingFace transformers models: compare caches, plan capacity.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; Ctrl-C anywhere is one line on stderr and exit status 130, never a traceback.

    `kvgov eval` and `kvgov bench` also keep the rows finished before Ctrl-C (see `hf_kvgov.cli.interrupted`).
    """
    command = "kvgov"
    try:
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        command = f"kvgov {args.command}"
        if getattr(args, "loads_model", False):  # an impossible name is refused before anything loads
            models.check_name(args.model)
        check_outputs(args)  # and a path no result could be written to, before anything is measured
        return int(args.func(args))
    except ValueError as err:  # a mistake the command did not answer itself (the model check's, an unknown name)
        return refuse(command, err)
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
