"""Measure what a lossy KV cache costs on a model before anyone turns it on.

from hf_kvgov.quality import check_quantization
report = check_quantization(model, tokenizer, text)      # int8 / fp8 / int4 against full precision
print(report.render())
"""

from hf_kvgov.quality.check import FORMAT_OPTIONS, CheckOptions, check_quantization
from hf_kvgov.quality.lockstep import CacheScore, StackedCache, score_in_lockstep
from hf_kvgov.quality.metrics import RunningScore
from hf_kvgov.quality.outliers import flagged_by_outliers, key_outlier_ratios, outlier_layers, outlier_ratio
from hf_kvgov.quality.recommend import Recommendation, layers_to_protect, recommend
from hf_kvgov.quality.report import QuantCheckReport, SensitivityScan

__all__ = [
    "FORMAT_OPTIONS",
    "CacheScore",
    "CheckOptions",
    "QuantCheckReport",
    "Recommendation",
    "RunningScore",
    "SensitivityScan",
    "StackedCache",
    "check_quantization",
    "flagged_by_outliers",
    "key_outlier_ratios",
    "layers_to_protect",
    "outlier_layers",
    "outlier_ratio",
    "recommend",
    "score_in_lockstep",
]
