"""`kvgov fetch`: download and verify the embedded models once, so later runs and tests need no network."""

from __future__ import annotations

import argparse

from hf_kvgov import models


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("fetch", help="fetch and verify embedded models (default: all)")
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"embedded models: {', '.join(models.EMBEDDED_MODELS)}"
    )
    parser.add_argument(
        "--convert",
        action="store_true",
        help="also load each model once to keep a converted copy (faster later loads)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in args.names or list(models.EMBEDDED_MODELS):
        print(models.fetch(name))
        if args.convert:
            models.load_model(name)
    return 0
