"""Measure what a lossy KV cache costs on a model before anyone turns it on.

from hf_kvgov.quality import check_quantization
report = check_quantization(model, tokenizer, text)      # int8 / fp8 / int4 against full precision
print(report.render())
"""

import importlib
from typing import Any

# Imported on first use: the command line reads the check's defaults without loading torch.
_EXPORTS = {
    "FORMAT_OPTIONS": "hf_kvgov.quality.check_defaults",
    "CheckOptions": "hf_kvgov.quality.check",
    "check_quantization": "hf_kvgov.quality.check",
    "CacheScore": "hf_kvgov.quality.lockstep",
    "StackedCache": "hf_kvgov.quality.lockstep",
    "score_in_lockstep": "hf_kvgov.quality.lockstep",
    "RunningScore": "hf_kvgov.quality.metrics",
    "flagged_by_outliers": "hf_kvgov.quality.outliers",
    "key_outlier_ratios": "hf_kvgov.quality.outliers",
    "outlier_layers": "hf_kvgov.quality.outliers",
    "outlier_ratio": "hf_kvgov.quality.outliers",
    "Recommendation": "hf_kvgov.quality.recommendation",
    "layers_to_protect": "hf_kvgov.quality.recommendation",
    "recommend": "hf_kvgov.quality.recommendation",
    "QuantCheckReport": "hf_kvgov.quality.report",
    "SensitivityScan": "hf_kvgov.quality.report",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


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
