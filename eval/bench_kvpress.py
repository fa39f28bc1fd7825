"""NVIDIA kvpress's presses on protocol (a) of `policy_protocols`, with bench_policies.py's tokens and table.

kvpress 0.5.5 pins transformers < 5.3, so it runs in a venv of its own, outside the repository; this script
imports nothing from hf_kvgov (whose caches need transformers 5.24) and loads the same float32 weights from
the converted copies `hf_kvgov.models.load_model` keeps (``~/.cache/hf_kvgov/models/<name>/converted-float32``)::

    python3 -m venv /work/kvpress-venv && /work/kvpress-venv/bin/pip install torch==2.13.0 kvpress==0.5.5
    /work/kvpress-venv/bin/python eval/bench_kvpress.py --json eval/out/bench_kvpress.json   # ~15 min, 2 cores

Each press compresses the 1,536-token prefill (``compression_ratio=0.8``: 307 of 1,536 kept, as
``int(k_len * 0.2)`` in kvpress) inside ``with press(model):``, exactly as kvpress applies it; the next 512
tokens are scored in 32-token forwards with explicit positions outside the context, appended to kvpress's
`DynamicCache` without further compression. kvpress compresses every layer of Gemma3ForCausalLM, sliding
ones included (it skips sliding layers only for Gemma3ForConditionalGeneration, and warns that
Gemma3ForCausalLM is not among its tested models): a sliding layer then keeps tokens from anywhere in the
prompt, and its mask, built on the compacted cache, lets it read keys further away than its 512-token
window ever did. ``--skip-sliding`` applies kvpress's Gemma-3 rule to the text model instead: only the
AdaKV presses run so (they mask, so every layer keeps its length); a press that removes slots leaves the
full layers shorter than the sliding ones, and transformers builds one mask for all of them, which fails
("size of tensor a (339) must match ... (1568)"). A config-aware ``DynamicCache(config=...)`` does not fix
it: the mask is then misaligned and perplexity drops below the full cache's (1.4-1.9 against 22.3), i.e.
future tokens leak, so that variant is not offered. ObservedAttentionPress
needs the attention weights, so that press runs with eager attention; the others with SDPA. AdaKV presses
mask evicted keys instead of freeing them (kvpress's own note), so they hold the memory of the full prefill.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import kvpress
import torch
from policy_protocols import (
    KEEP,
    PREFILL,
    SCORED,
    add_passage_arguments,
    continue_ppl,
    markdown,
    passage_ids,
    passages,
    plain_forward,
    row,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

MODELS = Path.home() / ".cache" / "hf_kvgov" / "models"
RATIO = 1 - KEEP  # kvpress's compression_ratio is the share removed


def presses() -> dict[str, Callable[[], Any]]:
    """Name -> a fresh press removing ``RATIO`` of the prefill."""
    return {
        "KnormPress": lambda: kvpress.KnormPress(compression_ratio=RATIO),
        "SnapKVPress": lambda: kvpress.SnapKVPress(compression_ratio=RATIO),
        "TOVAPress": lambda: kvpress.TOVAPress(compression_ratio=RATIO),
        "ExpectedAttentionPress": lambda: kvpress.ExpectedAttentionPress(compression_ratio=RATIO),
        "StreamingLLMPress": lambda: kvpress.StreamingLLMPress(compression_ratio=RATIO),
        "ObservedAttentionPress": lambda: kvpress.ObservedAttentionPress(compression_ratio=RATIO),
        "PyramidKVPress": lambda: kvpress.PyramidKVPress(compression_ratio=RATIO),
        "KeyDiffPress": lambda: kvpress.KeyDiffPress(compression_ratio=RATIO),
        "AdaKV(SnapKV)": lambda: kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=RATIO)),
        "AdaKV(ExpectedAttention)": lambda: kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=RATIO)),
        "CriticalAdaKV(ExpectedAttention)": lambda: kvpress.CriticalAdaKVPress(
            kvpress.ExpectedAttentionPress(compression_ratio=RATIO)
        ),
        # Since kvpress 0.5: lag-relative statistics, and context reconstruction (KVzip, which scores in extra
        # forwards after the prefill and masks what it drops; kvpress refuses it on Gemma-3).
        "LagKVPress": lambda: kvpress.LagKVPress(compression_ratio=RATIO),
        "KVzipPress": lambda: kvpress.KVzipPress(compression_ratio=RATIO),
    }


def load(name: str, attention: str) -> tuple[Any, Any]:
    directory = MODELS / name / "converted-float32"
    if not directory.is_dir():
        raise SystemExit(f"{directory} is missing: run `kvgov fetch {name}` (or load_model) in the project venv first.")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation=attention)
    return model.eval(), AutoTokenizer.from_pretrained(directory)


def run_model(
    name: str, selected: list[str], skip_sliding: bool, texts: dict[str, tuple[Path, int]]
) -> list[dict[str, Any]]:
    models = {attention: load(name, attention) for attention in ("sdpa", "eager")}
    tokenizer = models["sdpa"][1]
    rows: list[dict[str, Any]] = []
    for passage, where in texts.items():
        ids = passage_ids(tokenizer, where, PREFILL + SCORED + 1)
        model = models["sdpa"][0]
        full = continue_ppl(*[plain_forward(model, "past_key_values")] * 2, DynamicCache(), ids)
        for press_name in selected:
            model = models["eager" if press_name == "ObservedAttentionPress" else "sdpa"][0]
            forward = plain_forward(model, "past_key_values")
            try:
                prefill = _pressed(model, presses()[press_name](), forward, skip_sliding)
                ppl = continue_ppl(prefill, forward, DynamicCache(), ids)
            except Exception as error:
                print(f"  {name} {passage} {press_name}: failed: {type(error).__name__}: {error}", flush=True)
                continue
            label = f"{press_name} (full layers only)" if skip_sliding else press_name
            rows.append(row(name, passage, label, int(KEEP * PREFILL), ppl, full) | {"protocol": "continue"})
            print(f"  {name} {passage} {label}: {ppl:.3f} (full {full:.3f})", flush=True)
    return rows


def _pressed(model: Any, press: Any, forward: Any, skip_sliding: bool) -> Any:
    """``forward`` run inside ``with press(model):``, so the press compresses that (prefill) forward.

    With ``skip_sliding`` the press's hook goes on full-attention layers only, the rule kvpress applies to
    Gemma3ForConditionalGeneration (``BasePress.__call__``), here applied to Gemma3ForCausalLM.
    """

    def prefill(ids: torch.Tensor, cache: Any, positions: torch.Tensor) -> torch.Tensor:
        if not skip_sliding:
            with press(model):
                return forward(ids, cache, positions)
        press.post_init_from_model(model)
        hooks = []
        for layer in model.model.layers:
            if not getattr(layer.self_attn, "is_sliding", False):
                layer.self_attn.rotary_emb = model.model.rotary_emb
                hooks.append(layer.self_attn.register_forward_hook(press.forward_hook, with_kwargs=True))
        try:
            return forward(ids, cache, positions)
        finally:
            for hook in hooks:
                hook.remove()

    return prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--presses", nargs="+", default=list(presses()), choices=list(presses()))
    parser.add_argument(
        "--skip-sliding", action="store_true", help="compress full-attention layers only (kvpress's Gemma-3 rule)"
    )
    parser.add_argument("--json", type=Path, help="write every row here")
    add_passage_arguments(parser)
    args = parser.parse_args()
    texts = passages(args)
    rows = [r for name in args.models for r in run_model(name, args.presses, args.skip_sliding, texts)]
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    versions = f"kvpress {metadata.version('kvpress')}, transformers {metadata.version('transformers')}"
    title = f"(a) compress, then continue, kvpress presses ({versions}, {machine})"
    print("\n" + markdown(rows, title))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
