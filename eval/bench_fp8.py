"""fp8 with centred keys: perplexity with the cache in the loop, and bytes against the symmetric fp8 before it.

The same text, tokens and lockstep scoring as `bench_int2.py` (2,048 tokens of Pride and Prejudice fed 16 at a
time against a lossless PagedCache). fp8 keys are centred per channel (a one-byte e4m3 zero point beside each
scale, see `hf_kvgov.codecs.fp8`); values stay symmetric. Each row also gives the sealed bytes per token over
those of the symmetric fp8 this format replaced (keys' scale only) at the same block size, and over the
symmetric fp8 at 16-token blocks: the codec's own `bytes_per_token` against the replaced format's closed form
per KV head and token (``D`` = head_dim, ``B`` = block size, fp16 stats):

    symmetric:  2D + 2D/B + 2        centred keys (today's codec):  2D + 3D/B + 2

    python eval/bench_fp8.py --models smollm2 gemma3-270m --json eval/results/fp8_e4m3_zero.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench_int2 import TOKENS, run_model

from hf_kvgov.bench.timing import machine_description
from hf_kvgov.codecs.registry import get_codec
from hf_kvgov.models import load_model

SETTINGS: dict[str, dict[str, Any]] = {
    "fp8 e4m3 b16": {"bits": 8, "fmt": "fp8"},
    "fp8 e5m2 b16": {"bits": 8, "fmt": "fp8_e5m2"},
    "fp8 e4m3 b32": {"bits": 8, "fmt": "fp8", "block_size": 32},
    "fp8 e4m3 b128": {"bits": 8, "fmt": "fp8", "block_size": 128},
    "int8 b16": {"bits": 8},
}


def sealed_bytes(head_dim: int, block: int, centred: bool) -> float:
    """fp8 sealed bytes per KV head and token: the codec's, or the symmetric format's (module docstring)."""
    if centred:
        return get_codec("fp8_e4m3").bytes_per_token(1, head_dim, block)
    return 2 * head_dim + 2 * head_dim / block + 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        config = load_model(name)[0].config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        for row in run_model(name, SETTINGS):
            block = row["options"].get("block_size", 16)
            if row["options"].get("fmt", "int") != "int":
                centred = sealed_bytes(head_dim, block, centred=True)
                row["vs_symmetric_same_block"] = centred / sealed_bytes(head_dim, block, centred=False)
                row["vs_symmetric_b16"] = centred / sealed_bytes(head_dim, 16, centred=False)
                print(
                    f"  {name} {row['setting']}: sealed bytes {row['vs_symmetric_same_block']:.3f}x symmetric fp8 at "
                    f"the same block, {row['vs_symmetric_b16']:.3f}x symmetric fp8 at 16-token blocks",
                    flush=True,
                )
            rows.append(row)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine_description(), "tokens": TOKENS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
