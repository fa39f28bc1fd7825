"""The settings a quantized format fills in where they are not given, in one torch-free place.

The caches (`hf_kvgov.engine.quant_config.QuantConfig.filled`) and the planner (`kvgov plan`, which runs
without torch) read the same numbers, so a plan models what ``QuantizedCache(model, bits=...)`` builds.
"""

from __future__ import annotations

from typing import Any

# int2 needs KIVI's full-precision window and value groups: without them SmolLM2 loses 15.75% perplexity at
# 2,048 tokens, with them 3.92% (16-token blocks, fp16 statistics). On two novels no setting was chosen on (Emma,
# Mansfield Park; eval/RESULTS.md, int2 defaults on unseen text) fp16 statistics cost SmolLM2 +5.1% / +6.5% and
# Gemma-3-270M +4.3% / +6.3%, while one-byte statistics (a logarithmic scale and an e4m3 zero, `scale_bytes=1`:
# 0.198x of float16 K + V instead of 0.243x on SmolLM2) cost +8.0% / +11.4% and +7.3% / +10.6%, and a wider
# window does not make up for them at equal bytes. So `bits=2` means fp16 statistics; one byte stays an option.
INT2_RESIDUAL = 32
INT2_VALUE_GROUP = 32
INT2_BLOCK_SIZE = 16
INT2_SCALE_BYTES = 2


def format_defaults(bits: int, head_dim: int) -> dict[str, Any]:
    """The settings a quantized cache fills in where it is not given them: int2 as KIVI runs it (the newest 32
    tokens in full precision, values in groups of 32 channels where head_dim allows); every format seals its full
    blocks with fp16 statistics, the others with one scale per token and head."""
    if bits == 2:
        group = INT2_VALUE_GROUP if head_dim % INT2_VALUE_GROUP == 0 else None
        return {"residual": INT2_RESIDUAL, "group_size": group, "scale_bytes": INT2_SCALE_BYTES}
    return {"residual": 0, "group_size": None, "scale_bytes": 2}
