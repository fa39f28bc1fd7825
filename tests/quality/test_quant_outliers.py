"""The sanity check on a model with planted key outliers: it must see them, flag int4 and recommend safer.

Two copies of the tiny random Llama: unplanted, and with output channels 6 and 7 of both KV heads of
layer 0's `k_proj` scaled by 64 (a power of two: the rest of the weights stay bit for bit). Measured:
layer 0's outlier ratio (max / median channel magnitude of the cached keys) is 1.2 unplanted and 69.7
planted; layer 1 stays at 1.6.

Per-channel key scales absorb a scaled channel on *this* model: its attention is nearly uniform (random
weights), so int4 costs about as little perplexity on both copies. Measurement alone would recommend
int4 for both; the check must flag int4 on the planted layer from the outliers themselves and recommend
a configuration that does not quantize layer 0 at 4 bits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_kvgov.quality import CheckOptions, QuantCheckReport, check_quantization
from hf_kvgov.quality.outliers import flagged_by_outliers, outlier_layers
from hf_kvgov.quality.recommendation import TOP1_AGREEMENT_FLOOR
from tests.char_tokenizer import char_tokenizer
from tests.conftest import tiny_llama

OPTIONS = CheckOptions(max_tokens=256, block_size=8, scan_tokens=64)
PLANTED_CHANNELS = (6, 7)
HEAD_DIM = 16


def planted_model(factor: float = 64.0) -> LlamaForCausalLM:
    model = tiny_llama()
    weight = model.model.layers[0].self_attn.k_proj.weight  # [kv_heads * head_dim, hidden]
    with torch.no_grad():
        for head in range(model.config.num_key_value_heads):
            for channel in PLANTED_CHANNELS:
                weight[head * HEAD_DIM + channel] *= factor
    return model


@pytest.fixture(scope="module")
def reports(austen_text: str) -> dict[str, QuantCheckReport]:
    text = austen_text[40_000:41_000]
    tokenizer = char_tokenizer()
    return {
        "unplanted": check_quantization(tiny_llama(), tokenizer, text, OPTIONS),
        "planted": check_quantization(planted_model(), tokenizer, text, OPTIONS),
    }


def test_the_planted_layer_has_a_large_outlier_ratio(reports: dict[str, QuantCheckReport]) -> None:
    clean, planted = reports["unplanted"].key_outlier_ratios, reports["planted"].key_outlier_ratios
    assert max(clean) < 3.0, clean
    # Scaling two channels per head by 64 multiplies their magnitude by 64 and leaves the median channel
    # (one of the 14 others) in place: the ratio becomes ~64x what those channels had, here 69.7.
    assert planted[0] > 40.0 and planted[1] < 3.0, planted
    assert reports["planted"].outlier_layers() == [0] and reports["unplanted"].outlier_layers() == []


def test_int4_is_flagged_and_a_safer_configuration_recommended(reports: dict[str, QuantCheckReport]) -> None:
    clean, planted = reports["unplanted"], reports["planted"]
    # Unplanted: every format is within the tolerance and nothing is flagged, so the smallest that keeps the top
    # token wins (on random weights int4 changes it too often, and the verdict says so).
    assert clean.flagged == () and clean.protected is None
    keeping = [s for s in clean.formats if s.top1_agreement >= TOP1_AGREEMENT_FLOOR]
    assert clean.recommendation.name == min(keeping, key=lambda s: s.bytes_per_token).name
    assert not any("outlier" in line or "flagged" in line for line in clean.verdict())
    # Planted: int4 is flagged on layer 0, measured with layer 0 in full precision, and not recommended as is.
    assert planted.flagged == ("int4",)
    assert planted.protected is not None and planted.protected.name == "int4 + full-precision layers 0"
    options = planted.recommendation.options
    assert options is not None, planted.recommendation.reason
    assert options["bits"] == 8 or 0 in options.get("full_precision_layers", ()), options
    verdict = "\n".join(planted.verdict())
    assert "keys of layers 0 have outlier channels (up to 69." in verdict
    assert "int4 is flagged: on layers 0 its step is coarser than a median key channel's values" in verdict
    assert "int4 is flagged" in planted.render() and planted.to_dict()["flagged"] == ["int4"]


def test_outlier_layer_rules() -> None:
    ratios = [12.0, 2.0, float("nan"), 40.0, 10.0]
    assert outlier_layers(ratios) == (3, 0, 4)  # at or above 10x, the most extreme first
    assert outlier_layers(ratios, threshold=20.0) == (3,)
    assert flagged_by_outliers(4, ratios) == (3, 0, 4)
    assert flagged_by_outliers(8, ratios) == ()  # an 8-bit step is 1/255 of the channel's range
