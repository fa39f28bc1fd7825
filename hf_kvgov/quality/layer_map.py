"""A format per layer for a perplexity budget: the fewest bytes whose measured loss stays within it.

    layer_map = recommend_layer_formats(model, tokenizer, text, budget_pct=0.5, formats=("int8", "int4", "int2"))
    layer_map.save("map.json")                      # QuantizedCache.from_config(model, "map.json") loads it

On several passages (texts, or ``passages=N``) a map holds only if it holds on each, because a map chosen on one can
miss its budget on an unseen one (eval/RESULTS.md). A per-layer scan prices each layer in each format, and layers
are upgraded by marginal cost (`choose_layer_formats`); since single-layer losses only add up roughly, the map is
then measured on every whole passage and the target rescaled (at most `MAX_ROUNDS`). The fewest bytes within budget
win (uniform int8 competing), else the smallest loss, marked, so a map that misses is never handed over silently.
Bytes are the codecs' (the model dtype's for full-precision layers), so the choice ranks what the cache will hold.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_kvgov.codecs.registry import get_codec
from hf_kvgov.engine.quant_config import FULL_PRECISION, QuantConfig
from hf_kvgov.hf.compat import decoder_config, kv_heads_and_head_dim
from hf_kvgov.quality.builtin_text import BUILTIN_TEXT
from hf_kvgov.quality.check import FORMAT_OPTIONS, CheckOptions, ConfigRunner, tokenize
from hf_kvgov.quality.grouped_attention import grouped_sdpa_on_cpu
from hf_kvgov.quality.lockstep import CacheScore

MAX_ROUNDS = 6  # maps measured on the whole text before giving up
CALIBRATION_MARGIN = 0.8  # after a miss, aim this far inside the budget the prediction's shortfall allows
FIRST_TARGET = 0.5  # the share of the budget the summed single-layer losses may use in the first round


def choose_layer_formats(
    increases: Mapping[str, Sequence[float]], costs: Mapping[str, float], target_pct: float
) -> tuple[str, ...]:
    """The format of every layer: the cheapest whose summed single-layer increases are within ``target_pct``.

    Args:
        increases: format -> per-layer perplexity increase (percent) with only that layer in that format.
        costs: format -> bytes per token of one layer in it; "full" (no loss) must be among them.
        target_pct: the summed increases to stay within.

    Greedy by marginal cost: from the cheapest format everywhere, repeatedly upgrade the layer whose next
    dearer format saves the most predicted loss per byte (ties: the lower layer). Negative increases count as 0.
    """
    if FULL_PRECISION not in costs:
        raise ValueError("costs must include 'full', the format every layer can fall back to.")
    layers = len(next(iter(increases.values())))
    if any(len(values) != layers for values in increases.values()):
        raise ValueError("every format's scan must cover the same layers.")
    ladder = sorted((*increases, FULL_PRECISION), key=lambda f: costs[f])  # cheapest first

    def loss(fmt: str, layer: int) -> float:
        return 0.0 if fmt == FULL_PRECISION else max(0.0, float(increases[fmt][layer]))

    chosen = [0] * layers  # each layer's index on the ladder
    while sum(loss(ladder[chosen[i]], i) for i in range(layers)) > target_pct:
        best: tuple[float, int, int] | None = None  # (-saving per byte, layer, next rung)
        for layer in range(layers):
            here = chosen[layer]
            for rung in range(here + 1, len(ladder)):
                saving = loss(ladder[here], layer) - loss(ladder[rung], layer)
                if saving > 0:
                    extra = max(costs[ladder[rung]] - costs[ladder[here]], 1e-9)
                    candidate = (-saving / extra, layer, rung)
                    best = candidate if best is None or candidate < best else best
                    break  # the next rung that saves anything: further rungs only cost more
        if best is None:
            break
        chosen[best[1]] = best[2]
    return tuple(ladder[rung] for rung in chosen)


@dataclass(frozen=True)
class LayerMap:
    """A recommended per-layer map, what it was chosen from and what it measured."""

    config: QuantConfig
    formats: tuple[str, ...]  # per layer
    budget_pct: float
    measured: CacheScore  # the map on its worst passage
    baseline: CacheScore  # uniform int8 on its worst passage, for comparison
    bytes_per_token: float  # all layers, keys and values, as the codecs and the model's dtype count
    baseline_bytes_per_token: float
    scan: dict[str, tuple[float, ...]]  # format -> per-layer increase
    rounds: int
    passage_pcts: tuple[float, ...] = ()  # the map's increase on each passage it was chosen on
    baseline_passage_pcts: tuple[float, ...] = ()  # uniform int8's

    @property
    def met(self) -> bool:
        return self.measured.ppl_increase_pct <= self.budget_pct

    def to_json(self) -> dict[str, Any]:
        return {
            "quant_config": self.config.to_json(),
            "budget_pct": self.budget_pct,
            "met": self.met,
            "measured": {
                "ppl_increase_pct": self.measured.ppl_increase_pct, "perplexity": self.measured.perplexity,
                "passages_pct": list(self.passage_pcts),
            },
            "int8": {
                "ppl_increase_pct": self.baseline.ppl_increase_pct,
                "bytes_per_token": self.baseline_bytes_per_token,
                "passages_pct": list(self.baseline_passage_pcts),
            },
            "bytes_per_token": self.bytes_per_token,
            "formats": list(self.formats),
            "scan": {fmt: list(values) for fmt, values in self.scan.items()},
            "rounds": self.rounds,
        }  # fmt: skip

    def save(self, path: str | Path) -> None:
        """Write the map as JSON (`QuantConfig.load` and `QuantizedCache.from_config` read it)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    def render(self) -> str:
        verdict = "meets" if self.met else "does NOT meet"
        where = ""
        if len(self.passage_pcts) > 1:
            each = ", ".join(f"{pct:+.3f}%" for pct in self.passage_pcts)
            where = f" on the worst of {len(self.passage_pcts)} passages ({each})"
        return (
            f"Per-layer map for +{self.budget_pct:g}%: {self.config.describe()}\n"
            f"  measured {self.measured.ppl_increase_pct:+.3f}%{where} ({verdict} the budget), "
            f"{self.bytes_per_token:,.0f} B/token against uniform int8's {self.baseline_bytes_per_token:,.0f} "
            f"({self.baseline.ppl_increase_pct:+.3f}%)"
        )


def layer_costs(model: Any, formats: Sequence[str], block_size: int) -> dict[str, float]:
    """Bytes per token of one layer in each format (and "full", in the model's dtype)."""
    heads, head_dim = kv_heads_and_head_dim(decoder_config(model))
    costs = {FULL_PRECISION: float(2 * heads * head_dim * model.dtype.itemsize)}
    for fmt in formats:
        codec = get_codec(QuantConfig(**FORMAT_OPTIONS[fmt]).codec_name)
        costs[fmt] = codec.bytes_per_token(heads, head_dim, block_size)
    return costs


def recommend_layer_formats(
    model: Any,
    tokenizer: Any,
    text: str | Sequence[str] | None = None,
    budget_pct: float = 0.5,
    formats: Sequence[str] = ("int8", "int4", "int2"),
    options: CheckOptions | None = None,
    passages: int = 1,
) -> LayerMap:
    """The per-layer map of the module docstring for ``budget_pct`` percent perplexity.

    Args:
        text: the text to choose on (None: the built-in passage), or a list of texts, one passage each.
        passages: with one text, how many consecutive passages of ``options.max_tokens`` tokens to cut from it.
    """
    if budget_pct < 0:
        raise ValueError(f"budget_pct is a percentage >= 0; got {budget_pct}.")
    unknown = [f for f in formats if f not in FORMAT_OPTIONS]
    if unknown or not formats:
        raise ValueError(f"Unknown or no formats {unknown or '()'}; accepted: {', '.join(FORMAT_OPTIONS)}.")
    options = options or CheckOptions()
    chosen_on = passage_ids(tokenizer, text, passages, options)
    layers = int(decoder_config(model).num_hidden_layers)
    every = tuple(range(layers))
    runner = ConfigRunner(model, options, None)
    costs = layer_costs(model, (*dict.fromkeys((*formats, "int8")),), options.block_size)  # int8: the baseline
    configs = {
        f"{fmt} layer {layer}": options.config(fmt, tuple(i for i in every if i != layer))
        for fmt in formats
        for layer in every
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(grouped_sdpa_on_cpu(model))
        scans = [
            runner.score(ids[:, : options.scan_length(int(ids.shape[1]))], configs, "per-layer scan").scores
            for ids in chosen_on
        ]
        scan = {
            fmt: tuple(sum(s[f"{fmt} layer {layer}"].ppl_increase_pct for s in scans) / len(scans) for layer in every)
            for fmt in formats
        }
        uniform = ("int8",) * layers
        baseline = _measure_on_every_passage(runner, chosen_on, _map_config(uniform, options), "int8")
        tried = _search(runner, chosen_on, scan, costs, budget_pct, options)
    candidates = [*tried, (uniform, _map_config(uniform, options), baseline)]
    met = [c for c in candidates if c[2].worst.ppl_increase_pct <= budget_pct]
    if met:  # the fewest bytes among the measured maps that held the budget
        best = min(met, key=lambda c: (sum(costs[f] for f in c[0]), c[2].worst.ppl_increase_pct))
    else:  # none held: the smallest loss, reported as not meeting the budget
        best = min(candidates, key=lambda c: c[2].worst.ppl_increase_pct)
    chosen, config, measured = best
    return LayerMap(
        config=config,
        formats=chosen,
        budget_pct=budget_pct,
        measured=measured.worst,
        baseline=baseline.worst,
        bytes_per_token=sum(costs[fmt] for fmt in chosen),
        baseline_bytes_per_token=costs["int8"] * layers,
        scan=scan,
        rounds=len(tried),
        passage_pcts=measured.pcts,
        baseline_passage_pcts=baseline.pcts,
    )


def passage_ids(
    tokenizer: Any, text: str | Sequence[str] | None, passages: int, options: CheckOptions
) -> list[torch.Tensor]:
    """The passages to choose on, as token ids ``[1, n]``: each text of a list, or ``passages`` cut from one."""
    if isinstance(passages, bool) or not isinstance(passages, int) or passages < 1:
        raise ValueError(f"passages must be an int >= 1; got {passages!r}.")
    if text is not None and not isinstance(text, str):
        if passages != 1:
            raise ValueError("Give either a list of texts (one passage each) or passages=N with one text, not both.")
        if not text:
            raise ValueError("The list of texts to choose the map on is empty.")
        return [tokenize(tokenizer, one, options.max_tokens, options.block_size) for one in text]
    source = BUILTIN_TEXT if text is None else text
    if passages == 1:
        return [tokenize(tokenizer, source, options.max_tokens, options.block_size)]
    ids = tokenizer(source, return_tensors="pt")["input_ids"]
    length = options.max_tokens
    if ids.shape[1] < passages * length:
        raise ValueError(
            f"{passages} passages of {length:,} tokens need {passages * length:,} tokens of text; it has "
            f"{int(ids.shape[1]):,}. Give a longer text, fewer passages or fewer tokens per passage."
        )
    return [ids[:, i * length : (i + 1) * length] for i in range(passages)]


@dataclass(frozen=True)
class PassageScores:
    """One configuration measured on every passage: each passage's score, and the worst."""

    scores: tuple[CacheScore, ...]

    @property
    def worst(self) -> CacheScore:
        return max(self.scores, key=lambda score: score.ppl_increase_pct)

    @property
    def pcts(self) -> tuple[float, ...]:
        return tuple(score.ppl_increase_pct for score in self.scores)


def _measure_on_every_passage(
    runner: ConfigRunner, passages: Sequence[Any], config: QuantConfig, label: str
) -> PassageScores:
    return PassageScores(tuple(runner.score(ids, {"map": config}, label).scores["map"] for ids in passages))


def _search(
    runner: ConfigRunner,
    passages: Sequence[Any],
    scan: Mapping[str, Sequence[float]],
    costs: Mapping[str, float],
    budget_pct: float,
    options: CheckOptions,
) -> list[tuple[tuple[str, ...], QuantConfig, PassageScores]]:
    """Choose and measure maps until one holds the budget on every passage (at most `MAX_ROUNDS` measured).

    The summed single-layer losses underestimate the joint loss (a layer's error also shifts what later layers
    see), so after a miss the target is scaled by how far the prediction fell short of the worst passage, with
    a margin, and at least halved.
    """
    tried: list[tuple[tuple[str, ...], QuantConfig, PassageScores]] = []
    target = budget_pct * FIRST_TARGET
    while len(tried) < MAX_ROUNDS:
        chosen = choose_layer_formats(scan, costs, target)
        if any(chosen == previous for previous, _, _ in tried):  # the target moved too little to change the map
            target /= 2
            if target < 1e-6:
                break
            continue
        config = _map_config(chosen, options)
        measured = _measure_on_every_passage(runner, passages, config, "layer map")
        tried.append((chosen, config, measured))
        worst = measured.worst.ppl_increase_pct
        if worst <= budget_pct:
            break
        predicted = sum(max(0.0, scan[f][layer]) for layer, f in enumerate(chosen) if f != FULL_PRECISION)
        shortfall = worst / max(predicted, 1e-6)
        target = min(target / 2, CALIBRATION_MARGIN * budget_pct / shortfall)
    return tried


def _map_config(chosen: Sequence[str], options: CheckOptions) -> QuantConfig:
    """The chosen formats as one `QuantConfig`: int8 by default, each other layer named."""
    base = options.config("int8")
    names = {layer: _codec_name(fmt) for layer, fmt in enumerate(chosen)}
    return QuantConfig(
        bits=base.bits, fmt=base.fmt, residual=base.residual, sink_blocks=base.sink_blocks, layer_formats=names
    )


def _codec_name(fmt: str) -> str:
    return fmt if fmt == FULL_PRECISION else QuantConfig(**FORMAT_OPTIONS[fmt]).codec_name
