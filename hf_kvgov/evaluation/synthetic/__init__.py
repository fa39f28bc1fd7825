"""RULER-style synthetic long-context tasks generated offline from any filler text, seeded."""

from hf_kvgov.evaluation.synthetic.common_words import CommonWordsConfig, generate_common_words
from hf_kvgov.evaluation.synthetic.niah import (
    PASSKEY_WORDING,
    RULER_WORDING,
    NiahConfig,
    NiahWording,
    generate_niah,
)
from hf_kvgov.evaluation.synthetic.sample import SyntheticSample, string_match_all, string_match_part
from hf_kvgov.evaluation.synthetic.variable_tracking import VariableTrackingConfig, generate_variable_tracking

__all__ = [
    "PASSKEY_WORDING",
    "RULER_WORDING",
    "CommonWordsConfig",
    "NiahConfig",
    "NiahWording",
    "SyntheticSample",
    "VariableTrackingConfig",
    "generate_common_words",
    "generate_niah",
    "generate_variable_tracking",
    "string_match_all",
    "string_match_part",
]
