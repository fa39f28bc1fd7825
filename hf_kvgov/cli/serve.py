"""`kvgov serve`: an OpenAI-compatible HTTP server on the embedded (or any) model, its requests served continuously
from one governed KV pool.

It is transformers' own server with its continuous batching run by hf_kvgov's engine, so clients get the standard
API while the KV memory is governed. `HELP`, the `--help` text, says what the engine adds and gives examples.
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
from typing import Any

from hf_kvgov import models
from hf_kvgov.cli.refusal import refuse

HELP = """\
`kvgov serve`: an OpenAI-compatible HTTP server on the embedded (or any) model, its requests served continuously
from one governed KV pool.

It is transformers' own server (`transformers serve --continuous-batching`: /v1/completions, /v1/chat/completions,
/v1/responses, streaming, cancel on disconnect) with its continuous batching run by hf_kvgov's engine: admission by
KV bytes, prefix sharing, preemption instead of out-of-memory, int8 codes with --codec, H2O eviction with --h2o
(each request keeps a share of its prompt, or a number of tokens, in blocks, so more requests fit). Needs the
serving extras: ``pip install hf-kvgov[serve]``.

Examples::

    kvgov serve                                          # SmolLM2 on http://127.0.0.1:8000/v1
    kvgov serve --kv-budget 2GiB --codec int8 --port 8080
    kvgov serve --redis redis://127.0.0.1:6379/0       # servers on one Redis share the prefixes they computed
    kvgov serve --kv-budget 1GiB --swap-dir /mnt/ssd    # a full pool swaps requests to the SSD, not recomputes
    kvgov serve --kv-budget 20GiB --preallocate         # reserve the whole cap at start (full precision)
    kvgov serve --kv-budget 256MiB --codec int8 --h2o 0.2   # each request keeps 20% of its prompt: lossy
    kvgov serve --kv-budget 256MiB --h2o 512            # at most 512 tokens a request: chats shorter keep all
    python -c "import openai; print(openai.OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-')
      .completions.create(model='smollm2', prompt='Hello', max_tokens=16).choices[0].text)"
"""

SERVE_PACKAGES = ("fastapi", "uvicorn", "openai")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def check_listenable(host: str, port: int) -> None:
    """Refuse an address the server could not listen on (a port out of range or taken, a host that does not
    resolve), by binding it once, as the server will (with SO_REUSEADDR)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port takes 0 to 65535 (0: any free port); got {port}.")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise ValueError(
            f"--host {host!r} does not resolve ({err.strerror}); give an address such as 127.0.0.1."
        ) from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            raise ValueError(
                f"Cannot listen on {host}:{port} ({err.strerror}); give another --port or --host, or stop what "
                "listens there."
            ) from None


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `ServingEngine` arguments the options give; a ValueError names a wrong option."""
    from hf_kvgov.planner.units import parse_memory

    built: dict[str, Any] = {
        "max_bytes": None if args.kv_budget is None else parse_memory(args.kv_budget, "KV byte cap"),
        "block_size": args.block_size,
        "prefix_sharing": not args.no_prefix_sharing,
        "max_batched_tokens": args.max_batched_tokens,
        "codec": args.codec,
    }
    if args.preallocate:
        if args.kv_budget is None or args.codec is not None:
            need = "--kv-budget (the cap it reserves)" if args.kv_budget is None else "no --codec (full precision)"
            raise ValueError(f"--preallocate needs {need}.")
        built["preallocate"] = True
    if args.h2o is not None:
        from hf_kvgov.engine.parts import HeavyHitter
        from hf_kvgov.policies.budget import BUDGET_TEXT_FORMS, read_budget

        budget = read_budget(args.h2o)
        if budget is None:
            raise ValueError(f"--h2o takes what each request keeps: {BUDGET_TEXT_FORMS}; got {args.h2o!r}.")
        built["policy"] = HeavyHitter(budget)
    if args.swap_dir is not None:
        from hf_kvgov.engine.parts import Disk

        built["spill"] = Disk(path=args.swap_dir)  # refuses a path that is not a directory, here
    if args.redis is not None:
        if args.no_prefix_sharing:
            raise ValueError("--redis shares prefixes between servers, so it cannot go with --no-prefix-sharing.")
        if not args.redis.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis takes a redis://, rediss:// or unix:// URL; got {args.redis!r}.")
        built["redis_url"] = args.redis
    return built


def _run(args: argparse.Namespace) -> int:
    command = "kvgov serve"
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        needs = f"the server needs {', '.join(missing)}; `pip install hf-kvgov[serve]` installs them."
        return refuse(command, needs, status=1)
    try:
        engine_kwargs = engine_args(args)
        from hf_kvgov.engine.parts import codec_config
        from hf_kvgov.serving.server import check_model_before_loading, run_server, server_model_id

        codec_config(args.codec)  # an unknown codec is refused here, not in the model's process
        for flag, value in (("--block-size", args.block_size), ("--max-batched-tokens", args.max_batched_tokens)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1; got {value}.")
        if args.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"--log-level takes one of {', '.join(LOG_LEVELS)}; got {args.log_level!r}.")
        check_listenable(args.host, args.port)  # a taken port, likewise, not after the model loaded
        server_model_id(args.model)  # a missing file, likewise
        check_model_before_loading(args.model)  # and a model the engine cannot serve (its config, its layers)
    except ValueError as err:
        return refuse(command, err)
    try:
        run_server(args.model, args.host, args.port, args.log_level, **engine_kwargs)
    except RuntimeError as err:  # transformers relays a refusal from the model's process as "ValueError: ..."
        reason = str(err)
        if not reason.startswith("ValueError: "):
            raise
        return refuse(command, reason.removeprefix("ValueError: "))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible server whose requests share one governed KV pool",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="embedded name, .gguf path, directory or hub id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--kv-budget", help="the KV byte cap, e.g. 2GiB (default: the pool grows as needed)")
    parser.add_argument("--codec", help="seal full blocks into codes: int8, int4, fp8 (default: full precision)")
    parser.add_argument(
        "--preallocate",
        action="store_true",
        help="reserve the whole --kv-budget at start (full precision only): the pool never grows while serving",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block [%(default)s]")
    parser.add_argument("--max-batched-tokens", type=int, default=512, help="tokens one step computes at most")
    parser.add_argument("--no-prefix-sharing", action="store_true", help="do not share prompts' blocks")
    parser.add_argument(
        "--h2o",
        metavar="BUDGET",
        help="H2O eviction: each request keeps BUDGET in blocks, a share of its prompt (0.2) or a number of tokens "
        "(512: short chats keep every token) (lossy; default: keep every token)",
    )
    parser.add_argument(
        "--swap-dir",
        metavar="DIR",
        help="swap preempted requests' KV to a file in DIR and back, instead of computing them again",
    )
    parser.add_argument(
        "--redis", metavar="URL", help="share published prefixes with other servers through Redis (redis://host:port/0)"
    )
    parser.add_argument(
        "--log-level", default="info", help=f"the server's log level: {', '.join(LOG_LEVELS)} [%(default)s]"
    )
    parser.set_defaults(func=_run, loads_model=True)
