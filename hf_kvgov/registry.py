"""Name -> cache factory: how the CLI, the demo and the eval suite ask for a cache. Every name parses into the chain
it stands for (`ChainParts`), checked and built through `hf_kvgov.chain` (`CacheSpec`).

Besides the fixed names (`dynamic`, `paged`, `int8`, `h2o`, ...), a family of caches (`CacheFamily`) answers to
`<family>@<argument>`: `h2o@0.2` or `h2o@256` (budget as a fraction of the prompt or in tokens), `sink@4+252`
(sinks + window), either with a codec for the kept slots (`h2o@0.2:int8`), H2O with what it evicts spilled and
recalled (`h2o@0.2+recall`) or its budget split over the layers as PyramidKV does (`h2o@0.2+pyramid`) or over each
layer's KV heads as AdaKV does (`snapkv@0.2+ada`), any registered policy on its own (`snapkv@0.2`, `tova@0.2:int8`,
`key_norm@256`, through `PolicyCache`), `int8@64` / `int4@64` / `int2@16` / `fp8@64` / `paged@64` (block size),
`disk@128` (hot tokens), `quant@map.json` (a per-layer format map from `kvgov check-quant --recommend`), `kvzip@0.2`
(a context compressed before its question: `CacheSpec.context_cache`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hf_kvgov.cache_spec import CacheSpec, ChainOf, ContextSpec, context_refusal, plain_attention
from hf_kvgov.engine.parts import ChainParts, Disk, Evict, HeavyHitter, Paging, Sink
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.format_defaults import INT2_BLOCK_SIZE, INT2_RESIDUAL, INT2_VALUE_GROUP, format_defaults
from hf_kvgov.hf.attention import paged_attention
from hf_kvgov.hf.compat import decoder_config, kv_heads_and_head_dim
from hf_kvgov.hf.eviction import SLOT_CODECS, eviction_attention
from hf_kvgov.policies import make_policy
from hf_kvgov.policies.budget import BUDGET_TEXT_FORMS, read_budget
from hf_kvgov.policies.head_adaptive import HeadAdaptive
from hf_kvgov.policies.pyramid import Pyramid
from hf_kvgov.tiers.recall_pages import DEFAULT_NEIGHBOURS

RECALL_SUFFIX = "recall"
PYRAMID_SUFFIX = "pyramid"
ADAPTIVE_SUFFIX = "ada"
SPANS_SUFFIX = "spans"  # a chosen page's neighbours come with it: the default since `Recall.neighbours` is 1


def _spec(name: str, description: str, parts: ChainParts, chain: ChainOf | None = None) -> CacheSpec:
    """The spec of a chain: lossless without a codec or a policy; a policy attends with the hf_kvgov attention,
    in-place block reads with the paged one. `chain` is for a chain that depends on the model (`parts` is then
    what it is for any model, but for the geometry-dependent fields)."""
    attention = eviction_attention if parts.policy is not None else plain_attention
    if parts.attention == "paged":
        attention = paged_attention
    lossless = parts.codec is None and parts.policy is None
    return CacheSpec(name, description, chain or (lambda model: parts), lossless, attention)


CACHES: dict[str, CacheSpec] = {}


def register_cache(spec: CacheSpec) -> None:
    CACHES[spec.name] = spec


def get_cache_spec(name: str, context: bool = False) -> CacheSpec:
    """The spec of a fixed name (`int8`) or of a family name with its argument (`h2o@0.2`). A cache that needs a
    context apart from its question (`kvzip@0.2`) is refused unless the caller gives one (`context`)."""
    if name in CACHES:
        return CACHES[name]
    family, at, argument = name.partition("@")
    if at and family in FAMILIES:
        spec = FAMILIES[family].parse(argument)
        if spec.needs_context and not context:
            raise ValueError(context_refusal(name))
        return spec
    forms = ", ".join(f"{family}@..." for family in FAMILIES)
    raise ValueError(
        f"Unknown cache {name!r}; names: {', '.join(CACHES)}; with an argument: {forms} "
        "(`kvgov demo --list-caches` gives each one's forms)."
    )


def cache_name_forms() -> str:
    """Every accepted cache name, a line each: the fixed names, then each family's forms (for --help)."""
    return "\n".join([f"  {', '.join(CACHES)}", *(f"  {family.syntax}" for family in FAMILIES.values())])


def kv_bytes(cache: Any) -> int:
    """Bytes of KV a cache holds: its own accounting when it has one, else the tensors it stores."""
    if hasattr(cache, "stats"):
        return int(cache.stats().bytes_used)
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


# ------------------------------------------------------------------ parameterized names


@dataclass(frozen=True)
class CacheFamily:
    """Caches named `<name>@<argument>`; `parse(argument)` returns the spec or raises a full-sentence ValueError."""

    name: str
    syntax: str  # the accepted forms, with examples, as error messages and --help show them
    parse: Callable[[str], CacheSpec]


FAMILIES: dict[str, CacheFamily] = {}


def register_family(family: CacheFamily) -> None:
    FAMILIES[family.name] = family


def _bad_argument(name: str, text: str, accepted: str) -> ValueError:
    return ValueError(f"Cannot read the cache name {name!r}: {accepted}; got {text!r}.")


def _count(name: str, text: str, what: str, minimum: int = 1) -> int:
    """`text` as a decimal integer of at least `minimum` (no sign, no spaces), else a ValueError naming `name`."""
    if not text.isdecimal() or int(text) < minimum:
        raise _bad_argument(name, text, f"{what} must be an integer of at least {minimum}")
    return int(text)


def _budget(name: str, text: str) -> int | float:
    """`0.2` -> a fraction in (0, 1] (it has a decimal point); `256` -> tokens (an integer of at least 1)."""
    if text.isdecimal():
        return _count(name, text, "a budget in tokens")
    budget = read_budget(text)
    if budget is None:
        raise _bad_argument(name, text, f"the budget must be {BUDGET_TEXT_FORMS}")
    return budget


def _slot_codec(name: str, argument: str) -> tuple[str, str | None]:
    """`0.2:int8` -> ("0.2", "int8"): an eviction family's argument and the codec of its kept slots (or None)."""
    head, colon, codec = argument.partition(":")
    if not colon:
        return argument, None
    if codec not in SLOT_CODECS:
        raise _bad_argument(name, codec, f"the codec after ':' must be one of {', '.join(SLOT_CODECS)}")
    return head, codec


def _stored_as(codec: str | None) -> str:
    """What an eviction cache's description says about how its kept slots are stored."""
    if codec is None:
        return ""
    return f"; kept slots stored as {codec} codes with scales per slot (keys and values)"


SUFFIXES = (RECALL_SUFFIX, SPANS_SUFFIX, PYRAMID_SUFFIX, ADAPTIVE_SUFFIX)


def _eviction_argument(name: str, argument: str) -> tuple[int | float, dict[str, Any]]:
    """`0.2:int8+recall+pyramid+ada` -> (0.2, the chain's codec / spill and the policy's allocation / heads)."""
    head, *suffixes = argument.split("+")
    family = name.partition("@")[0]
    for suffix in suffixes:
        if suffix not in SUFFIXES or suffixes.count(suffix) > 1:
            accepted = f"the suffixes after '+' are {', '.join(map(repr, SUFFIXES))}, each at most once"
            examples = ", ".join(f"{family}@0.2+{'recall+' * (known == SPANS_SUFFIX)}{known}" for known in SUFFIXES)
            raise _bad_argument(name, suffix, f"{accepted} ({examples})")
    if SPANS_SUFFIX in suffixes and RECALL_SUFFIX not in suffixes:
        needs = f"'+spans' names recall's neighbouring pages, so it needs '+recall' ({family}@0.2+recall+spans)"
        raise _bad_argument(name, SPANS_SUFFIX, needs)
    text, codec = _slot_codec(name, head)
    neighbours = 1 if SPANS_SUFFIX in suffixes else DEFAULT_NEIGHBOURS
    spill = Disk(recall_neighbours=neighbours) if RECALL_SUFFIX in suffixes else None
    options: dict[str, Any] = {"codec": codec, "spill": spill}
    if PYRAMID_SUFFIX in suffixes:
        options["allocation"] = Pyramid()
    if ADAPTIVE_SUFFIX in suffixes:
        options["heads"] = HeadAdaptive()
    return _budget(name, text), options


def _evicting(policy: HeavyHitter | Evict, options: dict[str, Any]) -> ChainParts:
    """The chain of an eviction family's name: the policy with its allocation and heads, the codec, recall."""
    shaped = replace(policy, allocation=options.get("allocation"), heads=options.get("heads"))
    return ChainParts.of(codec=options["codec"], policy=shaped, spill=options["spill"])


def _options_described(options: dict[str, Any]) -> str:
    """What an eviction cache's description says about its codec, recall tier and layer allocation."""
    text = _stored_as(options["codec"])
    spill: Disk | None = options["spill"]
    if spill is not None:
        recall = spill.recall()
        text += (
            f"; evicted tokens spill to {recall.page_tokens}-token disk pages, the {recall.pages} pages a query "
            f"scores highest are recalled per (sequence, layer, KV head) at each step into {recall.buffer_words}"
        )
        if recall.neighbours:
            text += f", a chosen page's {recall.neighbours} neighbour(s) on each side coming with it"
    if "allocation" in options:
        text += "; the budget split over the evicting layers as a pyramid (PyramidKV: more below, same total)"
    if "heads" in options:
        text += "; each layer's total shared among its KV heads by score, a floor of 20% each (AdaKV)"
    return text


def _share(budget: int | float, of: str = "the prompt") -> str:
    return f"{100 * budget:g}% of {of}" if isinstance(budget, float) else f"{budget} tokens"


def _parse_h2o(argument: str) -> CacheSpec:
    name = f"h2o@{argument}"
    budget, options = _eviction_argument(name, argument)
    return _spec(
        name,
        f"HeavyHitterCache (H2O): {_share(budget)} per KV head, half recent window, half heavy hitters"
        + _options_described(options),
        _evicting(HeavyHitter(budget), options),
    )


# Policies served on their own by `PolicyCache` under their registered name (H2O and sinks have their caches).
POLICY_FAMILIES = ("snapkv", "tova", "key_norm", "mean_mass", "expected_attention", "expected_attention_running")


def _parse_policy(policy: str, argument: str) -> CacheSpec:
    name = f"{policy}@{argument}"
    budget, options = _eviction_argument(name, argument)
    return _spec(
        name,
        f"PolicyCache ({make_policy(policy)!r}): {_share(budget)} per KV head at prefill and at every step"
        + _options_described(options),
        _evicting(Evict(policy, budget), options),
    )


def _parse_sink(argument: str) -> CacheSpec:
    name = f"sink@{argument}"
    text, codec = _slot_codec(name, argument)
    sinks, plus, window = text.partition("+")
    if not plus:
        raise _bad_argument(name, text, "the argument must be <sinks>+<window> in tokens, as in sink@4+252")
    n_sink, recent = _count(name, sinks, "the number of sinks", 0), _count(name, window, "the window")
    return _spec(
        name,
        f"SinkCache (StreamingLLM): {n_sink} sinks + {recent}-token recent window per KV head{_stored_as(codec)}",
        ChainParts.of(codec=codec, policy=Sink(n_sink, recent)),
    )


def _parse_quantized(family: str, argument: str) -> CacheSpec:
    block_size = _count(f"{family}@{argument}", argument, "the block size in tokens")
    return _spec(
        f"{family}@{argument}",
        f"QuantizedCache {family}, {block_size}-token blocks: keys per channel, values per token",
        ChainParts.of(pool=Paging(block_size), codec=family),
    )


def int2_kivi(model: Any = None) -> QuantConfig:
    """int2 as KIVI runs it (`format_defaults`): the newest tokens in full precision, values in groups of 32
    channels (one group per head when `model`'s head_dim is not a multiple of 32), fp16 scales and zeros. Without
    a model, groups of 32."""
    head_dim = INT2_VALUE_GROUP if model is None else kv_heads_and_head_dim(decoder_config(model))[1]
    return QuantConfig(bits=2, **format_defaults(2, head_dim))


def _int2_spec(name: str, description: str, block_size: int) -> CacheSpec:
    def chain(model: Any) -> ChainParts:
        return ChainParts.of(pool=Paging(block_size), codec=int2_kivi(model))

    return _spec(name, description, chain(None), chain)


def _parse_int2(argument: str) -> CacheSpec:
    block_size = _count(f"int2@{argument}", argument, "the block size in tokens")
    description = (
        f"QuantizedCache int2 (KIVI), {block_size}-token blocks, the newest {INT2_RESIDUAL} tokens in full "
        f"precision, value groups of {INT2_VALUE_GROUP} channels, fp16 scales and zeros"
    )
    return _int2_spec(f"int2@{argument}", description, block_size)


def _parse_layer_map(argument: str) -> CacheSpec:
    """`quant@map.json`: the file is read when the name is, so a bad path fails before any model runs."""
    config = QuantConfig.load(Path(argument))
    return _spec(
        f"quant@{argument}",
        f"QuantizedCache from the per-layer map {argument}: {config.describe()}",
        ChainParts.of(codec=config),
    )


def _parse_kvzip(argument: str) -> CacheSpec:
    name = f"kvzip@{argument}"
    text, codec = _slot_codec(name, argument)
    budget = _budget(name, text)
    description = (
        f"KVzip: the context compressed to {_share(budget, 'the context')} per KV head before the "
        f"question, by how much the model needs each token to repeat it{_stored_as(codec)}"
    )
    return ContextSpec(name, description, None, False, eviction_attention, budget, codec)


def _parse_paged(argument: str) -> CacheSpec:
    block_size = _count(f"paged@{argument}", argument, "the block size in tokens")
    description = f"PagedCache, {block_size}-token blocks, contiguous K/V for any attention"
    return _spec(f"paged@{argument}", description, ChainParts.of(pool=Paging(block_size)))


def _parse_disk(argument: str) -> CacheSpec:
    hot = _count(f"disk@{argument}", argument, "the hot window in tokens", 0)
    description = f"DiskOffloadCache: blocks older than a {hot}-token hot window spill to a private temp file"
    return _spec(f"disk@{argument}", description, ChainParts.of(spill=Disk(hot_tokens=hot)))


for _family in (
    CacheFamily(
        "h2o",
        "h2o@<budget>[:<codec>][+recall][+pyramid][+ada], a fraction of the prompt (h2o@0.2) or tokens (h2o@256), "
        f"kept slots optionally quantized (h2o@0.2:int8; codecs {', '.join(SLOT_CODECS)}), evicted tokens "
        "optionally spilled and recalled (h2o@0.2+recall), the budget optionally split over layers "
        "(h2o@0.2+pyramid) and over each layer's KV heads (h2o@0.2+ada)",
        _parse_h2o,
    ),
    CacheFamily("sink", "sink@<sinks>+<window>[:<codec>] in tokens (sink@4+252, sink@4+252:int8)", _parse_sink),
    *(
        CacheFamily(
            policy,
            f"{policy}@<budget>[:<codec>][+recall][+pyramid][+ada], the {policy} policy alone, as h2o ({policy}@0.2)",
            functools.partial(_parse_policy, policy),
        )
        for policy in POLICY_FAMILIES
    ),
    CacheFamily(
        "kvzip",
        "kvzip@<budget>[:<codec>], the context compressed before its question (KVzip; kvzip@0.2), only where a "
        "prompt's context comes apart from its question (kvgov eval synthetic / longbench --compress context)",
        _parse_kvzip,
    ),
    CacheFamily("int8", "int8@<block size> (int8@64)", functools.partial(_parse_quantized, "int8")),
    CacheFamily("int4", "int4@<block size> (int4@64)", functools.partial(_parse_quantized, "int4")),
    CacheFamily("int2", "int2@<block size> (int2@16), KIVI's residual and value groups as int2", _parse_int2),
    CacheFamily("fp8", "fp8@<block size> (fp8@64)", functools.partial(_parse_quantized, "fp8")),
    CacheFamily("quant", "quant@<map.json>, a format per layer (kvgov check-quant --recommend)", _parse_layer_map),
    CacheFamily("paged", "paged@<block size> (paged@64)", _parse_paged),
    CacheFamily("disk", "disk@<hot tokens> (disk@128)", _parse_disk),
):
    register_family(_family)


register_cache(CacheSpec("dynamic", "transformers DynamicCache (the reference)", None, True))
for _name, _description, _parts in (
    ("paged", "PagedCache, 16-token blocks, contiguous K/V for any attention", ChainParts()),
    ("paged-attn", "PagedCache read in place by the hf_kvgov paged attention", ChainParts(attention="paged")),
    (
        "int8",
        "QuantizedCache int8: keys per channel, values per token; sink and tail blocks in full precision",
        ChainParts.of(codec="int8"),
    ),
    (
        "int4",
        "QuantizedCache int4, two codes per byte: keys per channel, values per token",
        ChainParts.of(codec="int4"),
    ),
    (
        "fp8",
        "QuantizedCache fp8 e4m3 with one scale per channel (keys) or per token (values)",
        ChainParts.of(codec="fp8"),
    ),
    # Eviction caches keep different tokens per KV head: generate runs under the hf_kvgov attention.
    (
        "h2o",
        "HeavyHitterCache (H2O): 20% of the prompt per KV head, half recent window, half heavy hitters",
        ChainParts(policy=HeavyHitter(0.2)),
    ),
    (
        "sink",
        "SinkCache (StreamingLLM): 4 sinks + recent window, 20% of the prompt (at least 64 slots) per KV head",
        ChainParts(policy=Sink(4, 60, 0.2)),
    ),
    (
        "disk",
        "DiskOffloadCache: blocks older than a 512-token hot window spill to a private temp file",
        ChainParts(spill=Disk()),
    ),
    (
        "int8+disk",
        "QuantizedDiskCache int8: sealed blocks older than a 512-token hot window spill as codes to a temp file",
        ChainParts.of(codec="int8", spill=Disk()),
    ),
):
    register_cache(_spec(_name, _description, _parts))
register_cache(
    _int2_spec(
        "int2",
        "QuantizedCache int2 (KIVI), four codes per byte: keys per channel over 16-token blocks, values per token "
        "in groups of 32 channels, fp16 scales and zeros, the newest 32 tokens and the sink block in full "
        "precision",
        INT2_BLOCK_SIZE,
    )
)
